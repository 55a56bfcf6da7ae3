"""Thin Celery tasks: a message names an operation; the plain functions do the work."""

from __future__ import annotations

import contextlib
import logging
import time
from uuid import UUID

from celery import Task

from outbox.db import is_database_error
from outbox.logs import Action, describe_error
from outbox.workers import (
    direct,  # noqa: F401 -- its worker_init handler: the direct take
    handoff,
    runtime,
)
from outbox.workers.app import DISPATCH_TASK, SAGA_TASK, app
from outbox.workers.dispatch import Outcome, dispatch
from outbox.workers.locking import DispatchLocks
from outbox.workers.retry import retry_soon

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

    The hard time limit is the message's, but it is each attempt that must fit in it: an
    operation after the first starts only if its whole attempt (send deadline + timeout +
    margin) ends before the limit; the ones that would not are handed back as a new message
    (:func:`hand_back`), nothing written for them.
    """
    del tool, target, tools
    began = time.monotonic()
    ids = [operation_id] if operation_id is not None else list(operation_ids or [])
    limit = _hard_time_limit(self)
    finish_by = None if limit is None else began + limit
    outcomes: list[str] = []
    busy: list[str] = []
    deferred: list[str] = []
    settled_steps: list[str] = []
    error: Exception | None = None
    engine = runtime.engine()
    handoffs = handoff.active()
    # One connection takes the operations' locks in turn (each released as the next is
    # taken): never two attempts on it at once, one round trip and checkout fewer each. A lock
    # this process's direct take already holds for one of them is adopted (outbox.workers.handoff).
    with DispatchLocks(engine, adopt=None if handoffs is None else handoffs.adopt) as locks:
        for index, one in enumerate(ids):
            if deferred:  # keep the message's order: once one waits, the rest wait too
                deferred.append(one)
                outcomes.append(Outcome.DEFERRED.value)
                continue
            try:
                # The first operation always gets its attempt (the limit covers one of the
                # slowest tool's), so a handed-back message always makes progress.
                report = dispatch(
                    one, engine=engine, locks=locks, finish_by=finish_by if index else None
                )
            except Exception as exc:  # noqa: BLE001 -- logged below; the others get their attempt
                outcomes.append("error")
                error = error or (exc if _log_dispatch_error(one, exc) else None)
                continue
            outcomes.append(report.outcome.value)
            if report.saga and report.outcome in _SAGA_NUDGES:
                settled_steps.append(one)
            if report.outcome is Outcome.LOCK_BUSY:
                busy.append(one)
            elif report.outcome is Outcome.DEFERRED:
                deferred.append(one)
    _release_unadopted(handoffs, ids)
    if settled_steps:
        nudge_sagas(settled_steps)
    if deferred:
        hand_back(self, deferred)
    if busy:
        if self.request.retries < LOCK_BUSY_RETRIES:
            raise retry_soon(self, kwargs={"operation_ids": busy})
        for one in busy:
            log.info(
                "dropping a message for %s: its lock stayed busy",
                one,
                extra={"action": Action.DISPATCH_DROPPED, "operation_id": one},
            )
    if error is not None:
        raise error
    return ", ".join(outcomes)


def _release_unadopted(handoffs: handoff.Handoffs | None, operation_ids: list[str]) -> None:
    """Release a lock the direct take handed for an operation of this message that its
    attempt did not adopt (none as a rule: a message's first operation always locks)."""
    if handoffs is None or not len(handoffs):
        return
    ids = []
    for value in operation_ids:
        with contextlib.suppress(ValueError):  # a malformed id failed its attempt already
            ids.append(UUID(str(value)))
    handoffs.release(ids)


def _log_dispatch_error(operation_id: str, exc: Exception) -> bool:
    """Log what dispatching ``operation_id`` raised; whether the message should fail for it.

    A database error (a restart under the worker) is one line, its class and first line,
    never the driver's statement text, parameters or traceback, and is not raised: the relay
    publishes a planned row again, the sweep checks a sent one. Anything else is a bug: its
    traceback, and the message fails."""
    if not is_database_error(exc):
        log.exception(
            "dispatching %s failed",
            operation_id,
            extra={"action": Action.DISPATCH_ERROR, "operation_id": operation_id},
        )
        return True
    error = describe_error(exc)
    log.error(
        "dispatching %s failed on the database: %s",
        operation_id,
        error,
        extra={"action": Action.DISPATCH_ERROR, "operation_id": operation_id, "error": error},
    )
    return False


#: The outcomes after which a saga may have something to do: release the next step, or
#: compensate.
_SAGA_NUDGES = frozenset({Outcome.CONFIRMED, Outcome.FAILED})


def nudge_sagas(operation_ids: list[str]) -> None:
    """Ask the saga driver (``outbox.saga``, on the reconcile queue) to advance the sagas of
    these operations, whose outcome is committed. Best effort: a lost message costs only
    time, the periodic pass advances every live saga anyway."""
    try:
        app.send_task(
            SAGA_TASK, kwargs={"operation_ids": operation_ids}, queue="reconcile", retry=False
        )
    except Exception as exc:  # the periodic pass advances the saga; this message still acks
        log.error(  # noqa: TRY400 -- a traceback only for what is not the database's
            "nudging the sagas of %d operations failed: %s",
            len(operation_ids),
            describe_error(exc),
            exc_info=not is_database_error(exc),
            extra={"action": Action.SAGA_ADVANCE_FAILED, "operations": len(operation_ids)},
        )


def hand_back(task: Task, operation_ids: list[str]) -> None:
    """Publish ``operation_ids`` as a new message (a fresh time limit, no retry counted).

    If the broker refuses, they stay `planned` with their message marked published: the
    relay publishes them again after its republish delay, so nothing is lost either way.
    """
    try:
        task.apply_async(kwargs={"operation_ids": operation_ids}, retry=False)
    except Exception as exc:  # the relay republishes them; this message still acks
        log.error(  # noqa: TRY400 -- a traceback only for what is not the database's
            "handing %d operations back to the broker failed: %s",
            len(operation_ids),
            describe_error(exc),
            exc_info=not is_database_error(exc),
            extra={"action": Action.DISPATCH_HAND_BACK_FAILED, "operations": len(operation_ids)},
        )
        return
    log.info(
        "%d operations handed back as a new message: no time left in this one",
        len(operation_ids),
        extra={"action": Action.DISPATCH_HANDED_BACK, "operations": len(operation_ids)},
    )


def _hard_time_limit(task: Task) -> float | None:
    """The hard time limit this message runs under (its own, else the app's), in seconds."""
    own = (task.request.timelimit or (None, None))[0]
    limit = own if own is not None else task.app.conf.task_time_limit
    return float(limit) if limit else None
