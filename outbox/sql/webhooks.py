"""The statements on ``outbox.webhook_deliveries``: write a move's delivery rows, claim due
ones under a lease, record an attempt's outcome (fenced on that lease), list them. Every time
and every age comparison is the database's clock."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import insert, select, text

from outbox import storable
from outbox.models import Delivery, DeliveryStatus, Executor, WebhookEvent
from outbox.schema import webhook_deliveries


@dataclass(frozen=True, slots=True)
class AttemptOutcome:
    """What an attempt left: the delivery's status (``delivered``; after a failure
    ``pending`` to retry, or ``abandoned``) and its attempt count."""

    status: DeliveryStatus
    attempts: int


def insert_deliveries(executor: Executor, rows: Sequence[Mapping[str, Any]]) -> None:
    """Write pending deliveries (``operation_id`` or ``subject``, ``event``, ``payload`` each),
    in the caller's transaction."""
    executor.execute(insert(webhook_deliveries).values(list(rows)))


@dataclass(frozen=True, slots=True)
class Claimed:
    """A delivery claimed for one attempt: what to send, and the lease that fences its outcome."""

    id: UUID
    #: ``None`` for a guard event (about a guard or budget key, not one operation).
    operation_id: UUID | None
    event: WebhookEvent
    #: The body exactly as stored (``payload::text``): what is signed and sent, on every attempt.
    body: str
    #: Attempts made before this one.
    attempts: int
    #: ``next_attempt_at`` as the claim set it; the outcome is written only if it is unchanged.
    lease: datetime
    #: The operation's stored trace context (the delivery span's parent), if any.
    traceparent: str | None = None
    tracestate: str | None = None


_CLAIM_DUE = text(
    """
    WITH due AS (
        SELECT id FROM outbox.webhook_deliveries
        WHERE status = 'pending'
          AND next_attempt_at <= clock_timestamp()
          AND (CAST(:only AS uuid) IS NULL OR id = CAST(:only AS uuid))
        ORDER BY next_attempt_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox.webhook_deliveries AS d
    SET next_attempt_at = clock_timestamp() + make_interval(secs => :lease)
    FROM due WHERE d.id = due.id
    RETURNING d.id, d.operation_id, d.event, d.payload::text AS body, d.attempts,
              d.next_attempt_at AS lease,
              -- The operation's trace context (a primary-key probe; NULL for a guard event).
              (SELECT o.traceparent FROM outbox.operations AS o WHERE o.id = d.operation_id)
                AS traceparent,
              (SELECT o.tracestate FROM outbox.operations AS o WHERE o.id = d.operation_id)
                AS tracestate
    """
)


def claim_due(
    executor: Executor, *, limit: int, lease_s: float, only: UUID | None = None
) -> list[Claimed]:
    """Lease up to ``limit`` due pending deliveries (or just ``only``), oldest due first.

    ``SKIP LOCKED`` lets deliverers claim disjoint rows; pushing ``next_attempt_at`` out by
    ``lease_s`` keeps them claimed after this short transaction commits, so no transaction
    stays open across an HTTP call. A deliverer that dies mid-send leaves the row to be
    claimed again once the lease has passed.
    """
    rows = executor.execute(_CLAIM_DUE, {"limit": limit, "lease": lease_s, "only": only})
    return [
        Claimed(
            id=row.id,
            operation_id=row.operation_id,
            event=WebhookEvent(row.event),
            body=row.body,
            attempts=row.attempts,
            lease=row.lease,
            traceparent=row.traceparent,
            tracestate=row.tracestate,
        )
        for row in rows
    ]


_DELIVERED = text(
    """
    UPDATE outbox.webhook_deliveries
    SET status = 'delivered', delivered_at = clock_timestamp(), attempts = attempts + 1,
        last_status = :status, last_error = NULL
    WHERE id = :id AND status = 'pending' AND next_attempt_at = :lease
    RETURNING attempts
    """
)


def record_delivered(executor: Executor, claimed: Claimed, *, status: int) -> int | None:
    """Mark a claimed delivery delivered; its attempt count, or ``None`` if the lease was lost."""
    row = executor.execute(
        _DELIVERED, {"id": claimed.id, "lease": claimed.lease, "status": status}
    ).first()
    return int(row.attempts) if row is not None else None


_FAILED = text(
    """
    UPDATE outbox.webhook_deliveries
    SET attempts = attempts + 1, last_status = :status, last_error = :error,
        next_attempt_at = clock_timestamp() + make_interval(secs => :retry_in),
        status = CASE WHEN created_at <= clock_timestamp() - make_interval(secs => :give_up)
                      THEN 'abandoned' ELSE 'pending' END
    WHERE id = :id AND status = 'pending' AND next_attempt_at = :lease
    RETURNING status, attempts
    """
)


def record_failed(
    executor: Executor,
    claimed: Claimed,
    *,
    status: int | None,
    error: str,
    retry_in_s: float,
    give_up_after_s: float,
) -> AttemptOutcome | None:
    """Record a failed attempt: retry after ``retry_in_s``, or abandon the row once it is
    older than ``give_up_after_s`` (judged by the database). Returns the new status and
    attempt count, or ``None`` if the lease was lost to another deliverer.
    """
    row = executor.execute(
        _FAILED,
        {
            "id": claimed.id,
            "lease": claimed.lease,
            "status": status,
            "error": storable.text(error),  # it quotes the endpoint's answer
            "retry_in": retry_in_s,
            "give_up": give_up_after_s,
        },
    ).first()
    return (
        AttemptOutcome(DeliveryStatus(row.status), int(row.attempts)) if row is not None else None
    )


def list_deliveries(
    executor: Executor,
    *,
    status: DeliveryStatus | None = None,
    operation_id: UUID | None = None,
    limit: int = 50,
) -> list[Delivery]:
    """Deliveries, newest first."""
    t = webhook_deliveries.c
    # UUIDv7 ids only order by the millisecond; created_at tells apart rows of one statement.
    query = select(webhook_deliveries).order_by(t.created_at.desc(), t.id.desc()).limit(limit)
    if status is not None:
        query = query.where(t.status == status.value)
    if operation_id is not None:
        query = query.where(t.operation_id == operation_id)
    return [Delivery.from_row(row) for row in executor.execute(query).mappings()]
