"""The Celery app every outbox process runs, with every task registered: the composition root.

``outbox worker``, ``outbox beat`` and ``outbox flower`` use this app, and so does Celery's
own command line::

    celery -A outbox.cli.celery_app worker -Q dispatch,lookup,reconcile,human

The workers layer defines the app and the dispatch task; the reconcilers layer adds the
sweep, lookup and escalation tasks to it. Neither imports the other's tasks (workers never
import reconcilers): only this module, above both, puts them together. Importing it needs
the ``[worker]`` extra and connects to nothing (the app configures itself when first used); it
lets the process start the embedded PostgreSQL when no URL is set, as the command line does.
"""

from __future__ import annotations

import outbox.reconcilers.tasks
import outbox.workers.tasks
from outbox.db import allow_embedded_start
from outbox.workers.app import app

# `celery -A outbox.cli.celery_app worker` with OUTBOX_DATABASE_URL unset starts the embedded
# PostgreSQL as `outbox worker` does: this module is the command line's, not a library's.
allow_embedded_start()

#: The task modules registered on :data:`app`, for ``celery inspect registered`` and tests.
TASK_MODULES = (outbox.workers.tasks.__name__, outbox.reconcilers.tasks.__name__)

__all__ = ["TASK_MODULES", "app"]
