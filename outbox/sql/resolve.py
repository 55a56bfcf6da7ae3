"""Operator resolution's reads: the in-flight horizon by the database clock, and why each
operation waits where it is (its lock is :func:`outbox.sql.locks.try_xact_lock`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from uuid import UUID

from sqlalchemy import text

from outbox.models import Executor


@dataclass(frozen=True, slots=True)
class Horizon:
    """Whether an operation's in-flight horizon has passed since its last send."""

    passed: bool
    #: Seconds until it passes (0 once passed).
    remaining_s: float


# The horizon judged by the database clock (DESIGN.md, "Time"), never this host's: whether it
# has passed since the last send, and the seconds left if not. A row never sent has nothing in
# flight, so its horizon counts as passed.
_HORIZON = text(
    """
    SELECT sent_at IS NULL
           OR sent_at + make_interval(secs => :horizon) <= clock_timestamp() AS passed,
           coalesce(extract(epoch FROM sent_at + make_interval(secs => :horizon)
                                       - clock_timestamp()), 0) AS remaining
    FROM outbox.operations WHERE id = :id
    """
)


_ENTRY_REASONS = text(
    """
    SELECT DISTINCT ON (e.operation_id) e.operation_id, e.reason
    FROM outbox.events e JOIN outbox.operations o ON o.id = e.operation_id
    WHERE e.operation_id = ANY(:ids)
      AND e.to_state = o.state
      AND e.from_state IS DISTINCT FROM e.to_state
    ORDER BY e.operation_id, e.id DESC
    """
)


def horizon(executor: Executor, operation_id: UUID, horizon_s: float) -> Horizon:
    """Whether ``horizon_s`` has passed since the row's ``sent_at``, and the seconds left."""
    row = executor.execute(_HORIZON, {"horizon": horizon_s, "id": operation_id}).one()
    return Horizon(bool(row.passed), max(0.0, float(row.remaining)))


def entry_reasons(executor: Executor, operation_ids: Sequence[UUID]) -> dict[UUID, str]:
    """The reason of each operation's move into its current state (moves only, not notes)."""
    rows = executor.execute(_ENTRY_REASONS, {"ids": list(operation_ids)})
    return {row.operation_id: row.reason for row in rows}
