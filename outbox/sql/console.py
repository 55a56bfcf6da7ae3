"""The operator console's statements (:mod:`outbox.web.console`): the human queue, oldest
first, and the overview's rate of decided operations."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select, text

from outbox.models import Executor, Operation
from outbox.schema import operations
from outbox.states import TERMINAL_STATES, State

#: The states in which an operation waits for a person: the console's queue.
WAITING_STATES = (State.NEEDS_HUMAN, State.AWAITING_APPROVAL)

# Oldest first by the time it entered its state (updated_at: nothing but a decision or the
# approval's expiry moves a waiting row); the id breaks ties so the order is stable.
_QUEUE = (
    select(operations)
    .where(operations.c.state.in_([state.value for state in WAITING_STATES]))
    .order_by(operations.c.updated_at, operations.c.id)
)


def waiting_operations(executor: Executor, *, limit: int) -> list[Operation]:
    """Up to ``limit`` operations waiting for a person, the longest-waiting first."""
    rows = executor.execute(_QUEUE.limit(limit)).mappings()
    return [Operation.from_row(row) for row in rows]


@dataclass(frozen=True, slots=True)
class DecidedRate:
    """Operations that reached a terminal state in the last ``window_s`` seconds (database
    clock), counted among the newest ``scanned`` events at most (``capped``: the window held
    more than that, so the rate is at least what it says)."""

    decided: int
    window_s: float
    capped: bool

    @property
    def per_second(self) -> float:
        """``decided`` over the window."""
        return self.decided / self.window_s


_TERMINAL = sorted(state.value for state in TERMINAL_STATES)

# Bounded by the primary key: the newest :max_events events at most, never a scan of the
# whole table (events has no index on `at`, and needs none for anything else). A note
# (from_state = to_state: late evidence kept on a decided operation) decides nothing: only
# the move into a terminal state counts, once per operation.
_DECIDED = text(
    """
    WITH recent AS (
        SELECT from_state, to_state, at FROM outbox.events
        ORDER BY id DESC
        LIMIT :max_events
    )
    SELECT count(*) FILTER (
               WHERE to_state = ANY(CAST(:terminal AS text[]))
                 AND from_state IS DISTINCT FROM to_state
                 AND at > clock_timestamp() - make_interval(secs => :window_s)
           ) AS decided,
           count(*) AS scanned,
           coalesce(min(at) > clock_timestamp() - make_interval(secs => :window_s), false)
             AS window_exceeds_scan
    FROM recent
    """
)


def decided_rate(executor: Executor, *, window_s: float, max_events: int) -> DecidedRate:
    """How many operations reached confirmed, failed or cancelled in the last ``window_s``."""
    row = (
        executor.execute(
            _DECIDED, {"window_s": window_s, "max_events": max_events, "terminal": _TERMINAL}
        )
        .mappings()
        .one()
    )
    capped = bool(row["window_exceeds_scan"]) and int(row["scanned"]) >= max_events
    return DecidedRate(decided=int(row["decided"]), window_s=window_s, capped=capped)
