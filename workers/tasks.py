"""Thin Celery tasks: a message names an operation; the plain functions do the work."""

from __future__ import annotations

import logging
import random

from celery import Task

from workers import runtime
from workers.app import DISPATCH_TASK, app
from workers.dispatch import Outcome, dispatch
from workers.locking import DispatchLocks

log = logging.getLogger(__name__)

#: Times a message is put back when another component holds the operation's lock; after
#: that it is dropped, and the relay publishes the row again if it is still planned.
LOCK_BUSY_RETRIES = 5


@app.task(name=DISPATCH_TASK, bind=True)  # type: ignore[untyped-decorator]
def dispatch_task(
    self: Task,
    operation_id: str | None = None,
    tool: str | None = None,
    target: str | None = None,
    *,
    operation_ids: list[str] | None = None,
    tools: list[str] | None = None,
) -> str:
    """Make one attempt of ``operation_id`` (or of each of ``operation_ids``, in turn).

    ``tool``/``target``/``tools`` are only for people watching Flower. Each operation gets
    its own lock and attempt, exactly as if it had a message of its own (the locks are
    taken in turn on one connection, used by one attempt at a time); one
    that raises does not stop the others (the first error is raised at the end, so the
    message shows as failed). Operations whose lock was busy are put back as one message.
    """
    del tool, target, tools
    ids = [operation_id] if operation_id is not None else list(operation_ids or [])
    outcomes: list[str] = []
    busy: list[str] = []
    error: Exception | None = None
    engine = runtime.engine()
    # One connection takes the operations' locks in turn (each released as the next is
    # taken): never two attempts on it at once, one round trip and checkout fewer each.
    with DispatchLocks(engine) as locks:
        for one in ids:
            try:
                report = dispatch(one, engine=engine, locks=locks)
            except Exception as exc:  # the others still get their attempt
                log.exception(
                    "dispatching %s failed",
                    one,
                    extra={"action": "dispatch_error", "operation_id": one},
                )
                error = error or exc
                outcomes.append("error")
                continue
            outcomes.append(report.outcome.value)
            if report.outcome is Outcome.LOCK_BUSY:
                busy.append(one)
    if busy:
        if self.request.retries < LOCK_BUSY_RETRIES:
            raise self.retry(
                kwargs={"operation_ids": busy},
                countdown=0.2 + random.random() * 0.3,  # noqa: S311
            )
        for one in busy:
            log.info(
                "dropping a message for %s: its lock stayed busy",
                one,
                extra={"action": "dispatch_dropped", "operation_id": one},
            )
    if error is not None:
        raise error
    return ", ".join(outcomes)
