"""Putting a message back soon, without a host's clock deciding when it runs.

Celery's ``retry(countdown=…)`` publishes the new message with an absolute ``eta`` computed
on this host's clock, and the worker that receives it (any host) holds it until its own
clock reaches that time: a worker five minutes behind this one would hold it five minutes.
Here the pause is measured on this process's monotonic clock before the message is put
back, and the new message carries no ``eta``: the next worker to take it runs it at once.
"""

from __future__ import annotations

import random
import time
from typing import Any

from celery import Task

#: The pause before a message is put back because an operation's lock was busy: about as
#: long as another component's move under that lock takes; jittered, so the messages of
#: many busy operations do not all come back at the same instant.
MIN_PAUSE_S = 0.2
MAX_PAUSE_S = 0.5


def retry_soon(task: Task, **options: Any) -> Exception:
    """Pause a moment, then :meth:`celery.Task.retry` (which raises) with no ``eta``."""
    time.sleep(random.uniform(MIN_PAUSE_S, MAX_PAUSE_S))  # noqa: S311 -- jitter, not secrets
    # countdown=0, not None: None means Celery's default_retry_delay (three minutes).
    return task.retry(countdown=0, **options)  # type: ignore[no-any-return]
