"""The guards' statements (:mod:`outbox.guard_state`): circuit breakers, GCRA buckets, the
in-flight count, and the audit of resets. Every instant is the database's
(``statement_timestamp()``, ``clock_timestamp()``), as DESIGN.md's "Time" asks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import Double, Integer, Text, bindparam, cast, func, select, text

from outbox.driver import DriverStatement
from outbox.models import Executor

# --- circuit breakers ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BreakerRead:
    """A breaker's stored row, and the database's clock read with it."""

    state: str
    failures: int
    window_started_at: datetime | None
    window_calls: int
    window_failures: int
    opened_at: datetime | None
    open_until: datetime | None
    probe_operation_id: UUID | None
    probe_until: datetime | None
    now: datetime


_ENSURE_BREAKER = text(
    "INSERT INTO outbox.guard_breakers (scope, tool, target) VALUES (:scope, :tool, :target) "
    "ON CONFLICT (scope, tool, target) DO NOTHING"
)
_LOCK_BREAKER = text(
    "SELECT state, failures, window_started_at, window_calls, window_failures, opened_at, "
    "open_until, probe_operation_id, probe_until, clock_timestamp() AS now "
    "FROM outbox.guard_breakers WHERE scope = :scope AND tool = :tool AND target = :target "
    "FOR UPDATE"
)
# One probe across every worker: the UPDATE re-checks the row it locked (READ COMMITTED
# re-evaluates the WHERE on the newest version), so of two dispatchers one wins.
_CLAIM_PROBE = text(
    """
    UPDATE outbox.guard_breakers
    SET state = 'half_open', probe_operation_id = :operation_id,
        probe_until = clock_timestamp() + make_interval(secs => :probe_s),
        updated_at = clock_timestamp()
    WHERE scope = :scope AND tool = :tool AND target = :target
      AND ((state = 'open' AND open_until <= clock_timestamp())
           OR (state = 'half_open' AND probe_until <= clock_timestamp()))
    RETURNING probe_until
    """
)
_WRITE_BREAKER = text(
    """
    UPDATE outbox.guard_breakers
    SET state = CAST(:state AS text), failures = :failures,
        window_started_at = CAST(:window_started_at AS timestamptz),
        window_calls = :window_calls, window_failures = :window_failures,
        opened_at = CASE WHEN CAST(:state AS text) = 'open' AND state <> 'open'
                         THEN clock_timestamp()
                         WHEN CAST(:state AS text) = 'closed' THEN NULL ELSE opened_at END,
        open_until = CAST(:open_until AS timestamptz),
        probe_operation_id = CAST(:probe_operation_id AS uuid),
        probe_until = CASE WHEN CAST(:probe_operation_id AS uuid) IS NULL THEN NULL
                           ELSE probe_until END,
        updated_at = clock_timestamp()
    WHERE scope = :scope AND tool = :tool AND target = :target
    """
)
_CLOSE_BREAKER = text(
    """
    UPDATE outbox.guard_breakers
    SET state = 'closed', failures = 0, window_started_at = NULL, window_calls = 0,
        window_failures = 0, opened_at = NULL, open_until = NULL, probe_operation_id = NULL,
        probe_until = NULL, updated_at = clock_timestamp()
    WHERE scope = :scope AND tool = :tool AND target = :target
    RETURNING clock_timestamp() AS at
    """
)


def _key(scope: str, tool: str, target: str) -> dict[str, Any]:
    return {"scope": scope, "tool": tool, "target": target}


def _breaker(row: Any) -> BreakerRead:
    return BreakerRead(
        state=row.state,
        failures=row.failures,
        window_started_at=row.window_started_at,
        window_calls=row.window_calls,
        window_failures=row.window_failures,
        opened_at=row.opened_at,
        open_until=row.open_until,
        probe_operation_id=row.probe_operation_id,
        probe_until=row.probe_until,
        now=row.now,
    )


# The success fast path (every confirmed attempt of a tool with a breaker): one indexed read.
_BREAKER_QUIET = DriverStatement.of(
    text(
        "SELECT state = 'closed' AND failures = 0 AS quiet FROM outbox.guard_breakers "
        "WHERE scope = :scope AND tool = :tool AND target = :target"
    ),
    ["quiet"],
)


def breaker_quiet(executor: Executor, scope: str, tool: str, target: str) -> bool:
    """Whether the breaker is closed with no failure counted (or was never written)."""
    row = _BREAKER_QUIET.fetch_one(executor, _key(scope, tool, target))
    return row is None or bool(row["quiet"])


def lock_breaker(executor: Executor, scope: str, tool: str, target: str) -> BreakerRead:
    """The breaker's row, created closed if missing, locked until the transaction ends."""
    executor.execute(_ENSURE_BREAKER, _key(scope, tool, target))
    return _breaker(executor.execute(_LOCK_BREAKER, _key(scope, tool, target)).one())


def claim_probe(
    executor: Executor, scope: str, tool: str, target: str, *, operation_id: UUID, probe_s: float
) -> bool:
    """Make ``operation_id`` the one probe of an open breaker whose time is up (or whose
    last probe's lease ran out); whether it was."""
    params = _key(scope, tool, target) | {"operation_id": operation_id, "probe_s": probe_s}
    return executor.execute(_CLAIM_PROBE, params).one_or_none() is not None


def write_breaker(
    executor: Executor,
    scope: str,
    tool: str,
    target: str,
    *,
    state: str,
    failures: int,
    window_started_at: datetime | None,
    window_calls: int,
    window_failures: int,
    open_until: datetime | None,
    probe_operation_id: UUID | None,
) -> None:
    """Store a breaker's next state (the row locked by :func:`lock_breaker`)."""
    executor.execute(
        _WRITE_BREAKER,
        _key(scope, tool, target)
        | {
            "state": state,
            "failures": failures,
            "window_started_at": window_started_at,
            "window_calls": window_calls,
            "window_failures": window_failures,
            "open_until": open_until,
            "probe_operation_id": probe_operation_id,
        },
    )


def close_breaker(executor: Executor, scope: str, tool: str, target: str) -> datetime | None:
    """Close the breaker and forget its counts; when (the database's clock), or ``None`` if
    it was never written."""
    row = executor.execute(_CLOSE_BREAKER, _key(scope, tool, target)).one_or_none()
    return row.at if row is not None else None


# --- rate limits (GCRA) ----------------------------------------------------------------------

_CLEAR_BUCKET = text(
    "DELETE FROM outbox.guard_buckets WHERE tool = :tool AND target = :target RETURNING tat"
)


def clear_bucket(executor: Executor, tool: str, target: str) -> bool:
    """Forget a bucket (a full burst is available again); whether it existed."""
    params = {"tool": tool, "target": target}
    return executor.execute(_CLEAR_BUCKET, params).one_or_none() is not None


# --- the admission: one function (migration 0020), alone or in the `sent` move's statement ----


@dataclass(frozen=True, slots=True)
class BreakerSeen:
    """A breaker as the admission saw it (``state`` ``None``: never written, closed)."""

    state: str | None
    open_until: datetime | None
    now: datetime


_READ_SEEN = text(
    "SELECT state, open_until, clock_timestamp() AS now FROM outbox.guard_breakers "
    "WHERE scope = :scope AND tool = :tool AND target = :target"
)


def breaker_seen(executor: Executor, scope: str, tool: str, target: str) -> BreakerSeen | None:
    """A breaker's state and ``open_until`` with the database's now, or ``None`` (closed)."""
    row = executor.execute(_READ_SEEN, _key(scope, tool, target)).one_or_none()
    return BreakerSeen(row.state, row.open_until, row.now) if row is not None else None


@dataclass(frozen=True, slots=True)
class Admission:
    """The guards an admission asks (``None``: not declared): the dispatch breaker of
    ``breaker`` (tool, target), the concurrency cap ``cap`` (tool, target, max in flight),
    the rate ``rate`` (tool, target, interval_s, burst)."""

    breaker: tuple[str, str] | None
    cap: tuple[str, str, int] | None
    rate: tuple[str, str, float, int] | None

    def params(self) -> dict[str, Any]:
        """The bound values of ``outbox.guard_admit`` (named ``g_*``: they may join a move's)."""
        breaker, cap, rate = self.breaker, self.cap, self.rate
        return {
            "g_b_tool": breaker[0] if breaker else None,
            "g_b_target": breaker[1] if breaker else None,
            "g_cap": cap[2] if cap else None,
            "g_c_tool": cap[0] if cap else None,
            "g_c_target": cap[1] if cap else None,
            "g_r_tool": rate[0] if rate else None,
            "g_r_target": rate[1] if rate else None,
            "g_interval_s": rate[2] if rate else None,
            "g_burst": rate[3] if rate else 1,
        }


@dataclass(frozen=True, slots=True)
class Admitted:
    """The admission's answer: the attempts in flight (``None``: no cap), whether a token was
    taken (``None``: no rate), else the seconds to the next slot, and the breaker as seen."""

    in_flight: int | None
    token: bool | None
    wait_s: float
    breaker: BreakerSeen
    #: The breaker was closed with no failure counted (or never written).
    breaker_quiet: bool
    #: Every declared guard let the attempt through (the breaker closed, under the cap, a
    #: token taken).
    admitted: bool

    @classmethod
    def of(cls, row: Mapping[str, Any], *, rate: bool) -> Admitted:
        """From a row with :data:`ADMITTED_COLUMNS`."""
        return cls(
            in_flight=row["in_flight"],
            token=bool(row["token"]) if rate else None,
            wait_s=max(float(row["wait_s"] or 0.0), 0.0),
            breaker=BreakerSeen(row["breaker_state"], row["open_until"], row["now"]),
            breaker_quiet=bool(row["quiet"]),
            admitted=bool(row["admitted"]),
        )


#: What ``outbox.guard_admit`` returns, in order.
ADMITTED_COLUMNS = (
    "in_flight",
    "token",
    "wait_s",
    "breaker_state",
    "open_until",
    "quiet",
    "now",
    "admitted",
)


def admit_call() -> Any:
    """``outbox.guard_admit(...)`` (migration 0020) as a table-valued function of the
    ``g_*`` parameters of :meth:`Admission.params`, for a statement that joins it to a move:
    the key's lock (with a cap), the breaker's read, the count of ``sent`` rows and the GCRA
    step, each on a snapshot taken after the lock."""
    return func.outbox.guard_admit(
        cast(bindparam("g_b_tool"), Text),
        cast(bindparam("g_b_target"), Text),
        cast(bindparam("g_cap"), Integer),
        cast(bindparam("g_c_tool"), Text),
        cast(bindparam("g_c_target"), Text),
        cast(bindparam("g_r_tool"), Text),
        cast(bindparam("g_r_target"), Text),
        cast(bindparam("g_interval_s"), Double),
        cast(bindparam("g_burst"), Integer),
    ).table_valued(*ADMITTED_COLUMNS)


# The admission alone (a breaker that is not closed: its probe's claim follows in the same
# transaction as the move). With a cap, the key's lock is held until that transaction ends.
_ADMIT = DriverStatement.of(select(admit_call()), ADMITTED_COLUMNS)


def admit(executor: Executor, admission: Admission) -> Admitted:
    """Ask every guard of ``admission`` in the caller's transaction (with a cap, its lock
    held until the transaction ends); a token is taken only when the breaker is closed and
    the cap not reached. One round trip."""
    row = _ADMIT.fetch_one(executor, admission.params())
    assert row is not None  # noqa: S101 -- one row by construction
    return Admitted.of(row, rate=admission.rate is not None)


# --- holding an operation back ----------------------------------------------------------------

# Not a state change: the row stays `planned`, not attempted, and becomes due again when the
# guard may let it through; published_at is cleared so the relay publishes it then. By key:
# COLLATE "C" keeps the state's partial index out of the plan (``sql.moves``, change 44).
_HOLD = text(
    """
    UPDATE outbox.operations
    SET available_at = clock_timestamp() + make_interval(secs => :delay_s),
        published_at = NULL, last_error = :reason, updated_at = clock_timestamp()
    WHERE id = :operation_id AND state COLLATE "C" = 'planned' AND attempts = :attempt
    RETURNING available_at
    """
)


def hold(
    executor: Executor, operation_id: UUID, *, attempt: int, delay_s: float, reason: str
) -> datetime | None:
    """Push a ``planned`` operation's ``available_at`` ``delay_s`` out; the new instant, or
    ``None`` when the row is no longer ``planned`` at ``attempt``."""
    params = {
        "operation_id": operation_id,
        "attempt": attempt,
        "delay_s": delay_s,
        "reason": reason,
    }
    row = executor.execute(_HOLD, params).one_or_none()
    return row.available_at if row is not None else None


# --- the operator's view and resets -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BreakerListed:
    """One stored breaker, for ``outbox guards list``."""

    scope: str
    tool: str
    target: str
    state: str
    failures: int
    opened_at: datetime | None
    open_until: datetime | None
    probe_operation_id: UUID | None


@dataclass(frozen=True, slots=True)
class BucketListed:
    """One stored GCRA bucket: seconds until its next free slot (0: one is free now)."""

    tool: str
    target: str
    next_slot_s: float
    tat_ahead_s: float


@dataclass(frozen=True, slots=True)
class InFlight:
    """Attempts of one tool and target in ``sent`` now."""

    tool: str
    target: str
    in_flight: int


_LIST_BREAKERS = text(
    "SELECT scope, tool, target, state, failures, opened_at, open_until, probe_operation_id "
    "FROM outbox.guard_breakers ORDER BY tool, target, scope"
)
_LIST_BUCKETS = text(
    "SELECT tool, target, "
    "greatest(extract(epoch FROM tat - statement_timestamp()), 0)::float8 AS tat_ahead_s "
    "FROM outbox.guard_buckets ORDER BY tool, target"
)
_LIST_IN_FLIGHT = text(
    "SELECT tool, target, count(*) AS in_flight FROM outbox.operations "
    "WHERE state = 'sent' GROUP BY tool, target ORDER BY tool, target"
)
_RECORD_RESET = text(
    "INSERT INTO outbox.guard_resets (guard, tool, target, reset_by, note) "
    "VALUES (:guard, :tool, :target, :reset_by, :note) RETURNING id, reset_at"
)


def list_breakers(executor: Executor) -> list[BreakerListed]:
    """Every stored breaker."""
    return [
        BreakerListed(
            scope=r.scope,
            tool=r.tool,
            target=r.target,
            state=r.state,
            failures=r.failures,
            opened_at=r.opened_at,
            open_until=r.open_until,
            probe_operation_id=r.probe_operation_id,
        )
        for r in executor.execute(_LIST_BREAKERS)
    ]


def list_buckets(executor: Executor) -> list[BucketListed]:
    """Every stored bucket, with how far its theoretical arrival time is ahead of now."""
    return [
        BucketListed(tool=r.tool, target=r.target, next_slot_s=0.0, tat_ahead_s=r.tat_ahead_s)
        for r in executor.execute(_LIST_BUCKETS)
    ]


def list_in_flight(executor: Executor) -> list[InFlight]:
    """Attempts in ``sent`` by tool and target."""
    return [
        InFlight(tool=r.tool, target=r.target, in_flight=r.in_flight)
        for r in executor.execute(_LIST_IN_FLIGHT)
    ]


def record_reset(
    executor: Executor, *, guard: str, tool: str, target: str, reset_by: str, note: str
) -> datetime:
    """Append who reset which guard and why; when (the database's clock)."""
    params = {"guard": guard, "tool": tool, "target": target, "reset_by": reset_by, "note": note}
    reset_at: datetime = executor.execute(_RECORD_RESET, params).one().reset_at
    return reset_at
