"""The relay's statements: claim due intents, mark them published, and the relays' own rows
(their idle flag rings the enqueue bell, :mod:`outbox.sql.notify`)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from sqlalchemy import text

from outbox.driver import DriverStatement
from outbox.models import Executor


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
# due time, then republished by their last publish). The update finds them by primary key
# (`= ANY(ARRAY(...))`): written as a join, the planner hashed the whole table for it.
# A worker taking directly looks one row further (:look = :limit + 1) and claims only :limit:
# `seen` then says whether more is due, so a take that emptied the queue is not followed by a
# look that finds nothing (the row looked at is locked only while the autocommit statement
# runs; whoever skipped it meanwhile did not claim it, and the one that saw it looks again).
_CLAIM_AND_MARK_DUE = DriverStatement.of(
    text(
        """
    WITH candidates AS (
        SELECT id, tool, target, traceparent, tracestate, published_at, 0 AS half,
               available_at AS turn
        FROM (
            SELECT id, tool, target, traceparent, tracestate, published_at, available_at
            FROM outbox.operations
            WHERE state = 'planned' AND published_at IS NULL
              AND available_at <= statement_timestamp() - make_interval(secs => :hold_back)
            ORDER BY available_at
            LIMIT :look
            FOR UPDATE SKIP LOCKED
        ) AS never_published
        UNION ALL
        SELECT id, tool, target, traceparent, tracestate, published_at, 1 AS half,
               published_at AS turn
        FROM (
            SELECT id, tool, target, traceparent, tracestate, published_at
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
    ), marked AS (
        UPDATE outbox.operations SET published_at = clock_timestamp()
        WHERE id = ANY(ARRAY(SELECT id FROM claimed))
        RETURNING id
    )
    SELECT c.id, c.tool, c.target, c.traceparent, c.tracestate,
           c.published_at AS previous_published_at,
           (SELECT count(*) FROM candidates) AS seen
    FROM claimed AS c JOIN marked AS m ON m.id = c.id
    ORDER BY c.half, c.turn
    """
    ),
    ["id", "tool", "target", "traceparent", "tracestate", "previous_published_at", "seen"],
)


def claim_and_mark_due(
    executor: Executor, *, limit: int, republish_after_s: float, hold_back_s: float = 0.0
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
    """
    return _claim_and_mark(executor, limit, limit, republish_after_s, hold_back_s).claimed


@dataclass(frozen=True, slots=True)
class DueTake:
    """What :func:`take_due` claimed, and whether more was due besides."""

    claimed: list[ClaimedIntent]
    more: bool


def take_due(executor: Executor, *, limit: int, republish_after_s: float) -> DueTake:
    """:func:`claim_and_mark_due` for a worker taking directly (autocommit): up to ``limit``
    rows, and whether another one was due (looked at in the same statement, not claimed)."""
    return _claim_and_mark(executor, limit, limit + 1, republish_after_s, 0.0)


def _claim_and_mark(
    executor: Executor, limit: int, look: int, republish_after_s: float, hold_back_s: float
) -> DueTake:
    rows = _CLAIM_AND_MARK_DUE.fetch_all(
        executor,
        {
            "limit": limit,
            "look": look,
            "republish_after": republish_after_s,
            "hold_back": hold_back_s,
        },
    )
    claimed = [
        ClaimedIntent(
            row["id"],
            row["tool"],
            row["target"],
            row["traceparent"],
            row["tracestate"],
            row["previous_published_at"],
        )
        for row in rows
    ]
    return DueTake(claimed, bool(rows) and rows[0]["seen"] > len(rows))


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
    "INSERT INTO outbox.relays (name, pid, host, idle) VALUES (:name, :pid, :host, :idle) "
    "ON CONFLICT (name) DO UPDATE SET idle = :idle, heartbeat_at = clock_timestamp()"
)


def announce_relay(executor: Executor, name: str, *, pid: int, host: str, idle: bool) -> None:
    """Record a running relay and whether it sleeps on LISTEN (then enqueue rings the bell).

    An upsert, so it doubles as the heartbeat and survives a peer's clean-up of its row.
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

_LIVE_TAKERS = text(
    "SELECT EXISTS (SELECT FROM outbox.relays WHERE name LIKE 'taker:%' "
    "AND heartbeat_at > clock_timestamp() - make_interval(secs => :fresh))"
)


def live_takers(executor: Executor, *, heartbeat_within_s: float) -> bool:
    """Whether a worker that takes operations directly heartbeat within ``heartbeat_within_s``."""
    row = executor.execute(_LIVE_TAKERS, {"fresh": heartbeat_within_s})
    return bool(row.scalar_one())


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
