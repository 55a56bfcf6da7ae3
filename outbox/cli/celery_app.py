"""The Celery app every outbox process runs, with every task registered: the composition root.

``outbox worker``, ``outbox beat`` and ``outbox flower`` use this app, and so does Celery's
own command line::

    celery -A outbox.cli.celery_app worker -Q dispatch,lookup,reconcile,human

The workers layer defines the app and the dispatch task; the reconcilers layer adds the
sweep, lookup and escalation tasks to it. Neither imports the other's tasks (workers never
import reconcilers): only this module, above both, puts them together. Importing it needs
the ``[worker]`` extra and connects to nothing (the app configures itself when first used).
"""

from __future__ import annotations

import outbox.reconcilers.tasks
import outbox.workers.tasks
from outbox.workers.app import app

#: The task modules registered on :data:`app`, for ``celery inspect registered`` and tests.
TASK_MODULES = (outbox.workers.tasks.__name__, outbox.reconcilers.tasks.__name__)

__all__ = ["TASK_MODULES", "app"]
