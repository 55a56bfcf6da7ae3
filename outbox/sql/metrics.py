"""The metrics exporter's reads: counts by state and tool, the oldest waits, webhook
deliveries, and the events committed since its cursor (``outbox metrics``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import text

from outbox.models import Executor
from outbox.states import State


@dataclass(frozen=True, slots=True)
class OperationCount:
    """How many operations of ``tool`` are in ``state``."""

    state: str
    tool: str
    n: int


@dataclass(frozen=True, slots=True)
class WebhookCount:
    """How many deliveries have one status, and how many of those were tried at least once."""

    n: int
    tried: int


@dataclass(frozen=True, slots=True)
class OldestWaits:
    """Since when the oldest operation of each live state waits (``None``: none in it),
    and the database's clock when read."""

    now: datetime
    since: dict[State, datetime | None]
    #: The oldest ``next_check_at`` of an `unknown` row.
    check_due: datetime | None


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event the exporter folds into its counters."""

    id: int
    from_state: str | None
    to_state: str
    actor: str
    #: For a move out of `sent`: seconds since the same attempt's move into `sent`.
    dispatch_s: float | None


_OPERATIONS = text("SELECT state, tool, count(*) AS n FROM outbox.operations GROUP BY state, tool")


_OLDEST = text(
    """
    SELECT clock_timestamp() AS now,
           (SELECT min(available_at) FROM outbox.operations WHERE state = 'planned') AS planned,
           (SELECT min(sent_at) FROM outbox.operations WHERE state = 'sent') AS sent,
           (SELECT min(updated_at) FROM outbox.operations WHERE state = 'unknown') AS unknown,
           (SELECT min(next_check_at) FROM outbox.operations WHERE state = 'unknown')
             AS check_due,
           (SELECT min(updated_at) FROM outbox.operations WHERE state = 'needs_human')
             AS needs_human,
           (SELECT min(updated_at) FROM outbox.operations WHERE state = 'awaiting_approval')
             AS awaiting_approval
    """
)


_WEBHOOKS = text(
    "SELECT status, count(*) AS n, count(*) FILTER (WHERE attempts > 0) AS tried "
    "FROM outbox.webhook_deliveries GROUP BY status"
)


_NEWEST_EVENT = text("SELECT coalesce(max(id), 0) FROM outbox.events")


# The new events after the cursor (a bounded batch) and any remembered gaps that have since
# committed. For a move out of `sent`, the latency since the same attempt's move into `sent`:
# the newest such event of that operation, found through ix_events_operation_id_id.
_NEW_EVENTS = text(
    """
    WITH batch AS (
        (SELECT id, operation_id, from_state, to_state, attempt, actor, at
         FROM outbox.events WHERE id > :cursor ORDER BY id LIMIT :batch)
        UNION ALL
        (SELECT id, operation_id, from_state, to_state, attempt, actor, at
         FROM outbox.events WHERE id = ANY(CAST(:gaps AS bigint[])))
    )
    SELECT b.id, b.from_state, b.to_state, b.actor,
           extract(epoch FROM b.at - sent.at) AS dispatch_s
    FROM batch b
    LEFT JOIN LATERAL (
        SELECT s.at FROM outbox.events s
        WHERE b.from_state = 'sent' AND b.to_state <> 'sent'
          AND s.operation_id = b.operation_id AND s.id < b.id
          AND s.to_state = 'sent' AND s.from_state IS DISTINCT FROM 'sent'
          AND s.attempt = b.attempt
        ORDER BY s.id DESC
        LIMIT 1
    ) sent ON true
    ORDER BY b.id
    """
)


_READ_ONLY = text("SET TRANSACTION READ ONLY")

# Short statements the planner would JIT-compile for longer than they run.
_SCRAPE_LIMITS = text(
    "SELECT set_config('statement_timeout', :ms, true), set_config('jit', 'off', true)"
)


def set_read_only(executor: Executor) -> None:
    """Make the current transaction read-only."""
    executor.execute(_READ_ONLY)


def set_scrape_limits(executor: Executor, *, statement_timeout_s: float) -> None:
    """For the current transaction: a statement timeout, and no JIT compilation."""
    executor.execute(_SCRAPE_LIMITS, {"ms": str(round(statement_timeout_s * 1000))})


def operation_counts(executor: Executor) -> list[OperationCount]:
    """How many operations there are, by state and tool (a scan of the whole table)."""
    return [
        OperationCount(row.state, row.tool, int(row.n)) for row in executor.execute(_OPERATIONS)
    ]


def oldest_waits(executor: Executor) -> OldestWaits:
    """Since when the oldest operation of each live state waits, by the database clock."""
    row = executor.execute(_OLDEST).mappings().one()
    return OldestWaits(
        now=row["now"],
        since={
            state: row[state.value]
            for state in (
                State.PLANNED,
                State.SENT,
                State.UNKNOWN,
                State.NEEDS_HUMAN,
                State.AWAITING_APPROVAL,
            )
        },
        check_due=row["check_due"],
    )


def webhook_counts(executor: Executor) -> dict[str, WebhookCount]:
    """Deliveries by status."""
    return {
        row.status: WebhookCount(int(row.n), int(row.tried)) for row in executor.execute(_WEBHOOKS)
    }


def newest_event_id(executor: Executor) -> int:
    """The id of the newest committed event (0: none)."""
    return int(executor.execute(_NEWEST_EVENT).scalar_one())


def new_events(
    executor: Executor, *, cursor: int, batch: int, gaps: Sequence[int]
) -> list[NewEvent]:
    """Up to ``batch`` events after ``cursor``, and the events of ``gaps`` committed since."""
    rows = executor.execute(_NEW_EVENTS, {"cursor": cursor, "batch": batch, "gaps": list(gaps)})
    return [
        NewEvent(
            id=row.id,
            from_state=row.from_state,
            to_state=row.to_state,
            actor=row.actor,
            dispatch_s=float(row.dispatch_s) if row.dispatch_s is not None else None,
        )
        for row in rows
    ]
