"""Locks: the per-operation advisory locks (session- and transaction-scoped), the sweep's
claims, row locks, the read a dispatcher makes with its lock, and ``synchronous_commit``.

Session-level locks outlive a rollback: every function here that may take one on a pooled
connection marks the connection first (:data:`outbox.locks.SESSION_LOCKS_INFO`), so the
pool's reset releases them (:mod:`outbox.db` runs :data:`UNLOCK_ALL_SQL` on the driver's
connection).
"""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from sqlalchemy import Connection, text

from outbox.driver import DriverStatement
from outbox.locks import SESSION_LOCKS_INFO
from outbox.models import Executor, Operation
from outbox.sql.columns import OPERATION_COLUMNS

#: Releases every session-level advisory lock of the session. A plain string as well as a
#: statement: the pool's reset runs it on the driver's connection, outside SQLAlchemy.
UNLOCK_ALL_SQL = "SELECT pg_advisory_unlock_all()"

_UNLOCK_ALL = text(UNLOCK_ALL_SQL)
_TRY_LOCK = text("SELECT pg_try_advisory_lock(:key)")
_LOCK = text("SELECT pg_advisory_lock(:key)")
_UNLOCK = text("SELECT pg_advisory_unlock(:key)")
_TRY_XACT_LOCK = text("SELECT pg_try_advisory_xact_lock(:key)")
_TRY_CLAIM = text("SELECT pg_try_advisory_lock(:hi, :lo)")
_RELEASE_CLAIM = text("SELECT pg_advisory_unlock(:hi, :lo)")
_SYNCHRONOUS_COMMIT_ON = text("SET synchronous_commit = on")
_LOCAL_SYNCHRONOUS_COMMIT_ON = text("SET LOCAL synchronous_commit = on")


@dataclass(frozen=True, slots=True)
class DispatchView:
    """An operation as a dispatcher reads it, with two facts judged by the database clock in
    the same read."""

    operation: Operation
    #: ``available_at`` has passed.
    due: bool
    #: The row has a replay deadline and it has passed.
    replay_expired: bool


@dataclass(frozen=True, slots=True)
class DurableLock:
    """What :func:`try_lock_durable` found: whether the lock was taken, and the session's
    ``synchronous_commit`` (read in the same round trip)."""

    taken: bool
    synchronous_commit: str


@dataclass(frozen=True, slots=True)
class LockedRead:
    """What :func:`try_lock_and_read` found: the lock, the session's ``synchronous_commit``,
    and the operation (``None`` if the lock was not taken or the operation does not exist)."""

    taken: bool
    synchronous_commit: str
    found: DispatchView | None


def lock(executor: Executor, key: int) -> None:
    """Take the session-level advisory lock ``key``, waiting for it.

    For a connection the caller discards or unlocks itself (the connection is not marked for
    the pool's reset).
    """
    executor.execute(_LOCK, {"key": key})


def try_xact_lock(executor: Executor, key: int) -> bool:
    """Take the transaction-scoped advisory lock ``key`` without waiting; whether it was taken.

    Released when the caller's transaction ends (commit or rollback), with nothing to release
    by hand. Advisory locks of both scopes share one key space, so a session lock on the same
    key makes this fail, and the other way round.
    """
    row = executor.execute(_TRY_XACT_LOCK, {"key": key})
    return bool(row.scalar_one())


def try_lock(executor: Executor, key: int) -> bool:
    """Take the session-level advisory lock ``key`` without waiting; whether it was taken."""
    mark_session_locks(executor)
    row = executor.execute(_TRY_LOCK, {"key": key})
    return bool(row.scalar_one())


_TRY_LOCK_DURABLE = text(
    "SELECT pg_try_advisory_lock(:key) AS taken, "
    "current_setting('synchronous_commit') AS synchronous_commit"
)


def try_lock_durable(executor: Executor, key: int) -> DurableLock:
    """:func:`try_lock`, and the session's ``synchronous_commit``, in one round trip."""
    mark_session_locks(executor)
    row = executor.execute(_TRY_LOCK_DURABLE, {"key": key}).one()
    return DurableLock(bool(row.taken), str(row.synchronous_commit))


def unlock(executor: Executor, key: int) -> None:
    """Release one session-level advisory lock held by this connection."""
    executor.execute(_UNLOCK, {"key": key})


def unlock_all(executor: Executor) -> None:
    """Release every session-level advisory lock this connection holds."""
    executor.execute(_UNLOCK_ALL)
    if isinstance(executor, Connection):
        executor.info.pop(SESSION_LOCKS_INFO, None)


def mark_session_locks(executor: Executor) -> None:
    """Mark a pooled connection as maybe holding session advisory locks (the pool's reset
    then releases them): before any statement that asks for one."""
    # Marked before the lock is asked for: a statement or step that fails after the lock was
    # granted leaves it held, and the pool's reset must then release it (outbox.db).
    if isinstance(executor, Connection):
        executor.info[SESSION_LOCKS_INFO] = True


def unmark_session_locks(executor: Executor) -> None:
    """Undo :func:`mark_session_locks` for a statement known to have taken no lock (its
    connection then goes back to the pool without an unlock round trip)."""
    if isinstance(executor, Connection):
        executor.info.pop(SESSION_LOCKS_INFO, None)


_LOCK_HOLDER_PID = text(
    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
    "AND classid = :hi AND objid = :lo AND objsubid = 1 "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)


def lock_holder_pid(executor: Executor, key: int) -> int | None:
    """The backend pid holding session advisory lock ``key`` in this database, or ``None``.

    Must run on a connection that does not hold the lock itself: it reads ``pg_locks``.
    """
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    row = executor.execute(
        _LOCK_HOLDER_PID, {"hi": unsigned >> 32, "lo": unsigned & 0xFFFFFFFF}
    ).first()
    return int(row.pid) if row is not None else None


def _claim_halves(key: int) -> dict[str, int]:
    """``key`` as the two signed 32-bit halves of PostgreSQL's two-key advisory locks."""
    low = key & 0xFFFFFFFF
    return {"hi": key >> 32, "lo": low - (1 << 32) if low >= 1 << 31 else low}


def try_sweep_claim(executor: Executor, key: int) -> bool:
    """Take a sweep's claim on operation lock ``key`` without waiting; whether it was taken.

    The two-key form of the same 64 bits (``objsubid = 2`` in ``pg_locks``): a lock space of
    its own, which no dispatcher takes and :func:`lock_holder_pid` does not read, so a sweep
    that finds it taken knows another sweep is probing that operation, not its dispatcher.
    """
    mark_session_locks(executor)
    row = executor.execute(_TRY_CLAIM, _claim_halves(key))
    return bool(row.scalar_one())


def release_sweep_claim(executor: Executor, key: int) -> None:
    """Release the claim :func:`try_sweep_claim` took."""
    executor.execute(_RELEASE_CLAIM, _claim_halves(key))


#: SQLSTATE lock_not_available: a NOWAIT lock or a lock_timeout that found the row held.
_LOCK_NOT_AVAILABLE = "55P03"


def is_row_lock_busy(exc: BaseException) -> bool:
    """Whether ``exc`` (a DBAPIError) is a row lock that was held by another transaction."""
    return getattr(getattr(exc, "orig", None), "sqlstate", None) == _LOCK_NOT_AVAILABLE


_WAIT_FOR_ROW_LOCK = text(
    "WITH cfg AS MATERIALIZED (SELECT set_config('lock_timeout', :ms, true) AS v) "
    "SELECT count(*) FROM cfg, LATERAL (SELECT 1 FROM outbox.operations o "
    "WHERE o.id = :id AND cfg.v IS NOT NULL FOR SHARE OF o) AS r"
)


def wait_for_row_lock(executor: Executor, operation_id: UUID, *, timeout_s: float) -> None:
    """Wait until no other transaction holds ``operation_id``'s row (at most ``timeout_s``).

    Takes a share lock on the row, released when the statement's transaction ends (on an
    autocommit connection, at once): a way to wait for a relay's claim to commit. Raises a
    DBAPIError for which :func:`is_row_lock_busy` is true if the row stayed held.
    ``lock_timeout`` is set for this statement's transaction only, before the lock is asked.
    """
    executor.execute(
        _WAIT_FOR_ROW_LOCK, {"id": operation_id, "ms": str(max(1, round(timeout_s * 1000)))}
    )


def set_synchronous_commit(executor: Executor) -> None:
    """Make every later COMMIT of this session wait for the WAL flush (and sync replicas).

    For a connection in autocommit mode, where ``SET LOCAL`` has no transaction to apply to;
    the setting stays with the pooled connection, which is what the dispatcher wants.
    """
    executor.execute(_SYNCHRONOUS_COMMIT_ON)


def require_synchronous_commit(executor: Executor) -> None:
    """Make the current transaction's COMMIT wait for the WAL flush (and sync replicas).

    The `sent` commit must be durable before any byte goes to the remote, whatever the
    server's or role's default for ``synchronous_commit``.
    """
    executor.execute(_LOCAL_SYNCHRONOUS_COMMIT_ON)


_DISPATCH_VIEW = text(
    """
    SELECT *,
           available_at <= clock_timestamp() AS due,
           replay_deadline IS NOT NULL AND replay_deadline <= clock_timestamp() AS replay_expired
    FROM outbox.operations WHERE id = :id
    """
)


def get_for_dispatch(executor: Executor, operation_id: UUID) -> DispatchView | None:
    """The operation, whether it is due, and whether its replay deadline has passed.

    Both judged by the database clock, in the same read.
    """
    row = executor.execute(_DISPATCH_VIEW, {"id": operation_id}).mappings().one_or_none()
    if row is None:
        return None
    return DispatchView(Operation.from_row(row), bool(row["due"]), bool(row["replay_expired"]))


# The operation's columns are written out in OPERATION_COLUMNS' order, as the result names
# them (tests/unit/test_sql_in_one_place.py checks the two agree).
_LOCK_AND_READ = DriverStatement.of(
    text(
        """
    WITH lk AS MATERIALIZED (
        SELECT pg_try_advisory_lock(:key) AS taken,
               current_setting('synchronous_commit') AS synchronous_commit
        -- An aggregate consumes its input before the lock is taken: the session's previous
        -- locks (the previous operation's) are released first when asked.
        FROM (SELECT count(*) FROM (SELECT pg_advisory_unlock_all() WHERE :unlock_first) AS u)
          AS unlocked
    )
    SELECT lk.taken, lk.synchronous_commit,
           op.id, op.intent_key, op.tool, op.target, op.payload, op.payload_hash, op.state,
           op.attempts, op.checks, op.maybe_applied, op.remote_ref, op.result, op.last_error,
           op.metadata, op.requested_by, op.created_at, op.updated_at, op.available_at,
           op.published_at, op.first_sent_at, op.sent_at, op.next_check_at, op.replay_deadline,
           op.resolved_at, op.attempt_budget_base, op.intent_hash, op.approval_required,
           op.approval_expires_at, op.decided_by, op.decided_at, op.approved_payload_hash,
           op.agent, op.traceparent, op.tracestate, op.lock_key,
           op.available_at <= clock_timestamp() AS due,
           op.replay_deadline IS NOT NULL AND op.replay_deadline <= clock_timestamp()
             AS replay_expired
    -- The row comes from a function fed with the lock's result: its query runs after the
    -- lock was granted, with a snapshot of its own (migration 0007).
    FROM lk LEFT JOIN LATERAL outbox.operation_if_locked(:id, lk.taken) AS op ON true
    """
    ),
    ["taken", "synchronous_commit", *OPERATION_COLUMNS, "due", "replay_expired"],
)


def try_lock_and_read(
    executor: Executor, key: int, operation_id: UUID, *, unlock_first: bool = False
) -> LockedRead:
    """:func:`try_lock_durable` and, if the lock was taken, :func:`get_for_dispatch`, in one
    round trip.

    The row is read after the lock was granted, so it shows every move committed by the
    lock's previous holder, exactly as a read in a statement of its own would.
    ``unlock_first``: release every advisory lock this session holds before taking this one.
    """
    mark_session_locks(executor)
    row = _LOCK_AND_READ.fetch_one(
        executor, {"key": key, "id": operation_id, "unlock_first": unlock_first}
    )
    assert row is not None  # noqa: S101 -- the statement returns one row, whatever the lock
    taken, synchronous_commit = bool(row["taken"]), str(row["synchronous_commit"])
    if not taken or row["id"] is None:
        return LockedRead(taken, synchronous_commit, None)
    found = DispatchView(Operation.from_row(row), bool(row["due"]), bool(row["replay_expired"]))
    return LockedRead(taken, synchronous_commit, found)
