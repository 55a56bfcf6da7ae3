"""Thin Celery tasks: a message names an operation; the plain functions do the work."""

from __future__ import annotations

import logging
import random

from celery import Task

from workers import runtime
from workers.app import DISPATCH_TASK, app
from workers.dispatch import Outcome, dispatch

log = logging.getLogger(__name__)

#: Times a message is put back when another component holds the operation's lock; after
#: that it is dropped, and the relay publishes the row again if it is still planned.
LOCK_BUSY_RETRIES = 5


@app.task(name=DISPATCH_TASK, bind=True)  # type: ignore[untyped-decorator]
def dispatch_task(
    self: Task, operation_id: str, tool: str | None = None, target: str | None = None
) -> str:
    """Make one attempt of operation ``operation_id``; ``tool``/``target`` are for Flower."""
    report = dispatch(operation_id, engine=runtime.dispatch_engine())
    if report.outcome is Outcome.LOCK_BUSY:
        if self.request.retries < LOCK_BUSY_RETRIES:
            raise self.retry(countdown=0.2 + random.random() * 0.3)  # noqa: S311
        log.info(
            "dropping a message for %s: its lock stayed busy",
            operation_id,
            extra={"action": "dispatch_dropped", "operation_id": operation_id},
        )
    return report.outcome.value
