"""Thin Celery tasks of the reconciler, and the beat schedule that drives them.

Beat's messages carry no Celery ``expires`` (see :mod:`outbox.reconcilers.periodic`: a host's clock
must not decide whether a run happens). On RabbitMQ they carry ``expiration`` instead, a
time-to-live the broker measures on its own clock from the moment it queued the message:
a periodic message no worker took within one interval is dropped, so the queue holds no
backlog while the workers are down. The database broker ignores it: a backlog there is
drained at the transport's pace, each message a sweep that finds little or nothing due.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any
from uuid import UUID

from celery import Task
from celery.schedules import schedule

from outbox.config import get_settings
from outbox.db import is_database_error
from outbox.logs import Action, describe_error
from outbox.reconcilers.lookup import LookupOutcome, lookup
from outbox.reconcilers.periodic import sweep_once
from outbox.reconcilers.sagas import nudge_sagas_of_and_commit
from outbox.reconcilers.sweep import SweepConfig
from outbox.reconcilers.webhooks import WebhookDeliverer, deliver_one
from outbox.workers import runtime
from outbox.workers.app import ESCALATE_TASK, LOOKUP_TASK, SAGA_TASK, SWEEP_TASK, app
from outbox.workers.beat import steady_now
from outbox.workers.retry import retry_soon

log = logging.getLogger(__name__)

#: Times a lookup message is put back while another component holds the operation's lock;
#: after that it is dropped, and the sweep routes the row again when its lease
#: (OUTBOX_LOOKUP_LEASE) ends.
LOCK_BUSY_RETRIES = 5
#: Seconds between webhook delivery runs: an escalation reaches its receiver within this.
WEBHOOK_INTERVAL_S = 2.0


@app.task(name=LOOKUP_TASK, bind=True)  # type: ignore[untyped-decorator]
def lookup_task(self: Task, operation_id: str) -> str:
    """Ask the remote about one `unknown` operation."""
    engine = runtime.engine()
    report = lookup(operation_id, engine=engine)
    if report.outcome is LookupOutcome.LOCK_BUSY and self.request.retries < LOCK_BUSY_RETRIES:
        raise retry_soon(self)
    if report.outcome in (LookupOutcome.CONFIRMED, LookupOutcome.FAILED):
        # A saga's step decided: its saga may release the next step or compensate now.
        # Best effort: the lookup is committed whatever happens here; the sweep catches up.
        try:
            nudge_sagas_of_and_commit(engine, [report.operation_id])
        except Exception as exc:
            log.error(  # noqa: TRY400 -- a traceback only for what is not the database's
                "advancing the saga of %s failed: %s",
                report.operation_id,
                describe_error(exc),
                exc_info=not is_database_error(exc),
                extra={"action": Action.SAGA_ADVANCE_FAILED, "operation_id": operation_id},
            )
    return report.outcome.value


@app.task(name=SAGA_TASK)  # type: ignore[untyped-decorator]
def saga_task(operation_ids: list[str]) -> dict[str, int]:
    """Advance the sagas of these operations, whose outcome just committed (the dispatch
    task's nudge; the periodic sweep advances every live saga anyway)."""
    result = nudge_sagas_of_and_commit(runtime.engine(), [UUID(one) for one in operation_ids])
    return {"advanced": result.advanced, "busy": result.busy, "failed": result.failed}


def _request_lookup(operation_id: UUID) -> None:
    lookup_task.apply_async(kwargs={"operation_id": str(operation_id)}, queue="lookup")


@app.task(name=SWEEP_TASK)  # type: ignore[untyped-decorator]
def sweep_task() -> dict[str, int]:
    """One sweep: lost dispatchers to `unknown`, due `unknown` rows routed; nothing if
    another sweep is running (a backlog of messages, or a second beat)."""
    result = sweep_once(
        runtime.engine(), SweepConfig.from_settings(), request_lookup=_request_lookup
    )
    if result is None:
        return {"skipped": 1}
    counts = dict(vars(result))
    if any(counts.values()):
        log.info("sweep: %s", counts, extra={"action": Action.SWEEP_DONE, **counts})
    return counts


def _beat_schedule() -> dict[str, Any]:
    settings = get_settings()
    interval = settings.sweep_interval
    entries: dict[str, Any] = {
        "outbox-sweep": {
            "task": SWEEP_TASK,
            "schedule": schedule(timedelta(seconds=interval), nowfun=steady_now),
            # RabbitMQ's per-message time-to-live, never Celery's `expires`: see the docstring.
            "options": {"queue": "reconcile", "expiration": interval},
        },
    }
    # Without OUTBOX_WEBHOOK_URL no move writes a delivery: a run every few seconds would only
    # wake a worker (and the database) for nothing, the largest part of an idle stack's cost.
    if settings.webhook_url is not None:
        # Escalation webhooks due for (re)delivery: each row is also claimed with a lease,
        # so overlapping runs deliver nothing twice.
        entries["outbox-webhooks"] = {
            "task": ESCALATE_TASK,
            "schedule": schedule(timedelta(seconds=WEBHOOK_INTERVAL_S), nowfun=steady_now),
            "options": {"queue": "human", "expiration": WEBHOOK_INTERVAL_S},
        }
    return {"beat_schedule": entries}


# Read when the app is configured, not now: reading app.conf at import would configure the
# app from whatever environment imports this module (and start the embedded PostgreSQL when
# no database is set), although importing the composition root connects to nothing.
app.add_defaults(_beat_schedule)


@app.task(name=ESCALATE_TASK)  # type: ignore[untyped-decorator]
def escalate_task(delivery_id: str | None = None) -> dict[str, int]:
    """Deliver due escalation webhooks (one batch), or only ``delivery_id`` when given."""
    engine = runtime.engine()
    if delivery_id is not None:
        result = deliver_one(engine, UUID(delivery_id))
    else:
        with WebhookDeliverer(engine) as deliverer:
            result = deliverer.run_once()
    return dict(vars(result))
