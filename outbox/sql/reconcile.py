"""The reconcilers' statements: what the sweep finds stale or due, the facts a decision is
judged by (by the database clock), when an `unknown` row is checked next, and the sweep's
remembered failures."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from sqlalchemy import text

from outbox import storable
from outbox.models import Executor, Operation
from outbox.states import State


@dataclass(frozen=True, slots=True)
class StaleSent:
    """A `sent` row older than the sent timeout."""

    id: UUID
    #: Its attempt number (the fence of any move the sweep makes).
    attempt: int
    #: Also older than the sent max age.
    too_old: bool


@dataclass(frozen=True, slots=True)
class DueCheck:
    """An `unknown` row whose next check is due."""

    id: UUID
    tool: str


_STALE_SENT = text(
    """
    SELECT id, attempts,
           sent_at <= clock_timestamp() - make_interval(secs => :max_age) AS too_old
    FROM outbox.operations
    WHERE state = 'sent' AND sent_at <= statement_timestamp() - make_interval(secs => :timeout)
    ORDER BY sent_at
    LIMIT :limit
    """
)


def stale_sent(
    executor: Executor, *, sent_timeout_s: float, sent_max_age_s: float, limit: int
) -> list[StaleSent]:
    """`sent` rows older than the timeout, oldest first."""
    rows = executor.execute(
        _STALE_SENT, {"timeout": sent_timeout_s, "max_age": sent_max_age_s, "limit": limit}
    )
    return [StaleSent(row.id, row.attempts, bool(row.too_old)) for row in rows]


_DUE_UNKNOWN = text(
    "SELECT id, tool FROM outbox.operations "
    "WHERE state = 'unknown' AND next_check_at <= statement_timestamp() "
    "ORDER BY next_check_at LIMIT :limit"
)


def due_unknown(executor: Executor, *, limit: int) -> list[DueCheck]:
    """`unknown` rows whose next check is due, oldest first."""
    rows = executor.execute(_DUE_UNKNOWN, {"limit": limit})
    return [DueCheck(row.id, row.tool) for row in rows]


_RECONCILE_FACTS = text(
    """
    SELECT *,
           sent_at IS NULL
             OR sent_at + make_interval(secs => :horizon) <= clock_timestamp() AS horizon_passed,
           sent_at + make_interval(secs => :horizon) AS horizon_at,
           first_sent_at + make_interval(secs => :usable_window) AS window_closes_at,
           first_sent_at IS NOT NULL
             AND first_sent_at + make_interval(secs => :usable_window) > clock_timestamp()
             AS window_open,
           coalesce(next_check_at <= clock_timestamp(), false) AS check_due
    FROM outbox.operations WHERE id = :id
    """
)


@dataclass(frozen=True, slots=True)
class ReconcileFacts:
    """An operation and the time facts the decision table needs, judged by the database clock."""

    operation: Operation
    #: A request sent at ``sent_at`` can no longer land.
    horizon_passed: bool
    horizon_at: datetime | None
    #: ``first_sent_at`` + window - margin is still ahead (always False without a window).
    window_open: bool
    window_closes_at: datetime | None
    #: An `unknown` row's next check is due (``next_check_at`` has passed).
    check_due: bool = False


def reconcile_facts(
    executor: Executor, operation_id: UUID, *, horizon_s: float, usable_window_s: float | None
) -> ReconcileFacts | None:
    """The operation with its horizon and dedup-window facts, or ``None``."""
    row = (
        executor.execute(
            _RECONCILE_FACTS,
            {
                "id": operation_id,
                "horizon": horizon_s,
                "usable_window": usable_window_s if usable_window_s is not None else -1e9,
            },
        )
        .mappings()
        .one_or_none()
    )
    if row is None:
        return None
    has_window = usable_window_s is not None
    return ReconcileFacts(
        operation=Operation.from_row(row),
        horizon_passed=bool(row["horizon_passed"]),
        horizon_at=row["horizon_at"],
        window_open=has_window and bool(row["window_open"]),
        window_closes_at=row["window_closes_at"] if has_window else None,
        check_due=bool(row["check_due"]),
    )


# The two forms of schedule_check: the next check a delay from now, or at the row's horizon.
# By key: COLLATE "C" keeps the state's partial index out of the plan (``sql.moves``, change 44).
_SCHEDULE_CHECK_IN = text(
    "UPDATE outbox.operations "
    "SET next_check_at = clock_timestamp() + make_interval(secs => :delay), "
    "checks = checks + :add, last_error = coalesce(:error, last_error), "
    "updated_at = updated_at "
    "WHERE id = :id AND state COLLATE \"C\" = 'unknown' AND attempts = :attempt"
)
_SCHEDULE_CHECK_AT_HORIZON = text(
    "UPDATE outbox.operations "
    "SET next_check_at = sent_at + make_interval(secs => :horizon), "
    "checks = checks + :add, last_error = coalesce(:error, last_error), "
    "updated_at = updated_at "
    "WHERE id = :id AND state COLLATE \"C\" = 'unknown' AND attempts = :attempt"
)


def schedule_check(
    executor: Executor,
    operation_id: UUID,
    *,
    attempt: int,
    delay_s: float | None = None,
    at_horizon_s: float | None = None,
    count_check: bool,
    last_error: str | None = None,
) -> bool:
    """Set when the reconciler looks at an `unknown` row next (fenced on state and attempt).

    ``delay_s`` from now, or ``at_horizon_s`` after ``sent_at``; ``count_check`` adds one to
    ``checks`` (an inconclusive lookup). Not a state change, so no event. Whether it applied.
    ``last_error`` is made storable (:mod:`outbox.storable`): it quotes the remote.
    """
    result = executor.execute(
        _SCHEDULE_CHECK_AT_HORIZON if at_horizon_s is not None else _SCHEDULE_CHECK_IN,
        {
            "id": operation_id,
            "attempt": attempt,
            "delay": delay_s or 0.0,
            "horizon": at_horizon_s or 0.0,
            "add": 1 if count_check else 0,
            "error": storable.optional_text(last_error),
        },
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


#: The key of an event's ``detail`` that marks a sweep's failure to handle the row.
SWEEP_FAILURE_KEY = "sweep_error"


_SWEEP_FAILURES = text(
    "SELECT count(*) FROM outbox.events WHERE operation_id = :id AND attempt = :attempt "
    "AND from_state = :state AND to_state = :state "
    "AND detail ->> :key IS NOT NULL"
)


def sweep_failures(executor: Executor, operation_id: UUID, *, state: State, attempt: int) -> int:
    """How many times the sweep failed on this operation in ``state`` at ``attempt``
    (events recorded with a ``sweep_error`` detail): the database remembers across runs."""
    row = executor.execute(
        _SWEEP_FAILURES,
        {"id": operation_id, "attempt": attempt, "state": state.value, "key": SWEEP_FAILURE_KEY},
    )
    return int(row.scalar_one())
