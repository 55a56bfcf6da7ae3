"""The relay's statements: claim due intents, mark them published, and the relays' own rows
(their idle flag rings the enqueue bell, :mod:`outbox.sql.notify`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from sqlalchemy import text

from outbox.driver import DriverStatement
from outbox.locks import operation_lock_key
from outbox.models import Executor, Operation
from outbox.sql.columns import OPERATION_COLUMNS
from outbox.sql.locks import DispatchView, mark_session_locks, unlock_all, unmark_session_locks
from outbox.sql.moves import SendTerms


@dataclass(frozen=True, slots=True)
class ClaimedIntent:
    """A due ``planned`` row the relay (or a worker taking directly) claimed to publish."""

    id: UUID
    tool: str
    target: str
    #: The caller's trace context recorded at enqueue (the publish span's parent), if any.
    traceparent: str | None = None
    tracestate: str | None = None
    #: ``published_at`` before :func:`claim_and_mark_due` stamped it (None: never published).
    previous_published_at: datetime | None = None


# The queue scans bound time with statement_timestamp(), not clock_timestamp(): a volatile
# function cannot be an index condition, so the partial index would only order the scan and
# every not-yet-due row of the queue would be read and filtered (bench/scale.py --not-due).
# Two halves, each a scan of a partial index that holds its own candidates (migration 0022):
# rows never published, by due time, first, so that republishing cannot starve new intents;
# then rows published longer than republish_after ago, oldest publish first. One scan of all
# `planned` rows stepped over every row published recently and still waiting for a worker, a
# heap fetch each (a broker backlog made every claim read it all); here those rows are outside
# the second index's range. (FOR UPDATE is refused in a UNION's own arms, hence the
# subqueries.) The outer LIMIT stops the Append: the second half is not started
# when the first fills the batch. The halves are disjoint (published_at NULL or not, on the
# row as locked), so no row comes twice.
# The mark is joined to the claim (issue 35): the rows it locks are stamped published in the
# same statement, in the relay's transaction, which commits only once the broker confirmed
# (a failure rolls the stamp back with the locks). A mark after the publish was a round trip
# on every operation's critical path: a worker handed the message waited for the row's lock
# until the relay committed. A worker taking directly (outbox.workers.direct) runs the same
# statement for one row, in autocommit. The claimed rows are read once (a CTE
# is computed once however often it is referenced), in the claim's order (never published by
# due time, then republished by their last publish). The update finds each row where the
# claim locked it, whatever the table looked like when the statement's generic plan was made
# (a prepared statement keeps it until the table's statistics change): by its ctid (the
# version the claim locked; a newer one, committed after this statement's snapshot, is not
# seen here: a relay's stamp undone by unmark_published in that instant leaves its row
# unmarked and unclaimed for the next look) and by primary key. A join by id alone hashed
# the whole table when a large backlog was due (thousands of claimed rows expected);
# `id = ANY(ARRAY(...))` alone read the whole table when the plan was made on a new,
# near-empty one (ten rows expected, ten pages assumed: 1,500 sequential scans of about
# 3,000 rows in ten seconds of a flat benchmark, until an autovacuum). With both, a plan
# fetches each row by its ctid or probes pk_operations (tests/integration/
# test_relay_claim.py prepares it both ways).
# A worker taking directly looks one row further (:look = :limit + 1) and claims only :limit:
# `seen` then says whether more is due, so a take that emptied the queue is not followed by a
# look that finds nothing (the row looked at is locked only while the autocommit statement
# runs; whoever skipped it meanwhile did not claim it, and the one that saw it looks again).
# :defer (a relay beside RabbitMQ workers that take directly, outbox.workers.listening): rows
# never published are claimed only once due that long while such a worker's flag says it waits
# for work (idle, heartbeat within :fresh, the session that wrote it still open: a killed
# worker's flag stops counting when its socket closes): the worker takes them, one hop
# sooner. One look at the few rows of outbox.relays, computed once per statement (an
# uncorrelated subquery).
# :without_flush makes this statement's own commit return before its WAL reaches the disk
# (set_config's third argument: for this transaction only), for a take in autocommit on a
# connection whose session stays durable (the one a worker hands to its dispatch task).
_CLAIM_AND_MARK_DUE = DriverStatement.of(
    text(
        """
    WITH cfg AS MATERIALIZED (
        SELECT CASE WHEN :without_flush
                    THEN set_config('synchronous_commit', 'off', true) END AS set
    ), candidates AS (
        SELECT row_ctid, id, tool, target, traceparent, tracestate, published_at, lock_key,
               0 AS half, available_at AS turn
        FROM (
            SELECT ctid AS row_ctid, id, tool, target, traceparent, tracestate, published_at,
                   lock_key, available_at
            FROM outbox.operations
            WHERE state = 'planned' AND published_at IS NULL
              AND available_at <= statement_timestamp() - make_interval(secs => GREATEST(
                  CAST(:hold_back AS float8),
                  (SELECT CAST(:defer AS float8) WHERE CAST(:defer AS float8) > 0 AND EXISTS (
                      SELECT FROM outbox.relays WHERE idle AND name LIKE 'listening-taker:%'
                        AND heartbeat_at > clock_timestamp()
                                           - make_interval(secs => CAST(:fresh AS float8))
                        AND (backend_pid IS NULL
                             OR EXISTS (SELECT FROM pg_stat_get_activity(backend_pid)))))))
            ORDER BY available_at
            LIMIT :look
            FOR UPDATE SKIP LOCKED
        ) AS never_published
        UNION ALL
        SELECT row_ctid, id, tool, target, traceparent, tracestate, published_at, lock_key,
               1 AS half, published_at AS turn
        FROM (
            SELECT ctid AS row_ctid, id, tool, target, traceparent, tracestate, published_at,
                   lock_key
            FROM outbox.operations
            WHERE state = 'planned' AND published_at IS NOT NULL
              AND published_at <= statement_timestamp() - make_interval(secs => :republish_after)
              AND available_at <= statement_timestamp()
            ORDER BY published_at
            LIMIT :look
            FOR UPDATE SKIP LOCKED
        ) AS republish
        LIMIT :look
    ), claimed AS (
        SELECT * FROM candidates ORDER BY half, turn LIMIT :limit
    ), lk AS MATERIALIZED (
        -- :lock (one row claimed): its advisory lock, by the key enqueue stored (NULL on a row
        -- enqueued before migration 0027: not locked here).
        SELECT c.id, c.lock_key, pg_try_advisory_lock(c.lock_key) AS taken
        FROM claimed AS c WHERE :lock AND c.lock_key IS NOT NULL
    ), moved AS (
        -- :send (a take that locks): the `sent` move once the lock is held, if every check a
        -- dispatcher makes before a send that the database can hold passes: the terms of
        -- outbox.sql.moves' move at the lock (send_conditions), word for word as they render
        -- (tests/unit/test_sql_in_one_place.py). The claim holds the row's newest version.
        UPDATE outbox.operations AS o
        SET state = 'sent', attempts = o.attempts + 1, updated_at = statement_timestamp(),
            sent_at = statement_timestamp(),
            first_sent_at = coalesce(o.first_sent_at, statement_timestamp())
        FROM claimed AS cl JOIN lk ON lk.id = cl.id
        WHERE :send AND lk.taken AND o.ctid = cl.row_ctid AND o.id = cl.id
          AND o.state = 'planned'
          AND array_position(CAST(:send_tools AS TEXT[]), o.tool) IS NOT NULL
          AND o.attempts - o.attempt_budget_base < (CAST(:send_max_attempts AS INTEGER[]))[
                array_position(CAST(:send_tools AS TEXT[]), o.tool)]
          AND NOT ((CAST(:send_approval AS BOOLEAN[]))[
                     array_position(CAST(:send_tools AS TEXT[]), o.tool)]
                   AND o.attempts = 0
                   AND o.approved_payload_hash IS DISTINCT FROM o.payload_hash)
          AND o.available_at <= clock_timestamp()
          AND (o.replay_deadline IS NULL OR statement_timestamp() < o.replay_deadline)
        RETURNING o.*
    ), logged AS (
        INSERT INTO outbox.events (operation_id, from_state, to_state, attempt, actor, reason)
        SELECT id, 'planned', 'sent', attempts, 'dispatcher', 'dispatching attempt ' || attempts
        FROM moved
    ), marked AS (
        -- A row just moved to `sent` is not stamped (one statement updates a row once).
        UPDATE outbox.operations AS o SET published_at = clock_timestamp()
        FROM claimed AS cl
        WHERE o.ctid = cl.row_ctid AND o.id = ANY(ARRAY(SELECT id FROM claimed))
          AND NOT EXISTS (SELECT FROM moved WHERE moved.id = o.id)
        RETURNING o.id
    )
    -- After the claim's columns, the row's as OPERATION_COLUMNS names them, written out as in
    -- the dispatcher's own locked read (tests/unit/test_sql_in_one_place.py checks both).
    SELECT c.id AS claimed_id, c.tool AS claimed_tool, c.target AS claimed_target,
           c.traceparent AS claimed_traceparent, c.tracestate AS claimed_tracestate,
           c.published_at AS previous_published_at,
           (SELECT count(*) FROM candidates) AS seen,
           lk.lock_key AS locked_key, coalesce(lk.taken, false) AS taken,
           op.id, op.intent_key, op.tool, op.target, op.payload, op.payload_hash, op.state,
           op.attempts, op.checks, op.maybe_applied, op.remote_ref, op.result, op.last_error,
           op.metadata, op.requested_by, op.created_at, op.updated_at, op.available_at,
           op.published_at, op.first_sent_at, op.sent_at, op.next_check_at, op.replay_deadline,
           op.resolved_at, op.attempt_budget_base, op.intent_hash, op.approval_required,
           op.approval_expires_at, op.decided_by, op.decided_at, op.approved_payload_hash,
           op.agent, op.traceparent, op.tracestate, op.lock_key,
           op.available_at <= clock_timestamp() AS due,
           op.replay_deadline IS NOT NULL AND op.replay_deadline <= clock_timestamp()
             AS replay_expired,
           sent.id IS NOT NULL AS sent_here
    -- cfg is read for every row claimed: a statement that writes nothing flushes nothing.
    FROM claimed AS c LEFT JOIN marked AS m ON m.id = c.id CROSS JOIN cfg
    LEFT JOIN lk ON lk.id = c.id
    LEFT JOIN moved AS sent ON sent.id = c.id
    -- The row as the move left it, or as the lock's previous holder left it: read by a
    -- function fed with the lock's result, so its query runs after the lock was granted, with
    -- a snapshot of its own (as outbox.sql.locks' locked read). OFFSET 0 keeps the subquery
    -- whole, so its filter gates the call: a row not locked here (the relay's, every one)
    -- costs no call.
    LEFT JOIN LATERAL (SELECT * FROM moved WHERE moved.id = c.id
                       UNION ALL
                       SELECT * FROM outbox.operation_if_locked(c.id, lk.taken)
                       WHERE lk.taken AND sent.id IS NULL OFFSET 0) AS op ON true
    -- A claimed row neither stamped nor moved was changed after this statement's snapshot:
    -- left out, unless its lock was taken (then the caller must know it holds it).
    WHERE m.id IS NOT NULL OR sent.id IS NOT NULL OR lk.taken
    ORDER BY c.half, c.turn
    """
    ),
    [
        "claimed_id",
        "claimed_tool",
        "claimed_target",
        "claimed_traceparent",
        "claimed_tracestate",
        "previous_published_at",
        "seen",
        "locked_key",
        "taken",
        *OPERATION_COLUMNS,
        "due",
        "replay_expired",
        "sent_here",
    ],
)


def claim_and_mark_due(
    executor: Executor,
    *,
    limit: int,
    republish_after_s: float,
    hold_back_s: float = 0.0,
    defer_to_takers_s: float = 0.0,
    takers_heartbeat_within_s: float = 30.0,
) -> list[ClaimedIntent]:
    """Lock up to ``limit`` due ``planned`` rows not published recently, and stamp them
    ``published_at`` in the same statement.

    Rows never published come first (oldest due first), then rows published more than
    ``republish_after_s`` ago (their message was lost; oldest publish first). ``SKIP LOCKED``
    lets several relays (and workers) claim disjoint batches; the row locks last until the
    caller's transaction ends, so a batch is published by one relay at a time.

    The stamp is the caller's to keep or undo: commit it once the broker confirmed the
    messages, roll the transaction back if the publish failed, and hand the rows the broker
    did not confirm to :func:`unmark_published` before committing. Each intent carries the
    ``published_at`` it had before (its ``previous_published_at``).

    ``hold_back_s``: rows never published are claimed only once due for that long (a relay
    standing by while workers take them directly, :mod:`outbox.workers.direct`).

    ``defer_to_takers_s``: while a RabbitMQ worker that takes directly waits for work (its
    ``listening-taker:`` flag idle, heartbeat within ``takers_heartbeat_within_s``), rows never
    published are claimed only once due for that long: that worker takes them
    (:mod:`outbox.workers.listening`). Decided inside the statement, no round trip of its own.
    """
    taken = _claim_and_mark(
        executor,
        limit=limit,
        look=limit,
        republish_after_s=republish_after_s,
        hold_back_s=hold_back_s,
        without_flush=False,
        lock=False,
        defer_s=defer_to_takers_s,
        fresh_s=takers_heartbeat_within_s,
    )
    return taken.claimed


@dataclass(frozen=True, slots=True)
class DueTake:
    """What :func:`take_due` claimed, whether more was due besides, and, when it was asked to
    lock, whether the claimed row's advisory lock was taken and the row as read after it."""

    claimed: list[ClaimedIntent]
    more: bool
    #: The operation's lock is held by the session (``lock=True`` only).
    locked: bool = False
    #: The row read after the lock was granted (None: not locked, or gone meanwhile).
    found: DispatchView | None = None
    #: ``send`` only: the take itself moved that row to `sent`, committed durably (``found``
    #: is the row as moved). With ``locked`` false the row's stored lock key was not its own.
    sent: bool = False


def take_due(
    executor: Executor,
    *,
    limit: int,
    republish_after_s: float,
    flush: bool = True,
    lock: bool = False,
    send: SendTerms | None = None,
) -> DueTake:
    """:func:`claim_and_mark_due` for a worker taking directly (autocommit): up to ``limit``
    rows, and whether another one was due (looked at in the same statement, not claimed).

    ``flush=False``: the statement's commit does not wait for the disk (the stamp is advice:
    a lost one only lets the row be claimed again), whatever the session's
    ``synchronous_commit``, which later commits on the connection keep.

    ``lock=True`` (``limit`` 1): the claimed row's session advisory lock is taken in the same
    statement, by the key enqueue stored in the row (migration 0027), and the row is read
    after the lock was granted, as :func:`outbox.sql.locks.try_lock_and_read` reads it. The
    key is checked against the id (:func:`outbox.locks.operation_lock_key`) before the lock
    is trusted: a wrong one is released at once and the take reports the row not locked, as
    it does a row that has no key (enqueued before 0027) or whose lock another holder has.

    ``send`` (with ``lock``; the state move is :func:`outbox.transitions.take_and_mark_sent`'s
    to ask): once the lock is held, the row is moved `planned -> sent` in the same statement
    if every check ``send`` holds passes (as :func:`outbox.sql.moves.move_at_lock`), its
    event written, and the statement's commit waits for the disk (``flush`` is ignored). A
    row a check refused is taken, locked and read as without ``send``.
    """
    if lock and limit != 1:
        raise ValueError(f"a take that locks claims one row, not {limit}")
    if send is not None and not lock:
        raise ValueError("a take that sends must lock")
    return _claim_and_mark(
        executor,
        limit=limit,
        look=limit + 1,
        republish_after_s=republish_after_s,
        hold_back_s=0.0,
        without_flush=not flush and send is None,
        lock=lock,
        send=send,
    )


def _claim_and_mark(
    executor: Executor,
    *,
    limit: int,
    look: int,
    republish_after_s: float,
    hold_back_s: float,
    without_flush: bool,
    lock: bool,
    defer_s: float = 0.0,
    fresh_s: float = 0.0,
    send: SendTerms | None = None,
) -> DueTake:
    if lock:
        mark_session_locks(executor)  # before the lock is asked: the pool's reset releases it
    rows = _CLAIM_AND_MARK_DUE.fetch_all(
        executor,
        {
            "limit": limit,
            "look": look,
            "republish_after": republish_after_s,
            "hold_back": hold_back_s,
            "defer": defer_s,
            "fresh": fresh_s,
            "without_flush": without_flush,
            "lock": lock,
            "send": send is not None,
            **(send or _NO_TERMS).params(),
        },
    )
    claimed = [
        ClaimedIntent(
            row["claimed_id"],
            row["claimed_tool"],
            row["claimed_target"],
            row["claimed_traceparent"],
            row["claimed_tracestate"],
            row["previous_published_at"],
        )
        for row in rows
    ]
    more = bool(rows) and rows[0]["seen"] > len(rows)
    if not lock:
        return DueTake(claimed, more)
    if not rows or not rows[0]["taken"]:
        unmark_session_locks(executor)  # no lock was granted: nothing to release
        return DueTake(claimed, more)
    [row] = rows
    sent = bool(row["sent_here"])
    found = None
    if row["id"] is not None:
        operation = Operation.from_row(row)
        found = DispatchView(operation, bool(row["due"]), bool(row["replay_expired"]))
    if row["locked_key"] != operation_lock_key(row["claimed_id"]):
        # Not the key every other holder of this operation's lock computes: worth nothing.
        unlock_all(executor)
        return DueTake(claimed, more, found=found if sent else None, sent=sent)
    return DueTake(claimed, more, locked=True, found=found, sent=sent)


#: No tool may be sent by a take (a relay's claim, a take that does not send).
_NO_TERMS = SendTerms((), (), ())


_UNMARK_PUBLISHED = text(
    "UPDATE outbox.operations AS o SET published_at = u.previous "
    "FROM unnest(CAST(:ids AS uuid[]), CAST(:previous AS timestamptz[])) AS u(id, previous) "
    "WHERE o.id = u.id AND o.state = 'planned'"
)


def unmark_published(executor: Executor, claimed: list[ClaimedIntent]) -> None:
    """Give ``claimed`` rows (stamped by :func:`claim_and_mark_due`, the broker did not confirm
    their messages) back the ``published_at`` they had, in the caller's transaction."""
    if not claimed:
        return
    executor.execute(
        _UNMARK_PUBLISHED,
        {
            "ids": [c.id for c in claimed],
            "previous": [c.previous_published_at for c in claimed],
        },
    )


_ANNOUNCE_RELAY = text(
    "INSERT INTO outbox.relays (name, pid, host, idle, backend_pid) "
    "VALUES (:name, :pid, :host, :idle, pg_backend_pid()) "
    "ON CONFLICT (name) DO UPDATE SET idle = :idle, heartbeat_at = clock_timestamp(), "
    "backend_pid = pg_backend_pid()"
)


def announce_relay(executor: Executor, name: str, *, pid: int, host: str, idle: bool) -> None:
    """Record a running relay and whether it sleeps on LISTEN (then enqueue rings the bell).

    An upsert, so it doubles as the heartbeat and survives a peer's clean-up of its row. The
    row names the session that wrote it (``backend_pid``): a worker's flag counts only while
    that session is open, so write it on the connection kept for the process's life.
    """
    executor.execute(_ANNOUNCE_RELAY, {"name": name, "pid": pid, "host": host, "idle": idle})


_ANY_DUE_UNPUBLISHED = text(
    "SELECT EXISTS (SELECT FROM outbox.operations WHERE state = 'planned' "
    "AND available_at <= statement_timestamp() AND published_at IS NULL)"
)


def any_due_unpublished(executor: Executor) -> bool:
    """Whether some due ``planned`` row has never been published."""
    row = executor.execute(_ANY_DUE_UNPUBLISHED)
    return bool(row.scalar_one())


#: The name prefix of a worker's row in ``outbox.relays``: a worker that takes due operations
#: itself, on the database broker in the outbox's own database (:mod:`outbox.workers.direct`).
#: Its idle flag rings the bell as a relay's does; a relay stands by while one lives.
TAKER_PREFIX = "taker:"
#: The name prefix of a RabbitMQ worker's row that takes due operations itself
#: (:mod:`outbox.workers.listening`): while its flag is up (it waits for work) a relay leaves
#: fresh rows to it for a moment; while it is down (the worker carries a backlog, taking as its
#: slots free) a relay stands by, as for a database broker's taker.
LISTENING_TAKER_PREFIX = "listening-taker:"
#: The name prefix of a worker's row that takes nothing directly, only the relay's messages
#: (:mod:`outbox.workers.message_only`): while one lives, a relay standing by for the takers
#: claims what they left untaken for a moment, not for ``standby_hold_back_s``.
CONSUMER_PREFIX = "consumer:"


@dataclass(frozen=True, slots=True)
class Takers:
    """The workers that take due operations directly, as a relay sees them."""

    #: A database broker's taker, or a RabbitMQ worker whose flag is down (it carries a
    #: backlog, or takes as its slots free), heartbeat lately: the relay stands by.
    live: bool
    #: A RabbitMQ worker's flag is up (it waits for work, heartbeat lately): the relay leaves
    #: fresh rows to it.
    waiting: bool
    #: A worker that takes only messages lives (heartbeat lately): a relay standing by does
    #: not make it wait long.
    consumers: bool = False


# A flag counts while its heartbeat is fresh and the session that wrote it is still there
# (a killed worker's ends with its socket: no need to wait for the heartbeat to age).
_TAKERS = text(
    """
    SELECT coalesce(bool_or(name LIKE 'taker:%' OR (name LIKE 'listening-taker:%' AND NOT idle)),
                    false),
           coalesce(bool_or(name LIKE 'listening-taker:%' AND idle), false),
           coalesce(bool_or(name LIKE 'consumer:%'), false)
    FROM outbox.relays
    WHERE heartbeat_at > clock_timestamp() - make_interval(secs => :fresh)
      AND (backend_pid IS NULL OR EXISTS (SELECT FROM pg_stat_get_activity(backend_pid)))
    """
)


def takers(executor: Executor, *, heartbeat_within_s: float) -> Takers:
    """Which workers take directly, one look: a flag counts while its heartbeat is within
    ``heartbeat_within_s`` and the database session that wrote it is still open."""
    live, waiting, consumers = executor.execute(_TAKERS, {"fresh": heartbeat_within_s}).one()
    return Takers(bool(live), bool(waiting), bool(consumers))


# A RabbitMQ worker whose last slot filled (its flag just went down) rings the relays: one that
# left fresh rows to waiting workers looks again at once (outbox.workers.listening). A worker
# that takes only messages rings with CONSUMER_RING as its row comes and goes: a relay standing
# by, which otherwise looks at the flags once a heartbeat interval, looks again after its poll
# for that ring alone (the takers' flags go up and down often through a flat run: a relay that
# looked again for each of their rings claimed and published behind their backs).
_RING_RELAYS = text("SELECT pg_notify('outbox_relay', :why)")

#: The payload of a message-only worker's ring on the relays' channel.
CONSUMER_RING = "consumer"


def ring_relays(executor: Executor, *, why: str = "") -> None:
    """NOTIFY the relays' own channel with payload ``why`` (sent with the caller's commit: at
    once in autocommit)."""
    executor.execute(_RING_RELAYS, {"why": why})


# Rings enqueue's bell (the channel's name written out: see outbox.sql.notify) when some due
# row was never published: a relay standing by wakes the workers for a row whose backoff
# ended, which no commit rang for (they poll only every OUTBOX_BROKER_POLL_INTERVAL).
_RING_IF_DUE_UNPUBLISHED = text(
    "SELECT pg_notify('outbox_planned', '') WHERE EXISTS (SELECT FROM outbox.operations "
    "WHERE state = 'planned' AND available_at <= statement_timestamp() AND published_at IS NULL)"
)


def ring_if_due_unpublished(executor: Executor) -> None:
    """NOTIFY enqueue's bell if some due ``planned`` row has never been published (sent with
    the caller's commit: at once in autocommit mode)."""
    executor.execute(_RING_IF_DUE_UNPUBLISHED)


_FORGET_RELAY = text("DELETE FROM outbox.relays WHERE name = :name")


def forget_relay(executor: Executor, name: str) -> None:
    """Remove a relay's row when it stops."""
    executor.execute(_FORGET_RELAY, {"name": name})


_FORGET_SILENT_RELAYS = text(
    "DELETE FROM outbox.relays WHERE heartbeat_at < clock_timestamp() - make_interval(secs => :age)"
)


def forget_silent_relays(executor: Executor, *, older_than_s: float) -> int:
    """Remove rows of relays that stopped heartbeating (killed): they would keep the bell on."""
    result = executor.execute(_FORGET_SILENT_RELAYS, {"age": older_than_s})
    return int(result.rowcount)  # type: ignore[attr-defined]
