"""Every SQL statement of the outbox core, each behind a named function.

Components call these and never build SQL inline. Times come from the database:
statements use ``statement_timestamp()`` (the start of *this* statement, not of the
transaction like ``now()``) where one instant must be written to several columns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import (
    Connection,
    func,
    select,
    text,
)

from outbox import storable
from outbox.driver import DriverStatement
from outbox.locks import SESSION_LOCKS_INFO
from outbox.models import Event, Executor, Operation, PrunedIntent
from outbox.schema import events, operations, pruned_intents
from outbox.sql import moves as _moves
from outbox.states import TERMINAL_STATES, State

#: NOTIFY channel announcing that an operation settled (sent by the move statement).
SETTLED_CHANNEL = _moves.SETTLED_CHANNEL

#: The operation row's columns in declaration order: what driver statements that return an
#: operation select, and name their result columns by.
_OPERATION_COLUMNS = tuple(column.name for column in operations.c)

_INSERT_INTENT = DriverStatement.of(
    text(
        """
    WITH new AS (SELECT outbox.uuid_v7() AS id),
    inserted AS (
        INSERT INTO outbox.operations
            (id, intent_key, tool, target, payload, payload_hash, intent_hash, metadata,
             requested_by)
        SELECT new.id, coalesce(:intent_key, new.id::text), :tool, :target,
               CAST(:payload AS jsonb), :payload_hash, :intent_hash, CAST(:metadata AS jsonb),
               :requested_by
        FROM new
        -- A key whose operation was pruned is done: one primary-key probe, in this statement.
        WHERE NOT EXISTS (SELECT FROM outbox.pruned_intents WHERE intent_key = :intent_key)
        ON CONFLICT (intent_key) DO NOTHING
        RETURNING *
    ),
    logged AS (
        INSERT INTO outbox.events (operation_id, from_state, to_state, attempt, actor, reason)
        SELECT id, NULL, state, attempts, 'agent', 'enqueued' FROM inserted
    )
    -- Only what the database chose: the rest of the new row is what the caller passed and
    -- the columns' defaults (reading all of it back was a third of enqueue's CPU).
    SELECT inserted.id, inserted.intent_key, inserted.created_at, inserted.updated_at,
           inserted.available_at,
           -- Ring the relay only while one sleeps: NOTIFY serialises commits cluster-wide,
           -- so a busy relay (which polls anyway) must not cost the agent's commit that lock.
           (SELECT pg_notify('outbox_planned', '')
            WHERE EXISTS (SELECT FROM outbox.relays WHERE idle)) AS rang
    FROM inserted
    """
    ),
    ["id", "intent_key", "created_at", "updated_at", "available_at", "rang"],
)


def insert_intent(
    executor: Executor,
    *,
    intent_key: str | None,
    tool: str,
    target: str,
    canonical_payload: str,
    payload_hash: str,
    intent_hash: str,
    metadata: Mapping[str, Any],
    requested_by: str | None,
) -> Operation | None:
    """Insert a ``planned`` operation and its first event; ``None`` if the key is taken
    (by an operation, or by a pruned one: :func:`find_pruned_intent`).

    A concurrent transaction inserting the same key makes this wait for its outcome
    (``ON CONFLICT DO NOTHING``), so racing agents end with one row and no IntegrityError.
    """
    row = _INSERT_INTENT.fetch_one(
        executor,
        {
            "intent_key": intent_key,
            "tool": tool,
            "target": target,
            "payload": canonical_payload,
            "payload_hash": payload_hash,
            "intent_hash": intent_hash,
            "metadata": json.dumps(dict(metadata)),
            "requested_by": requested_by,
        },
    )
    if row is None:
        return None
    return Operation(
        id=row["id"],
        intent_key=row["intent_key"],
        tool=tool,
        target=target,
        payload=json.loads(canonical_payload),
        payload_hash=payload_hash,
        state=State.PLANNED,
        attempts=0,
        checks=0,
        maybe_applied=False,
        remote_ref=None,
        result=None,
        last_error=None,
        metadata=dict(metadata),
        requested_by=requested_by,
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        available_at=row["available_at"],
        published_at=None,
        first_sent_at=None,
        sent_at=None,
        next_check_at=None,
        replay_deadline=None,
        resolved_at=None,
        attempt_budget_base=0,
        intent_hash=intent_hash,
    )


_INSERT_INTENTS = text(
    """
    WITH input AS (
        SELECT * FROM unnest(
            CAST(:intent_keys AS text[]), CAST(:tools AS text[]), CAST(:targets AS text[]),
            CAST(:payloads AS jsonb[]), CAST(:payload_hashes AS text[]),
            CAST(:intent_hashes AS text[]), CAST(:metadata AS jsonb[]),
            CAST(:requested_by AS text[])
        ) WITH ORDINALITY
          AS i(intent_key, tool, target, payload, payload_hash, intent_hash, metadata,
               requested_by, n)
    ),
    new AS (SELECT outbox.uuid_v7() AS id, input.* FROM input),
    inserted AS (
        INSERT INTO outbox.operations
            (id, intent_key, tool, target, payload, payload_hash, intent_hash, metadata,
             requested_by)
        SELECT id, coalesce(intent_key, id::text), tool, target, payload, payload_hash,
               intent_hash, metadata, requested_by
        FROM new
        WHERE NOT EXISTS (SELECT FROM outbox.pruned_intents p WHERE p.intent_key = new.intent_key)
        ORDER BY n
        ON CONFLICT (intent_key) DO NOTHING
        RETURNING *
    ),
    logged AS (
        INSERT INTO outbox.events (operation_id, from_state, to_state, attempt, actor, reason)
        SELECT id, NULL, state, attempts, 'agent', 'enqueued' FROM inserted
    ),
    rang AS (
        SELECT pg_notify('outbox_planned', '')
        WHERE EXISTS (SELECT FROM inserted) AND EXISTS (SELECT FROM outbox.relays WHERE idle)
    )
    SELECT inserted.*, new.n AS position, (SELECT count(*) FROM rang) AS rang
    FROM inserted JOIN new ON new.id = inserted.id
    ORDER BY new.n
    """
)


def insert_intents(
    executor: Executor,
    *,
    intent_keys: Sequence[str | None],
    tools: Sequence[str],
    targets: Sequence[str],
    canonical_payloads: Sequence[str],
    payload_hashes: Sequence[str],
    intent_hashes: Sequence[str],
    metadata: Sequence[str],
    requested_by: Sequence[str | None],
) -> dict[int, Operation]:
    """Insert many ``planned`` operations and their first events in one statement.

    Keys already taken (or being inserted by a concurrent transaction, which this waits
    for), and keys of pruned operations, are skipped: the result maps the position (from 0)
    of each intent this statement inserted to its operation.
    """
    rows = executor.execute(
        _INSERT_INTENTS,
        {
            "intent_keys": list(intent_keys),
            "tools": list(tools),
            "targets": list(targets),
            "payloads": list(canonical_payloads),
            "payload_hashes": list(payload_hashes),
            "intent_hashes": list(intent_hashes),
            "metadata": list(metadata),
            "requested_by": list(requested_by),
        },
    )
    return {int(row["position"]) - 1: Operation.from_row(row) for row in rows.mappings()}


def find_operations(executor: Executor, intent_keys: Sequence[str]) -> list[Operation]:
    """The operations recorded under these intent keys (those that exist)."""
    query = select(operations).where(operations.c.intent_key.in_(list(intent_keys)))
    return [Operation.from_row(row) for row in executor.execute(query).mappings()]


def find_pruned_intents(executor: Executor, intent_keys: Sequence[str]) -> list[PrunedIntent]:
    """What is kept of the pruned operations recorded under these intent keys (those pruned)."""
    query = select(pruned_intents).where(pruned_intents.c.intent_key.in_(list(intent_keys)))
    return [PrunedIntent.from_row(row) for row in executor.execute(query).mappings()]


def get_operation(executor: Executor, operation_id: UUID) -> Operation | None:
    """The operation with this id, or ``None``."""
    row = executor.execute(select(operations).where(operations.c.id == operation_id))
    found = row.mappings().one_or_none()
    return Operation.from_row(found) if found is not None else None


def find_operation(executor: Executor, intent_key: str) -> Operation | None:
    """The operation recorded under this intent key, or ``None``."""
    row = executor.execute(select(operations).where(operations.c.intent_key == intent_key))
    found = row.mappings().one_or_none()
    return Operation.from_row(found) if found is not None else None


def list_operations(
    executor: Executor,
    *,
    state: State | None = None,
    tool: str | None = None,
    limit: int = 50,
) -> list[Operation]:
    """The newest operations first (ids are UUIDv7, so id order is creation order)."""
    query = select(operations).order_by(operations.c.id.desc()).limit(limit)
    if state is not None:
        query = query.where(operations.c.state == state.value)
    if tool is not None:
        query = query.where(operations.c.tool == tool)
    return [Operation.from_row(row) for row in executor.execute(query).mappings()]


def list_events(executor: Executor, operation_id: UUID) -> list[Event]:
    """An operation's audit trail, oldest first."""
    query = select(events).where(events.c.operation_id == operation_id).order_by(events.c.id)
    return [Event.from_row(row) for row in executor.execute(query).mappings()]


def register_waiter(executor: Executor, operation_id: UUID) -> None:
    """Ask settled moves of ``operation_id`` to NOTIFY this session (until forget_waiter).

    Also drops rows of sessions that ended without forgetting theirs (a killed waiter):
    each would cost its operation one needless NOTIFY.
    """
    executor.execute(
        text(
            "WITH gone AS (DELETE FROM outbox.waiters WHERE backend_pid NOT IN "
            "(SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL)) "
            "INSERT INTO outbox.waiters (operation_id, backend_pid) "
            "VALUES (:operation_id, pg_backend_pid()) ON CONFLICT DO NOTHING"
        ),
        {"operation_id": operation_id},
    )


def forget_waiter(executor: Executor, operation_id: UUID) -> None:
    """Undo :func:`register_waiter` for this session."""
    executor.execute(
        text(
            "DELETE FROM outbox.waiters "
            "WHERE operation_id = :operation_id AND backend_pid = pg_backend_pid()"
        ),
        {"operation_id": operation_id},
    )


# --- relay ------------------------------------------------------------------------------

#: NOTIFY channel the relay listens on; rung by enqueue only while some relay is idle.
PLANNED_CHANNEL = "outbox_planned"

# The queue scans bound time with statement_timestamp(), not clock_timestamp(): a volatile
# function cannot be an index condition, so the partial index would only order the scan and
# every not-yet-due row of the queue would be read and filtered (bench/scale.py --not-due).
_CLAIM_DUE = DriverStatement.of(
    text(
        """
    SELECT id, tool, target FROM outbox.operations
    WHERE state = 'planned'
      AND available_at <= statement_timestamp()
      AND (published_at IS NULL
           OR published_at <= statement_timestamp() - make_interval(secs => :republish_after))
    ORDER BY available_at
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
    """
    ),
    ["id", "tool", "target"],
)


def claim_due(
    executor: Executor, *, limit: int, republish_after_s: float
) -> list[tuple[UUID, str, str]]:
    """Lock up to ``limit`` due ``planned`` rows not published recently: (id, tool, target).

    ``SKIP LOCKED`` lets several relays claim disjoint batches; the row locks last until the
    caller's transaction ends, so a batch is published by one relay at a time.
    """
    rows = _CLAIM_DUE.fetch_all(executor, {"limit": limit, "republish_after": republish_after_s})
    return [(row["id"], row["tool"], row["target"]) for row in rows]


def mark_published(executor: Executor, operation_ids: list[UUID]) -> int:
    """Record that these rows' messages were confirmed by the broker; returns rows updated."""
    if not operation_ids:
        return 0
    row = _MARK_PUBLISHED.fetch_one(executor, {"ids": operation_ids})
    assert row is not None  # noqa: S101 -- a count always returns a row
    return int(row["updated"])


_MARK_PUBLISHED = DriverStatement.of(
    text(
        """
    WITH marked AS (
        UPDATE outbox.operations SET published_at = clock_timestamp()
        WHERE id = ANY(CAST(:ids AS uuid[])) AND state = 'planned'
        RETURNING 1
    )
    SELECT count(*) AS updated FROM marked
    """
    ),
    ["updated"],
)


def announce_relay(executor: Executor, name: str, *, pid: int, host: str, idle: bool) -> None:
    """Record a running relay and whether it sleeps on LISTEN (then enqueue rings the bell).

    An upsert, so it doubles as the heartbeat and survives a peer's clean-up of its row.
    """
    executor.execute(
        text(
            "INSERT INTO outbox.relays (name, pid, host, idle) VALUES (:name, :pid, :host, :idle) "
            "ON CONFLICT (name) DO UPDATE SET idle = :idle, heartbeat_at = clock_timestamp()"
        ),
        {"name": name, "pid": pid, "host": host, "idle": idle},
    )


def any_due_unpublished(executor: Executor) -> bool:
    """Whether some due ``planned`` row has never been published."""
    row = executor.execute(
        text(
            "SELECT EXISTS (SELECT FROM outbox.operations WHERE state = 'planned' "
            "AND available_at <= statement_timestamp() AND published_at IS NULL)"
        )
    )
    return bool(row.scalar_one())


def forget_relay(executor: Executor, name: str) -> None:
    """Remove a relay's row when it stops."""
    executor.execute(text("DELETE FROM outbox.relays WHERE name = :name"), {"name": name})


def forget_silent_relays(executor: Executor, *, older_than_s: float) -> int:
    """Remove rows of relays that stopped heartbeating (killed): they would keep the bell on."""
    result = executor.execute(
        text(
            "DELETE FROM outbox.relays "
            "WHERE heartbeat_at < clock_timestamp() - make_interval(secs => :age)"
        ),
        {"age": older_than_s},
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


# --- deployment ---------------------------------------------------------------------------

#: NOTIFY channel on which a worker reports a message naming an operation this database does
#: not have; its payload is the task (``dispatch``, ``lookup``). ``outbox metrics`` counts them.
UNKNOWN_OPERATION_CHANNEL = "outbox_unknown_operation"


def database_identity(executor: Executor) -> tuple[int, int]:
    """(the cluster's system identifier, this database's OID): the same for every session on
    this database, a physical standby included, and different for any other database."""
    row = executor.execute(
        text(
            "SELECT (SELECT system_identifier FROM pg_control_system()) AS cluster, "
            "(SELECT oid::bigint FROM pg_database WHERE datname = current_database()) AS database"
        )
    ).one()
    return int(row.cluster), int(row.database)


def notify_unknown_operation(executor: Executor, task: str) -> None:
    """Tell whoever counts (``outbox metrics``) that a ``task`` message named an operation
    this database does not have. Sent with the caller's commit (now, in autocommit mode)."""
    executor.execute(
        select(func.pg_notify(UNKNOWN_OPERATION_CHANNEL, task)),
    )


# --- dispatch -----------------------------------------------------------------------------


def try_lock(executor: Executor, key: int) -> bool:
    """Take the session-level advisory lock ``key`` without waiting; whether it was taken."""
    _may_hold_session_locks(executor)
    row = executor.execute(text("SELECT pg_try_advisory_lock(:key)"), {"key": key})
    return bool(row.scalar_one())


def try_lock_durable(executor: Executor, key: int) -> tuple[bool, str]:
    """:func:`try_lock`, and the session's ``synchronous_commit``, in one round trip."""
    _may_hold_session_locks(executor)
    row = executor.execute(_TRY_LOCK_DURABLE, {"key": key}).one()
    return bool(row.taken), str(row.synchronous_commit)


_TRY_LOCK_DURABLE = text(
    "SELECT pg_try_advisory_lock(:key) AS taken, "
    "current_setting('synchronous_commit') AS synchronous_commit"
)


#: SQLSTATE lock_not_available: a NOWAIT lock or a lock_timeout that found the row held.
_LOCK_NOT_AVAILABLE = "55P03"


def is_row_lock_busy(exc: BaseException) -> bool:
    """Whether ``exc`` (a DBAPIError) is a row lock that was held by another transaction."""
    return getattr(getattr(exc, "orig", None), "sqlstate", None) == _LOCK_NOT_AVAILABLE


def wait_for_row_lock(executor: Executor, operation_id: UUID, *, timeout_s: float) -> None:
    """Wait until no other transaction holds ``operation_id``'s row (at most ``timeout_s``).

    Takes a share lock on the row, released when the statement's transaction ends (on an
    autocommit connection, at once): a way to wait for a relay's claim to commit. Raises a
    DBAPIError for which :func:`is_row_lock_busy` is true if the row stayed held.
    ``lock_timeout`` is set for this statement's transaction only, before the lock is asked.
    """
    executor.execute(
        text(
            "WITH cfg AS MATERIALIZED (SELECT set_config('lock_timeout', :ms, true) AS v) "
            "SELECT count(*) FROM cfg, LATERAL (SELECT 1 FROM outbox.operations o "
            "WHERE o.id = :id AND cfg.v IS NOT NULL FOR SHARE OF o) AS r"
        ),
        {"id": operation_id, "ms": str(max(1, round(timeout_s * 1000)))},
    )


def set_synchronous_commit(executor: Executor) -> None:
    """Make every later COMMIT of this session wait for the WAL flush (and sync replicas).

    For a connection in autocommit mode, where ``SET LOCAL`` has no transaction to apply to;
    the setting stays with the pooled connection, which is what the dispatcher wants.
    """
    executor.execute(text("SET synchronous_commit = on"))


def unlock_all(executor: Executor) -> None:
    """Release every session-level advisory lock this connection holds."""
    executor.execute(text("SELECT pg_advisory_unlock_all()"))
    if isinstance(executor, Connection):
        executor.info.pop(SESSION_LOCKS_INFO, None)


def _may_hold_session_locks(executor: Executor) -> None:
    # Marked before the lock is asked for: a statement or step that fails after the lock was
    # granted leaves it held, and the pool's reset must then release it (outbox.db).
    if isinstance(executor, Connection):
        executor.info[SESSION_LOCKS_INFO] = True


def require_synchronous_commit(executor: Executor) -> None:
    """Make the current transaction's COMMIT wait for the WAL flush (and sync replicas).

    The `sent` commit must be durable before any byte goes to the remote, whatever the
    server's or role's default for ``synchronous_commit``.
    """
    executor.execute(text("SET LOCAL synchronous_commit = on"))


_DISPATCH_VIEW = text(
    """
    SELECT *,
           available_at <= clock_timestamp() AS due,
           replay_deadline IS NOT NULL AND replay_deadline <= clock_timestamp() AS replay_expired
    FROM outbox.operations WHERE id = :id
    """
)


def get_for_dispatch(executor: Executor, operation_id: UUID) -> tuple[Operation, bool, bool] | None:
    """The operation, whether it is due, and whether its replay deadline has passed.

    Both judged by the database clock, in the same read.
    """
    row = executor.execute(_DISPATCH_VIEW, {"id": operation_id}).mappings().one_or_none()
    if row is None:
        return None
    return Operation.from_row(row), bool(row["due"]), bool(row["replay_expired"])


_LOCK_AND_READ = DriverStatement.of(
    text(
        f"""
    WITH lk AS MATERIALIZED (
        SELECT pg_try_advisory_lock(:key) AS taken,
               current_setting('synchronous_commit') AS synchronous_commit
        -- An aggregate consumes its input before the lock is taken: the session's previous
        -- locks (the previous operation's) are released first when asked.
        FROM (SELECT count(*) FROM (SELECT pg_advisory_unlock_all() WHERE :unlock_first) AS u)
          AS unlocked
    )
    SELECT lk.taken, lk.synchronous_commit, {", ".join(f"op.{n}" for n in _OPERATION_COLUMNS)},
           op.available_at <= clock_timestamp() AS due,
           op.replay_deadline IS NOT NULL AND op.replay_deadline <= clock_timestamp()
             AS replay_expired
    -- The row comes from a function fed with the lock's result: its query runs after the
    -- lock was granted, with a snapshot of its own (migration 0007).
    FROM lk LEFT JOIN LATERAL outbox.operation_if_locked(:id, lk.taken) AS op ON true
    """  # noqa: S608 -- the column names come from the table's definition, not from input
    ),
    ["taken", "synchronous_commit", *_OPERATION_COLUMNS, "due", "replay_expired"],
)


def try_lock_and_read(
    executor: Executor, key: int, operation_id: UUID, *, unlock_first: bool = False
) -> tuple[bool, str, tuple[Operation, bool, bool] | None]:
    """:func:`try_lock_durable` and, if the lock was taken, :func:`get_for_dispatch`, in one
    round trip: (taken, the session's ``synchronous_commit``, the operation or ``None``).

    The row is read after the lock was granted, so it shows every move committed by the
    lock's previous holder, exactly as a read in a statement of its own would.
    ``unlock_first``: release every advisory lock this session holds before taking this one.
    """
    _may_hold_session_locks(executor)
    row = _LOCK_AND_READ.fetch_one(
        executor, {"key": key, "id": operation_id, "unlock_first": unlock_first}
    )
    assert row is not None  # noqa: S101 -- the statement returns one row, whatever the lock
    taken, synchronous_commit = bool(row["taken"]), str(row["synchronous_commit"])
    if not taken or row["id"] is None:
        return taken, synchronous_commit, None
    found = Operation.from_row(row), bool(row["due"]), bool(row["replay_expired"])
    return taken, synchronous_commit, found


def lock_holder_pid(executor: Executor, key: int) -> int | None:
    """The backend pid holding session advisory lock ``key`` in this database, or ``None``.

    Must run on a connection that does not hold the lock itself: it reads ``pg_locks``.
    """
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    row = executor.execute(
        text(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = :hi AND objid = :lo AND objsubid = 1 "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        ),
        {"hi": unsigned >> 32, "lo": unsigned & 0xFFFFFFFF},
    ).first()
    return int(row.pid) if row is not None else None


@dataclass(frozen=True)
class Replication:
    """What the server says of its streaming standbys (:func:`replication`)."""

    #: Physical standbys streaming from this server (logical walsenders are not standbys).
    standbys: int
    #: Of those, the ones a commit waits for (``sync_state`` ``sync`` or ``quorum``).
    synchronous: int
    #: The server's ``synchronous_standby_names`` (empty: no commit waits for a standby).
    synchronous_standby_names: str

    @property
    def asynchronous_only(self) -> bool:
        """Standbys stream, and a failover to one may lose commits this server acknowledged."""
        return self.standbys > 0 and (
            self.synchronous == 0 or not self.synchronous_standby_names.strip()
        )


_REPLICATION = text(
    """
    SELECT count(*) AS standbys,
           count(*) FILTER (WHERE r.sync_state IN ('sync', 'quorum')) AS synchronous,
           current_setting('synchronous_standby_names') AS names
    FROM pg_stat_replication AS r
    WHERE NOT EXISTS (SELECT FROM pg_replication_slots AS s
                      WHERE s.active_pid = r.pid AND s.slot_type = 'logical')
    """
)


def replication(executor: Executor) -> Replication:
    """The server's standbys as ``pg_stat_replication`` shows them to this role.

    A role without ``pg_read_all_stats`` sees the standbys but not their ``sync_state``, so
    they count as asynchronous: the safe reading.
    """
    row = executor.execute(_REPLICATION).one()
    return Replication(int(row.standbys), int(row.synchronous), str(row.names))


# --- reconciler ---------------------------------------------------------------------------

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
) -> list[tuple[UUID, int, bool]]:
    """`sent` rows older than the timeout: (id, attempt, older than the max age)."""
    rows = executor.execute(
        _STALE_SENT, {"timeout": sent_timeout_s, "max_age": sent_max_age_s, "limit": limit}
    )
    return [(row.id, row.attempts, bool(row.too_old)) for row in rows]


def due_unknown(executor: Executor, *, limit: int) -> list[tuple[UUID, str]]:
    """`unknown` rows whose next check is due, oldest first: (id, tool)."""
    rows = executor.execute(
        text(
            "SELECT id, tool FROM outbox.operations "
            "WHERE state = 'unknown' AND next_check_at <= statement_timestamp() "
            "ORDER BY next_check_at LIMIT :limit"
        ),
        {"limit": limit},
    )
    return [(row.id, row.tool) for row in rows]


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


@dataclass(frozen=True)
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
    when = (
        "sent_at + make_interval(secs => :horizon)"
        if at_horizon_s is not None
        else "clock_timestamp() + make_interval(secs => :delay)"
    )
    result = executor.execute(
        text(
            f"UPDATE outbox.operations SET next_check_at = {when}, "  # noqa: S608 -- constant fragments
            "checks = checks + :add, last_error = coalesce(:error, last_error), "
            "updated_at = updated_at "
            "WHERE id = :id AND state = 'unknown' AND attempts = :attempt"
        ),
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


def unlock(executor: Executor, key: int) -> None:
    """Release one session-level advisory lock held by this connection."""
    executor.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})


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
    _may_hold_session_locks(executor)
    row = executor.execute(text("SELECT pg_try_advisory_lock(:hi, :lo)"), _claim_halves(key))
    return bool(row.scalar_one())


def release_sweep_claim(executor: Executor, key: int) -> None:
    """Release the claim :func:`try_sweep_claim` took."""
    executor.execute(text("SELECT pg_advisory_unlock(:hi, :lo)"), _claim_halves(key))


#: The key of an event's ``detail`` that marks a sweep's failure to handle the row.
SWEEP_FAILURE_KEY = "sweep_error"


def sweep_failures(executor: Executor, operation_id: UUID, *, state: State, attempt: int) -> int:
    """How many times the sweep failed on this operation in ``state`` at ``attempt``
    (events recorded with a ``sweep_error`` detail): the database remembers across runs."""
    row = executor.execute(
        text(
            "SELECT count(*) FROM outbox.events WHERE operation_id = :id AND attempt = :attempt "
            "AND from_state = :state AND to_state = :state "
            "AND detail ->> :key IS NOT NULL"
        ),
        {"id": operation_id, "attempt": attempt, "state": state.value, "key": SWEEP_FAILURE_KEY},
    )
    return int(row.scalar_one())


# --- retention ----------------------------------------------------------------------------

_TERMINAL_VALUES = ", ".join(f"'{state.value}'" for state in sorted(TERMINAL_STATES))

# Terminal rows resolved before the cutoff, judged by the database clock. `resolved_at < …`
# implies the predicate of ix_operations_resolved_at, so the rows are read from that index,
# oldest first. The state test restates `ck_operations_terminal_iff_resolved`: a live row
# (planned, sent, unknown, needs_human) can never qualify (and the delete guard of migration
# 0010 refuses one). A row is kept while its webhook is still pending (until the deliverer
# delivers or abandons it, so no webhook is lost), while its tool is not registered here (its
# dedup window is unknown), and while its tool's dedup window, from its first send, is open:
# the remote still remembers its key.
_TOOLS = """
    WITH tools AS (
        SELECT * FROM unnest(CAST(:tools AS text[]), CAST(:windows AS float8[]))
          AS t(tool, window_s)
    )
"""
_FINISHED = f"""
    FROM outbox.operations o LEFT JOIN tools t ON t.tool = o.tool
    WHERE o.resolved_at < now() - make_interval(secs => :older_than)
      AND o.state IN ({_TERMINAL_VALUES})
"""
_UNKNOWN_TOOL = "t.tool IS NULL"
_IN_WINDOW = (
    "(o.first_sent_at IS NOT NULL AND t.window_s IS NOT NULL"
    " AND o.first_sent_at + make_interval(secs => t.window_s) > now())"
)
_WEBHOOK_PENDING = (
    "EXISTS (SELECT FROM outbox.webhook_deliveries d"
    " WHERE d.operation_id = o.id AND d.status = 'pending')"
)

_PRUNE_BATCH = text(
    f"""
    {_TOOLS},
    doomed AS (
        SELECT o.id {_FINISHED}
          AND t.tool IS NOT NULL AND NOT {_IN_WINDOW} AND NOT {_WEBHOOK_PENDING}
        ORDER BY o.resolved_at
        LIMIT :limit
        FOR UPDATE OF o SKIP LOCKED
    ),
    -- Each deleted row's intent is remembered in outbox.pruned_intents by the trigger
    -- operations_remember_intent, in this statement (migration 0011).
    deleted AS (
        DELETE FROM outbox.operations AS gone USING doomed WHERE gone.id = doomed.id
        RETURNING 1
    )
    SELECT count(*) FROM deleted
    """  # noqa: S608 -- constant fragments
)

_COUNT_PRUNABLE = text(
    f"""
    {_TOOLS}
    SELECT count(*) FILTER (WHERE t.tool IS NOT NULL AND NOT {_IN_WINDOW}
                              AND NOT {_WEBHOOK_PENDING}) AS prunable,
           count(*) FILTER (WHERE {_UNKNOWN_TOOL}) AS unknown_tool,
           count(*) FILTER (WHERE t.tool IS NOT NULL AND {_IN_WINDOW}) AS in_window,
           count(*) FILTER (WHERE t.tool IS NOT NULL AND NOT {_IN_WINDOW}
                              AND {_WEBHOOK_PENDING}) AS webhook_pending
    {_FINISHED}
    """
)


@dataclass(frozen=True)
class DedupWindows:
    """The registered tools and their dedup windows (``None``: the tool has no dedup contract),
    which retention must respect: an operation of a tool not listed here is never pruned."""

    windows: Mapping[str, float | None]

    def params(self) -> dict[str, list[Any]]:
        names = sorted(self.windows)
        return {"tools": names, "windows": [self.windows[name] for name in names]}


@dataclass(frozen=True)
class PruneCount:
    """Finished operations old enough to prune: how many would go, and how many are kept
    and why (each kept row counted once, under the first reason in this order)."""

    prunable: int
    unknown_tool: int
    in_window: int
    webhook_pending: int


def prune_terminal(
    executor: Executor, *, older_than_s: float, limit: int, windows: DedupWindows
) -> int:
    """Delete up to ``limit`` terminal operations resolved more than ``older_than_s`` ago,
    oldest first, outside their tool's dedup window; returns how many went.

    Their events and webhook deliveries go with them (``ON DELETE CASCADE``), and what
    identifies each one stays in ``outbox.pruned_intents`` (a trigger, same statement). Rows
    locked by another transaction are skipped (``SKIP LOCKED``), so two prunes never wait on
    each other. One batch per call, in the caller's transaction (never commits): keep
    batches small so each transaction, and the locks and WAL it holds, stays short.
    """
    params = {"older_than": older_than_s, "limit": limit, **windows.params()}
    return int(executor.execute(_PRUNE_BATCH, params).scalar_one())


def count_prunable(executor: Executor, *, older_than_s: float, windows: DedupWindows) -> PruneCount:
    """What :func:`prune_terminal` would delete now (batches aside), and what it keeps."""
    row = executor.execute(_COUNT_PRUNABLE, {"older_than": older_than_s, **windows.params()})
    found = row.mappings().one()
    return PruneCount(
        prunable=int(found["prunable"]),
        unknown_tool=int(found["unknown_tool"]),
        in_window=int(found["in_window"]),
        webhook_pending=int(found["webhook_pending"]),
    )


_FORGET_INTENTS = text(
    """
    WITH forgotten AS (
        DELETE FROM outbox.pruned_intents
        WHERE intent_key IN (
            SELECT intent_key FROM outbox.pruned_intents
            WHERE resolved_at < now() - make_interval(secs => :older_than)
            ORDER BY resolved_at LIMIT :limit FOR UPDATE SKIP LOCKED)
        RETURNING 1
    )
    SELECT count(*) FROM forgotten
    """
)


def forget_pruned_intents(executor: Executor, *, older_than_s: float, limit: int) -> int:
    """Delete up to ``limit`` pruned intents whose operation ended more than ``older_than_s``
    ago; returns how many went. From then on their keys can be enqueued anew."""
    row = executor.execute(_FORGET_INTENTS, {"older_than": older_than_s, "limit": limit})
    return int(row.scalar_one())
