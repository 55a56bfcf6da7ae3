"""Databases for the scale benchmark: N terminal operations as the real system leaves them,
plus live rows that are due (or not), loaded with ``INSERT ... SELECT generate_series``.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from uuid import UUID

from report import say
from sqlalchemy import Engine, text
from throwaway import throwaway_database

from outbox.db import create_engine

#: The tool of every live row: registered here with a lookup, so the sweep routes to lookups.
TOOL = "deploy.create_release"
#: How long ago the stale `sent` rows were sent (past the sweep's 60 s timeout, not its hour).
SENT_AGO = "10 minutes"

#: Rows loaded per INSERT statement (a progress line after each).
_CHUNK = 250_000


# --- loading ------------------------------------------------------------------------------

# A UUIDv7 for the row's own creation time, as outbox.uuid_v7() makes for clock_timestamp().
_UUID_V7_AT = (
    "encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) PLACING "
    "substring(int8send(floor(extract(epoch FROM {ts}) * 1000)::bigint) FROM 3) FROM 1 FOR 6), "
    "52, 1), 53, 1), 'hex')::uuid"
)

# N terminal operations, g in [lo, hi] of [1, total], created evenly over the 30 days up to
# an hour ago. r = g % 100: < 85 confirmed, < 90 confirmed by a lookup after an ambiguous
# attempt (checks = 1), < 97 failed, else cancelled while planned (never sent).
_LOAD_TERMINAL = text(
    f"""
    INSERT INTO outbox.operations
        (id, intent_key, tool, target, payload, payload_hash, intent_hash, state, attempts,
         checks, maybe_applied, remote_ref, result, last_error, metadata, requested_by,
         created_at, updated_at, available_at, published_at, first_sent_at, sent_at,
         resolved_at)
    SELECT {_UUID_V7_AT.format(ts="t.created")},
           'conversation-' || (g / 7) || '/step-' || (g % 7) || '/' || g,
           (ARRAY['deploy.create_release', 'billing.charge', 'email.send', 'tickets.open'])
               [1 + g % 4],
           'project-' || (g % 50),
           p.payload,
           encode(sha256(convert_to(p.payload::text, 'UTF8')), 'hex'),
           outbox.intent_hash(
               (ARRAY['deploy.create_release', 'billing.charge', 'email.send', 'tickets.open'])
                   [1 + g % 4],
               'project-' || (g % 50),
               encode(sha256(convert_to(p.payload::text, 'UTF8')), 'hex')),
           k.state, k.attempts, k.checks, k.checks > 0,
           CASE WHEN k.state = 'confirmed' THEN 'rel_' || substr(md5(g::text), 1, 20) END,
           CASE k.state
               WHEN 'confirmed' THEN jsonb_build_object(
                   'id', 'rel_' || substr(md5(g::text), 1, 20), 'status', 'created',
                   'url', 'https://deploy.example/project-' || (g % 50) || '/releases/' || g)
               WHEN 'failed' THEN jsonb_build_object('error', 'version already released')
           END,
           CASE WHEN k.state = 'failed' THEN 'HTTP 422: version already released'
                WHEN k.checks > 0 THEN 'timed out after 10s (the request may have applied)'
           END,
           jsonb_build_object('agent', 'release-bot', 'conversation', g / 7,
                              'model', 'agent-model-2026', 'trace', md5((g * 7)::text)),
           'agent-' || (g % 10),
           t.created, t.created + interval '1.5 seconds', t.created,
           CASE WHEN k.attempts > 0 THEN t.created + interval '5 milliseconds' END,
           CASE WHEN k.attempts > 0 THEN t.created + interval '10 milliseconds' END,
           CASE WHEN k.attempts > 0 THEN t.created + interval '10 milliseconds' END,
           t.created + interval '1.5 seconds'
    FROM generate_series(CAST(:lo AS bigint), CAST(:hi AS bigint)) AS g
    CROSS JOIN LATERAL (
        SELECT now() - interval '30 days'
               + (interval '30 days' - interval '1 hour') * (g::float8 / :total) AS created,
               g % 100 AS r
    ) AS t
    CROSS JOIN LATERAL (
        SELECT CASE WHEN t.r < 90 THEN 'confirmed' WHEN t.r < 97 THEN 'failed'
                    ELSE 'cancelled' END AS state,
               CASE WHEN t.r < 97 THEN 1 ELSE 0 END AS attempts,
               CASE WHEN t.r BETWEEN 85 AND 89 THEN 1 ELSE 0 END AS checks
    ) AS k
    CROSS JOIN LATERAL (
        SELECT jsonb_build_object(
            'version', '2.' || (g % 40) || '.' || g,
            'project', 'project-' || (g % 50),
            'changelog', substr(repeat(md5(g::text) || ' ', 6), 1, 180),
            'approvers', jsonb_build_array('alice', 'bob'),
            'rollout', jsonb_build_object('strategy', 'canary', 'percent', 10 + g % 50)
        ) AS payload
    ) AS p
    """
)

# The audit trail the real components write for each kind of operation (outbox.transitions,
# insert_intent); `keep` selects the events of this operation's path.
_LOAD_EVENTS = text(
    """
    INSERT INTO outbox.events
        (operation_id, from_state, to_state, attempt, actor, reason, detail, at)
    SELECT o.id, e.from_state, e.to_state, e.attempt, e.actor, e.reason, e.detail, e.at
    FROM outbox.operations AS o
    CROSS JOIN LATERAL (VALUES
        (true, NULL, 'planned', 0, 'agent', 'enqueued', NULL::jsonb, o.created_at),
        (o.attempts > 0, 'planned', 'sent', 0 + o.attempts, 'dispatcher',
         'dispatching attempt 1', NULL, o.sent_at),
        (o.state = 'confirmed' AND o.checks = 0, 'sent', 'confirmed', o.attempts, 'dispatcher',
         'applied', jsonb_build_object('remote_ref', o.remote_ref, 'status', 201),
         o.resolved_at),
        (o.checks > 0, 'sent', 'unknown', o.attempts, 'dispatcher',
         'ambiguous: timed out after 10s', NULL, o.sent_at + interval '10 seconds'),
        (o.checks > 0, 'unknown', 'confirmed', o.attempts, 'reconciler',
         'lookup: the effect exists', jsonb_build_object('remote_ref', o.remote_ref),
         o.resolved_at),
        (o.state = 'failed', 'sent', 'failed', o.attempts, 'dispatcher',
         'rejected by the remote: HTTP 422', jsonb_build_object('status', 422), o.resolved_at),
        (o.state = 'cancelled', 'planned', 'cancelled', 0, 'agent', 'cancelled by the agent',
         NULL, o.resolved_at)
    ) AS e(keep, from_state, to_state, attempt, actor, reason, detail, at)
    WHERE e.keep AND o.state IN ('confirmed', 'failed', 'cancelled')
    """
)

# `n` live rows of one kind, created just now, with the payload shape of the terminal ones.
_LOAD_LIVE = text(
    """
    INSERT INTO outbox.operations
        (intent_key, tool, target, payload, payload_hash, intent_hash, state, attempts,
         maybe_applied, created_at, updated_at, available_at, published_at, first_sent_at,
         sent_at, next_check_at)
    SELECT 'live-' || :kind || '-' || g, :tool, 'project-' || (g % 50), p.payload,
           encode(sha256(convert_to(p.payload::text, 'UTF8')), 'hex'),
           outbox.intent_hash(:tool, 'project-' || (g % 50),
                              encode(sha256(convert_to(p.payload::text, 'UTF8')), 'hex')),
           :kind, CASE WHEN :kind = 'planned' THEN 0 ELSE 1 END, :kind = 'unknown',
           t.at, t.at, t.at,
           CASE WHEN :kind = 'planned' THEN NULL ELSE t.at END,
           CASE WHEN :kind = 'planned' THEN NULL ELSE t.at END,
           CASE WHEN :kind = 'planned' THEN NULL ELSE t.at END,
           CASE WHEN :kind = 'unknown' THEN now() - interval '1 minute' END
    FROM generate_series(1, :n) AS g
    CROSS JOIN LATERAL (
        SELECT CASE WHEN :kind = 'planned' THEN now() - interval '1 minute'
                    ELSE now() - CAST(:sent_ago AS interval) END AS at
    ) AS t
    CROSS JOIN LATERAL (
        SELECT jsonb_build_object('version', '3.0.' || g, 'project', 'project-' || (g % 50),
                                  'changelog', substr(repeat(md5(g::text) || ' ', 6), 1, 180))
               AS payload
    ) AS p
    RETURNING id
    """
)

_LOAD_LIVE_EVENTS = text(
    """
    INSERT INTO outbox.events (operation_id, from_state, to_state, attempt, actor, reason, at)
    SELECT o.id, e.from_state, e.to_state, e.attempt, e.actor, e.reason, e.at
    FROM outbox.operations AS o
    CROSS JOIN LATERAL (VALUES
        (true, NULL, 'planned', 0, 'agent', 'enqueued', o.created_at),
        (o.attempts > 0, 'planned', 'sent', 1, 'dispatcher', 'dispatching attempt 1', o.sent_at),
        (o.state = 'unknown', 'sent', 'unknown', 1, 'dispatcher',
         'ambiguous: timed out after 10s', o.sent_at + interval '10 seconds')
    ) AS e(keep, from_state, to_state, attempt, actor, reason, at)
    WHERE e.keep AND o.id = ANY(:ids)
    """
)

# `n` live rows of one kind that are not due (--not-due): `planned` backing off after an
# undelivered attempt, `sent` in flight right now, `unknown` checked again later. A live system
# always has some; the relay's claim and the sweep must not pay for them.
_LOAD_WAITING = text(
    """
    INSERT INTO outbox.operations
        (intent_key, tool, target, payload, payload_hash, intent_hash, state, attempts,
         maybe_applied, created_at, updated_at, available_at, published_at, first_sent_at,
         sent_at, next_check_at)
    SELECT 'waiting-' || :kind || '-' || g, :tool, 'project-' || (g % 50), p.payload,
           encode(sha256(convert_to(p.payload::text, 'UTF8')), 'hex'),
           outbox.intent_hash(:tool, 'project-' || (g % 50),
                              encode(sha256(convert_to(p.payload::text, 'UTF8')), 'hex')),
           :kind, 1, :kind = 'unknown',
           now() - interval '10 minutes', now(),
           CASE WHEN :kind = 'planned' THEN now() + interval '10 minutes'
                ELSE now() - interval '10 minutes' END,
           now() - interval '10 minutes',
           now() - interval '10 minutes',
           CASE WHEN :kind = 'sent' THEN now() ELSE now() - interval '10 minutes' END,
           CASE WHEN :kind = 'unknown' THEN now() + interval '10 minutes' END
    FROM generate_series(1, :n) AS g
    CROSS JOIN LATERAL (
        SELECT jsonb_build_object('version', '5.0.' || g, 'project', 'project-' || (g % 50),
                                  'changelog', substr(repeat(md5(g::text) || ' ', 6), 1, 180))
               AS payload
    ) AS p
    RETURNING id
    """
)


@dataclass
class Loaded:
    """A loaded database: its engine and the ids of its live rows by kind."""

    size: int
    url: str
    engine: Engine
    planned: list[UUID]
    sent: list[UUID]
    unknown: list[UUID]
    waiting: list[UUID]
    load_s: float
    table_mb: float


def load_terminal(engine: Engine, total: int, *, label: str) -> None:
    """``total`` terminal operations and their events, in chunks; then VACUUM ANALYZE."""
    for lo in range(1, total + 1, _CHUNK):
        hi = min(lo + _CHUNK - 1, total)
        with engine.begin() as conn:
            conn.execute(text("SET LOCAL synchronous_commit = off"))
            conn.execute(_LOAD_TERMINAL, {"lo": lo, "hi": hi, "total": total})
        say(f"{label}: {hi:,} of {total:,} terminal operations")
    with engine.begin() as conn:
        conn.execute(text("SET LOCAL synchronous_commit = off"))
        conn.execute(_LOAD_EVENTS)
    say(f"{label}: events written")


def load_live(engine: Engine, kind: str, n: int) -> list[UUID]:
    """``n`` live rows of ``kind`` (planned, sent or unknown) with their events."""
    with engine.begin() as conn:
        ids = [
            row.id
            for row in conn.execute(
                _LOAD_LIVE, {"kind": kind, "tool": TOOL, "n": n, "sent_ago": SENT_AGO}
            )
        ]
        conn.execute(_LOAD_LIVE_EVENTS, {"ids": ids})
    return ids


def load_waiting(engine: Engine, n: int) -> list[UUID]:
    """``n`` live rows of each kind that are not due (``--not-due``)."""
    if n <= 0:
        return []
    ids: list[UUID] = []
    with engine.begin() as conn:
        for kind in ("planned", "sent", "unknown"):
            rows = conn.execute(_LOAD_WAITING, {"kind": kind, "tool": TOOL, "n": n})
            ids += [row.id for row in rows]
    return ids


def vacuum(engine: Engine, *tables: str, analyze: bool = False) -> None:
    """``VACUUM [ANALYZE]`` of ``tables`` (outside a transaction)."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        option = "(ANALYZE, INDEX_CLEANUP ON)" if analyze else "(INDEX_CLEANUP ON)"
        conn.execute(text(f"VACUUM {option} {', '.join(tables)}"))


def checkpoint(engine: Engine) -> None:
    """Write the load's dirty pages now, not during the measurements (needs a superuser;
    skipped otherwise)."""
    with (
        engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn,
        contextlib.suppress(Exception),
    ):
        conn.execute(text("CHECKPOINT"))


def table_mb(engine: Engine) -> float:
    """``operations`` + ``events`` with their indexes and TOAST, in MB."""
    with engine.connect() as conn:
        size = conn.execute(
            text(
                "SELECT pg_total_relation_size('outbox.operations') "
                "+ pg_total_relation_size('outbox.events')"
            )
        ).scalar_one()
    return float(size) / 2**20


@contextlib.contextmanager
def loaded_database(admin_url: str, size: int, due: int, waiting: int) -> Iterator[Loaded]:
    """A throw-away database with ``size`` terminal rows, ``due`` live rows of each kind that
    are due and ``waiting`` of each kind that are not."""
    with throwaway_database(admin_url) as url:
        engine = create_engine(url, pool_size=4, max_overflow=4)
        try:
            label = size_label(size)
            started = time.perf_counter()
            load_terminal(engine, size, label=label)
            planned = load_live(engine, "planned", due)
            sent = load_live(engine, "sent", due)
            unknown = load_live(engine, "unknown", due)
            not_due = load_waiting(engine, waiting)
            vacuum(engine, "outbox.operations", "outbox.events", analyze=True)
            checkpoint(engine)
            elapsed = time.perf_counter() - started
            loaded = Loaded(
                size, url, engine, planned, sent, unknown, not_due, elapsed, table_mb(engine)
            )
            say(f"{label}: loaded in {elapsed:.0f} s, {loaded.table_mb:,.0f} MB")
            yield loaded
        finally:
            engine.dispose()


def size_label(n: int) -> str:
    """``10^6`` for powers of ten, else the number."""
    exponent = round(math.log10(n)) if n > 0 else 0
    return f"10^{exponent}" if n == 10**exponent else f"{n:,}"
