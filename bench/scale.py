"""Sweep and relay-claim cost against the size of the table, and a soak while autovacuum works.

The question: does the work of the relay's claim and of the reconciler's sweep follow the rows
that are *due*, or the size of ``outbox.operations``? Finished operations pile up (retention
keeps them 30 days or more), so a claim or a sweep that reads terminal rows gets slower every
day. Target: at 10^6 terminal rows, at most 2x the cost at 10^4.

**Sizes** (``--sizes 1e4,1e5,1e6``): one throw-away database per size (``bench_<hex>``,
migrated to the latest revision), loaded with ``INSERT ... SELECT generate_series`` with N
terminal operations as the real system leaves them: 85 % confirmed at the first attempt, 5 %
confirmed by a lookup after an ambiguous attempt, 7 % failed (refused by the remote), 3 %
cancelled; payloads of about 300 bytes, results, metadata, UUIDv7 ids and timestamps spread
over 30 days, and their ``outbox.events`` rows (2 to 4 per operation: enqueued, dispatching,
the outcome). Then ``--due`` (100) rows of each live kind: ``planned`` and due (for the relay),
``sent`` ten minutes ago with a free lock (a lost dispatcher, for the sweep) and ``unknown``
with a due check (for the sweep), with their events. Then ``VACUUM ANALYZE`` and a
``CHECKPOINT``, as a database that has lived for a while would be.

Then, per round, each size in turn (the first size rotating from round to round), the real
code paths, on the database, with nothing mocked but the broker:

* ``claim_due``: :func:`outbox.statements.claim_due` (the statement ``Relay.run_once`` calls),
  each call in its own transaction, rolled back; the round's value is the median of
  ``--claims`` calls. Every call must return the ``--due`` planned rows;
* ``relay pass``: :meth:`outbox.relay.Relay.run_once` with a publisher that confirms nothing
  (so nothing is recorded and the rows stay due): pool checkout with pre-ping, BEGIN, the
  claim, COMMIT. Median of ``--passes``;
* ``sweep``: :meth:`outbox.reconcilers.sweep.Sweeper.run_once`, once, with a registry whose tool has
  a lookup and a ``request_lookup`` that only counts (instead of Celery's ``apply_async``).
  It finds the stale ``sent`` rows, probes each one's advisory lock, moves them to
  ``unknown`` ("dispatcher lost", committed, with their events), then routes every due
  ``unknown`` row (the original ones and those it just moved) under its lock to a lookup
  (``schedule_check`` with the lease). It must report ``due`` lost and ``2 x due`` lookups;
* ``idle sweep``: ``run_once`` again at once, when nothing is due (the two scans only).

After each round the sweep's rows are put back (one UPDATE, not timed) and
``VACUUM outbox.operations`` runs, so every round starts from the same state. The ratios
(``claim 10^6 / 10^4`` ...) are taken round by round, then their median.

``--not-due N`` adds N live rows of each kind that are *not* due (``planned`` backing off,
``sent`` in flight, ``unknown`` checked later; kept so every round): a live system always has
some, and the claim and the sweep should not pay for them either.

``EXPLAIN (ANALYZE, BUFFERS)`` of every distinct statement the relay pass and the sweep sent
to the server that reads an outbox table (captured from the engine during the first round,
replayed with their own parameters in a rolled-back transaction; plus the relay's idle check
and ``mark_published``): the scans with their index, ``(bounded)`` when an Index Cond limits
the index scan and ``(unbounded)`` when the index only orders it (then every row up to the
LIMIT is read and filtered), the rows returned, the rows filtered out, shared buffers hit/read
and the execution time; a sequential scan of ``operations`` or ``events`` is flagged.

**Soak** (``--soak-minutes``, default 15; 0 skips it): a database with ``--soak-rows`` terminal
rows (default the largest size), then ``--soak-rate`` intents per second for the given time:

* agents: ``outbox.enqueue`` + COMMIT, one intent per transaction, on ``--soak-agents``
  threads paced on a fixed schedule (a late agent catches up, it does not skip);
* the relay: the real :class:`~outbox.relay.Relay`, ``run_forever`` (LISTEN/NOTIFY, idle
  flag, claims of up to 200 rows), with a publisher that hands the messages to an in-process
  queue and confirms them all; the claim statement is timed at the driver (cursor execute);
* dispatch: ``--soak-workers`` threads simulate the workers' *state moves* with the real
  functions (:func:`outbox.statements.get_for_dispatch`, then
  :func:`outbox.states.transition` ``planned -> sent`` with ``synchronous_commit = on``,
  then ``sent -> confirmed``, or ``failed`` for 5 %, each committed): the same row versions
  and events as ``outbox.workers.dispatch.dispatch``, without Celery, the advisory lock and a tool
  call. 1 % are left in ``sent`` (a dispatcher that died);
* the sweep: the real :class:`~outbox.reconcilers.sweep.Sweeper` every 5 s (``sent`` timeout 5 s),
  its lookups answered by a thread that confirms the row (``unknown -> confirmed``).

Per ``--soak-window`` seconds (30): claims and their latency p50/p99/max, EXPLAIN (ANALYZE,
BUFFERS) of the relay's last claim at the window's end (buffers and ms at the server: a
measure the machine's other load does not blur), relay passes, sweeps, throughput, the live
backlog and, of it, the ``planned`` rows already published and waiting for a worker (the claim
reads past them), from ``pg_stat_user_tables`` ``n_dead_tup``, the autovacuum count and the
time since ``last_autovacuum`` of ``operations`` and ``events``, any vacuum running now, the
size of the relay's partial index and the machine's CPU use. Ratios: the last window's claim
p50 and p99 over the first's, and the worst window's over the first's. The soak is only
meaningful while the pipeline keeps up with ``--soak-rate``: a growing "pub wait" means it
does not, and the claim then measures that backlog, not the table.

Autovacuum must run for the soak to mean anything, and the CI server here has
``autovacuum = off``; so, unless ``--soak-url`` names a server, the soak starts a PostgreSQL
of its own (:class:`outbox.dev.clusters.LocalCluster`: the wheel's binaries, the default
configuration, ``autovacuum = on``, fsync and synchronous_commit on, every autovacuum logged)
and removes it at the end. The server's autovacuum settings, the tables' storage options and
every autovacuum of an outbox table during the soak (from the server's log: whether its index
pass ran or was bypassed, dead tuples removed, elapsed) are printed with it.
``--soak-pause S`` stops the simulated workers for S seconds from ``--soak-pause-at`` minutes
(an outage of the workers): the relay keeps publishing (and republishing), a backlog builds,
then drains; the windows after it show how long the claim pays for it.
``--soak-storage defaults`` RESETs the tables' storage options (those of migration 0006)
before the soak, to compare with PostgreSQL's defaults; ``--skip-sizes`` runs the soak alone.

``--smoke``: sizes 1e3 and 1e4, 20 due rows of each kind, 3 rounds, a 20-second soak on 10^4
rows in 5-second windows.

Usage: python bench/scale.py [--sizes 1e4,1e5,1e6] [--rounds 10] [--soak-minutes 15] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import queue
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

# The bench directory is not a package: `python bench/scale.py` puts it on sys.path.
from common import (
    Results,
    add_common_arguments,
    console,
    machine_busy_s,
    percentile,
    print_table,
    say,
    throwaway_database,
    write_json,
)
from rich import box
from rich.console import Console
from rich.table import Table
from sqlalchemy import Connection, Engine, event, text
from sqlalchemy.engine.interfaces import DBAPICursor
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from outbox import api, statements
from outbox.contracts import ContractTable
from outbox.db import create_engine
from outbox.errors import StaleTransition
from outbox.reconcilers.sweep import SweepConfig, Sweeper
from outbox.relay import OutboundMessage, Relay, RelayConfig, RelayResult
from outbox.states import Actor, Effects, State, transition
from outbox.tools import Applied, DispatchResult, LookupResult, ToolCall, ToolRegistry, tool

MS = "ms"
#: The tool of every live row: registered here with a lookup, so the sweep routes to lookups.
TOOL = "deploy.create_release"
#: The relay's batch (RelayConfig's default) and republish delay (OUTBOX_REPUBLISH_AFTER's).
BATCH = 200
REPUBLISH_AFTER_S = 30.0
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

# The audit trail the real components write for each kind of operation (statements.move,
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
# Keep them not due for the next round.
_REFRESH_WAITING = text(
    """
    UPDATE outbox.operations
    SET available_at = CASE WHEN state = 'planned' THEN now() + interval '10 minutes'
                            ELSE available_at END,
        sent_at = CASE WHEN state = 'sent' THEN now() ELSE sent_at END,
        next_check_at = CASE WHEN state = 'unknown' THEN now() + interval '10 minutes' END
    WHERE id = ANY(:ids)
    """
)

# Put the sweep's rows back where they were before it (not timed): the lost ones `sent` ten
# minutes ago with a free lock, the routed ones `unknown` with a due check.
_RESET_SENT = text(
    """
    UPDATE outbox.operations
    SET state = 'sent', next_check_at = NULL, maybe_applied = false, checks = 0,
        sent_at = now() - CAST(:sent_ago AS interval),
        first_sent_at = now() - CAST(:sent_ago AS interval), updated_at = now()
    WHERE id = ANY(:ids)
    """
)
_RESET_UNKNOWN = text(
    "UPDATE outbox.operations SET next_check_at = now() - interval '1 minute', checks = 0 "
    "WHERE id = ANY(:ids)"
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


# --- the code paths -------------------------------------------------------------------------


class NullPublisher:
    """A publisher that confirms nothing: the relay records nothing, the rows stay due."""

    def publish(self, messages: Sequence[OutboundMessage]) -> set[UUID]:
        """Confirm none of ``messages``."""
        del messages
        return set()

    def close(self) -> None:
        """Nothing to release."""


def lookup_registry() -> ToolRegistry:
    """A registry (with its own contract table) whose one tool, :data:`TOOL`, has a lookup:
    the decision table routes its `unknown` rows to lookups."""
    registry = ToolRegistry(contracts=ContractTable())

    @tool(TOOL, registry=registry)
    def create_release(call: ToolCall) -> DispatchResult:
        return Applied(remote_ref=f"rel-{call.operation_id}")

    @create_release.lookup
    def find_release(call: ToolCall) -> LookupResult:
        return Applied(remote_ref=f"rel-{call.operation_id}")

    del find_release
    return registry


@dataclass
class Scale:
    """The measurements of one loaded database."""

    db: Loaded
    due: int
    registry: ToolRegistry
    lookups: list[UUID] = field(default_factory=list)

    def sweeper(self) -> Sweeper:
        """A sweeper as beat runs it (batch 500), lookups only counted. Its `sent` timeout
        is 5 minutes, not 60 s, so that the in-flight rows of ``--not-due`` (refreshed once
        a round) stay in flight however long a round takes; the stale rows are 10 minutes
        old either way."""
        return Sweeper(
            self.db.engine,
            registry=self.registry,
            config=SweepConfig(sent_timeout_s=300.0),
            request_lookup=self.lookups.append,
        )

    def claim(self, calls: int) -> float:
        """Median ms of ``claim_due`` (each in a rolled-back transaction)."""
        times = []
        with self.db.engine.connect() as conn:
            for _ in range(calls):
                with conn.begin() as tx:
                    started = time.perf_counter()
                    claimed = statements.claim_due(
                        conn, limit=BATCH, republish_after_s=REPUBLISH_AFTER_S
                    )
                    times.append(time.perf_counter() - started)
                    tx.rollback()
                if len(claimed) != self.due:
                    raise RuntimeError(f"claim_due returned {len(claimed)} rows, not {self.due}")
        return 1000 * statistics.median(times)

    def relay_pass(self, passes: int) -> float:
        """Median ms of ``Relay.run_once`` with a publisher that confirms nothing."""
        relay = Relay(self.db.engine, NullPublisher(), RelayConfig(batch_size=BATCH))
        times = []
        for _ in range(passes):
            started = time.perf_counter()
            result = relay.run_once()
            times.append(time.perf_counter() - started)
            if result.claimed != self.due or result.published:
                raise RuntimeError(f"a relay pass did {result}, not {self.due} claimed")
        return 1000 * statistics.median(times)

    def sweep(self) -> float:
        """ms of one ``Sweeper.run_once`` over the due `sent` and `unknown` rows."""
        self.lookups.clear()
        sweeper = self.sweeper()
        started = time.perf_counter()
        result = sweeper.run_once()
        elapsed = time.perf_counter() - started
        expected = (self.due, 2 * self.due)
        if (result.lost, result.lookups) != expected or len(self.lookups) != 2 * self.due:
            raise RuntimeError(f"the sweep did {result}, not lost/lookups {expected}")
        return 1000 * elapsed

    def idle_sweep(self, runs: int) -> float:
        """Median ms of ``Sweeper.run_once`` with nothing due (right after :meth:`sweep`)."""
        sweeper = self.sweeper()
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            result = sweeper.run_once()
            times.append(time.perf_counter() - started)
            if any(vars(result).values()):
                raise RuntimeError(f"an idle sweep did {result}")
        return 1000 * statistics.median(times)

    def relay_extras(self) -> None:
        """The relay's other two statements, rolled back, so that EXPLAIN sees them: its
        idle check and recording the published rows (a pass that confirms nothing skips it)."""
        with self.db.engine.connect() as conn, conn.begin() as tx:
            statements.any_due_unpublished(conn)
            statements.mark_published(conn, self.db.planned)
            tx.rollback()

    def reset(self) -> None:
        """Put the sweep's rows back, then VACUUM (not timed)."""
        with self.db.engine.begin() as conn:
            conn.execute(_RESET_SENT, {"ids": self.db.sent, "sent_ago": SENT_AGO})
            conn.execute(_RESET_UNKNOWN, {"ids": self.db.unknown})
            if self.db.waiting:
                conn.execute(_REFRESH_WAITING, {"ids": self.db.waiting})
        vacuum(self.db.engine, "outbox.operations")


# --- EXPLAIN --------------------------------------------------------------------------------


@dataclass
class Captured:
    """Distinct statements an engine sent, each with the parameters it was first sent with."""

    statements: dict[str, Any] = field(default_factory=dict)

    def __call__(
        self, conn: Connection, cursor: DBAPICursor, statement: str, parameters: Any, *_: Any
    ) -> None:
        """A ``before_cursor_execute`` listener."""
        del conn, cursor
        if "outbox." in statement and not _explain_skips(statement):
            self.statements.setdefault(statement, parameters)


def _explain_skips(statement: str) -> bool:
    """Statements not worth an EXPLAIN: locks, the relays' bookkeeping, utility commands."""
    lowered = " ".join(statement.lower().split())
    utility = lowered.startswith(("set ", "listen", "unlisten", "begin", "commit", "rollback"))
    return utility or any(word in lowered for word in ("advisory", "pg_locks", "outbox.relays"))


@contextlib.contextmanager
def capture(engine: Engine) -> Iterator[Captured]:
    """Record the statements sent through ``engine`` while the block runs."""
    captured = Captured()
    event.listen(engine, "before_cursor_execute", captured)
    try:
        yield captured
    finally:
        event.remove(engine, "before_cursor_execute", captured)


def statement_name(sql: str) -> str:
    """A short, recognisable name for one of our statements."""
    flat = " ".join(sql.split())
    known = [
        ("SKIP LOCKED", "claim_due"),
        ("state = 'sent' AND sent_at", "stale_sent"),
        ("state = 'unknown' AND next_check_at", "due_unknown"),
        ("horizon_passed", "reconcile_facts"),
        ("SET next_check_at", "schedule_check"),
        ("AND published_at IS NULL", "any_due_unpublished"),
        ("SET published_at", "mark_published"),
        ("moved", "move (transition)"),
        ("AS due", "get_for_dispatch"),
        ("INSERT INTO outbox.webhook", "webhook record"),
    ]
    for needle, name in known:
        if needle in flat:
            return name
    if "FROM outbox.operations" in flat and "WHERE outbox.operations.id" in flat:
        return "get_operation"
    return flat[:48]


@dataclass(frozen=True)
class Plan:
    """The summary of one EXPLAIN (ANALYZE, BUFFERS)."""

    name: str
    scans: list[str]
    rows: int
    #: Rows the scans read and threw away (``Rows Removed by Filter``, summed).
    filtered: int
    hit: int
    read: int
    ms: float

    @property
    def seq_scan(self) -> bool:
        """Whether it reads ``operations`` or ``events`` sequentially."""
        return any(
            s.startswith("Seq Scan") and ("operations" in s or "events" in s) for s in self.scans
        )


def _scans(node: Mapping[str, Any], out: list[str]) -> int:
    """Append the scans under ``node`` to ``out``; the rows its filters removed.

    An index scan is marked ``(bounded)`` when an Index Cond bounds it, ``(unbounded)`` when
    the index only orders it: then it reads and filters every row until the LIMIT is full."""
    kind = node["Node Type"]
    if kind == "ModifyTable":
        out.append(f"{node.get('Operation', 'Modify')} {node.get('Relation Name', '?')}")
    elif "Index Name" in node:
        bound = "bounded" if "Index Cond" in node else "unbounded"
        out.append(f"{kind} {node['Index Name']} ({bound})")
    elif "Relation Name" in node:
        out.append(f"{kind} {node['Relation Name']}")
    removed = int(node.get("Rows Removed by Filter", 0))
    for child in node.get("Plans", []):
        removed += _scans(child, out)
    return removed


def explain(engine: Engine, captured: Captured) -> list[Plan]:
    """EXPLAIN (ANALYZE, BUFFERS) of each captured statement, each rolled back."""
    plans = []
    raw = engine.raw_connection()
    try:
        for sql, parameters in captured.statements.items():
            cursor = raw.cursor()
            try:
                cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", parameters)
                row = cursor.fetchone()
            finally:
                cursor.close()
                raw.rollback()
            if row is None:
                continue
            document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
            top = document[0]
            plan = top["Plan"]
            scans: list[str] = []
            filtered = _scans(plan, scans)
            plans.append(
                Plan(
                    name=statement_name(sql),
                    scans=scans,
                    rows=int(plan.get("Actual Rows", 0)),
                    filtered=filtered,
                    hit=int(plan.get("Shared Hit Blocks", 0)),
                    read=int(plan.get("Shared Read Blocks", 0)),
                    ms=float(top.get("Execution Time", math.nan)),
                )
            )
    finally:
        raw.close()
    return plans


def print_plans(plans: Mapping[int, list[Plan]]) -> None:
    """One table: per statement, per size, the plan's scans and buffers."""
    table = Table(title="EXPLAIN (ANALYZE, BUFFERS) of what the relay pass and the sweep sent")
    numbers = ("rows", "filtered", "hit", "read", "ms")
    for column in ("statement", "terminal rows", "scans", *numbers):
        table.add_column(column, justify="right" if column in numbers else "left")
    names: list[str] = []
    for size_plans in plans.values():
        for plan in size_plans:
            if plan.name not in names:
                names.append(plan.name)
    for name in names:
        for size, size_plans in plans.items():
            for plan in (p for p in size_plans if p.name == name):
                scans = ", ".join(plan.scans) + ("  (SEQ SCAN)" if plan.seq_scan else "")
                table.add_row(
                    name,
                    size_label(size),
                    scans,
                    str(plan.rows),
                    str(plan.filtered),
                    str(plan.hit),
                    str(plan.read),
                    f"{plan.ms:.3f}",
                )
        table.add_section()
    console().print(table)


# --- the size comparison --------------------------------------------------------------------

CLAIM = "claim_due, {due} due (median of {n} calls, rolled back)"
RELAY = "Relay.run_once, {due} due, publisher confirms none (median of {n})"
SWEEP = "Sweeper.run_once: {due} stale sent + {due} due unknown -> {due2} lookups"
IDLE = "Sweeper.run_once, nothing due (median of {n})"


def size_ratios(args: argparse.Namespace, results: Results, sections: Mapping[str, str]) -> None:
    """Ratio rows: every larger size over the smallest, per measurement; the verdict."""
    small, big = min(args.sizes), max(args.sizes)
    shorts = {"claim": "claim", "relay": "relay pass", "sweep": "sweep", "idle": "idle sweep"}
    for kind, short in shorts.items():
        for size in sorted(args.sizes)[1:]:
            results.ratio(
                f"{short} {size_label(size)} / {size_label(small)}",
                (sections[kind], f"{size_label(size)} terminal rows"),
                (sections[kind], f"{size_label(small)} terminal rows"),
            )
    for short in ("claim", "sweep"):
        ratio = f"{short} {size_label(big)} / {size_label(small)}"
        results.target(f"{ratio} <= {args.target:g}x", ("ratios", ratio), at_most=args.target)


def measure_sizes(args: argparse.Namespace, results: Results) -> dict[int, list[Plan]]:
    """Load every size, then run the rounds; the EXPLAIN summaries by size."""
    due = args.due
    sections = {
        "claim": CLAIM.format(due=due, n=args.claims),
        "relay": RELAY.format(due=due, n=args.passes),
        "sweep": SWEEP.format(due=due, due2=2 * due),
        "idle": IDLE.format(due=due, n=args.idle_runs),
    }
    registry = lookup_registry()
    plans: dict[int, list[Plan]] = {}
    with contextlib.ExitStack() as stack:
        scales = []
        for size in args.sizes:
            db = stack.enter_context(loaded_database(args.url, size, due, args.not_due))
            results.note(
                f"{size_label(size)}: {size:,} terminal operations (+ {3 * due} live and due, "
                f"{3 * args.not_due} live not due), "
                f"operations + events {db.table_mb:,.0f} MB with indexes, loaded in "
                f"{db.load_s:.0f} s"
            )
            scales.append(Scale(db, due, registry))
        for r in range(args.rounds):
            start = r % len(scales)
            measured: dict[tuple[str, int], float] = {}
            for scale in [*scales[start:], *scales[:start]]:
                size = scale.db.size
                say(f"round {r + 1}/{args.rounds}: {size_label(size)}")
                with contextlib.ExitStack() as watch:
                    captured = watch.enter_context(capture(scale.db.engine)) if r == 0 else None
                    measured["claim", size] = scale.claim(args.claims)
                    measured["relay", size] = scale.relay_pass(args.passes)
                    measured["sweep", size] = scale.sweep()
                    measured["idle", size] = scale.idle_sweep(args.idle_runs)
                    if captured is not None:
                        scale.relay_extras()
                scale.reset()
                if captured is not None:
                    plans[size] = explain(scale.db.engine, captured)
                    vacuum(scale.db.engine, "outbox.operations")
            for kind, section in sections.items():
                for scale in scales:
                    size = scale.db.size
                    results.add(
                        f"{size_label(size)} terminal rows",
                        measured[kind, size],
                        unit=MS,
                        section=section,
                    )
    size_ratios(args, results, sections)
    return plans


# --- the soak -------------------------------------------------------------------------------


@dataclass
class Window:
    """What happened in one window of the soak."""

    claims: list[float] = field(default_factory=list)
    passes: list[float] = field(default_factory=list)
    sweeps: list[float] = field(default_factory=list)
    enqueued: int = 0
    done: int = 0


class Recorder:
    """Thread-safe per-window collection; :meth:`cut` starts a new window."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._window = Window()
        #: The relay's claim as it last ran: (SQL, parameters), for EXPLAIN.
        self.claim_statement: tuple[str, Any] | None = None

    def claim(self, seconds: float) -> None:
        """One claim statement's latency."""
        with self._lock:
            self._window.claims.append(seconds)

    def relay_pass(self, seconds: float) -> None:
        """One ``Relay.run_once``."""
        with self._lock:
            self._window.passes.append(seconds)

    def sweep(self, seconds: float) -> None:
        """One ``Sweeper.run_once``."""
        with self._lock:
            self._window.sweeps.append(seconds)

    def enqueued(self) -> None:
        """One intent committed."""
        with self._lock:
            self._window.enqueued += 1

    def done(self) -> None:
        """One operation terminal."""
        with self._lock:
            self._window.done += 1

    def cut(self) -> Window:
        """The window so far; a new one begins."""
        with self._lock:
            window, self._window = self._window, Window()
        return window


class QueuePublisher:
    """Hands every message to the simulated workers' queue and confirms it."""

    def __init__(self, inbox: queue.Queue[OutboundMessage]) -> None:
        self.inbox = inbox

    def publish(self, messages: Sequence[OutboundMessage]) -> set[UUID]:
        """Queue and confirm all of ``messages``."""
        for message in messages:
            self.inbox.put(message)
        return {m.operation_id for m in messages}

    def close(self) -> None:
        """Nothing to release."""


class TimedRelay(Relay):
    """The real relay; each ``run_once`` timed."""

    recorder: Recorder

    def run_once(self) -> RelayResult:
        """``Relay.run_once``, timed."""
        started = time.perf_counter()
        result = super().run_once()
        if result.claimed:
            self.recorder.relay_pass(time.perf_counter() - started)
        return result


def time_claims(engine: Engine, recorder: Recorder) -> None:
    """Time every execution of the claim statement on ``engine`` (at the driver); keep the
    last one's SQL and parameters in ``recorder.claim_statement``."""

    def before(conn: Connection, *_: Any) -> None:
        conn.info["bench_started"] = time.perf_counter()

    def after(conn: Connection, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        started = conn.info.pop("bench_started", None)
        if started is not None and "SKIP LOCKED" in statement:
            recorder.claim(time.perf_counter() - started)
            recorder.claim_statement = (statement, parameters)

    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "after_cursor_execute", after)


_STATS = text(
    """
    SELECT relname, n_live_tup, n_dead_tup, autovacuum_count, autoanalyze_count,
           extract(epoch FROM clock_timestamp() - last_autovacuum) AS since_autovacuum
    FROM pg_stat_user_tables
    WHERE schemaname = 'outbox' AND relname IN ('operations', 'events')
    """
)
_BACKLOG = text(
    "SELECT (SELECT count(*) FROM outbox.operations WHERE state = 'planned') AS planned, "
    "(SELECT count(*) FROM outbox.operations WHERE state = 'sent') AS sent, "
    "(SELECT count(*) FROM outbox.operations WHERE state = 'unknown') AS unknown, "
    "(SELECT count(*) FROM outbox.operations WHERE state = 'planned' "
    "AND published_at IS NOT NULL) AS published"
)
_VACUUMING = text(
    "SELECT string_agg(left(c.relname, 3) || ': ' || p.phase, ', ') "
    "FROM pg_stat_progress_vacuum p "
    "JOIN pg_class c ON c.oid = p.relid WHERE p.datname = current_database()"
)
_INDEX_KB = text("SELECT pg_relation_size('outbox.ix_operations_planned_due') / 1024")


def sample(engine: Engine) -> dict[str, Any]:
    """The tables' statistics, the backlog and any vacuum running, now."""
    with engine.connect() as conn:
        stats = {row.relname: row for row in conn.execute(_STATS)}
        backlog = conn.execute(_BACKLOG).one()
        vacuuming = conn.execute(_VACUUMING).scalar_one()
        index_kb = conn.execute(_INDEX_KB).scalar_one()
    ops, evs = stats["operations"], stats["events"]
    return {
        "live": int(backlog.planned + backlog.sent + backlog.unknown),
        "published": int(backlog.published),
        "ops_dead": int(ops.n_dead_tup),
        "ops_av": int(ops.autovacuum_count),
        "ops_since_av": ops.since_autovacuum,
        "ev_dead": int(evs.n_dead_tup),
        "ev_av": int(evs.autovacuum_count),
        "vacuuming": vacuuming or "",
        "index_kb": int(index_kb),
    }


def reset_storage(engine: Engine) -> None:
    """Back to PostgreSQL's defaults: RESET every storage option of the outbox tables."""
    with engine.begin() as conn:
        rows = conn.execute(
            text(
                "SELECT relname, reloptions FROM pg_class "
                "WHERE relnamespace = 'outbox'::regnamespace AND relkind = 'r' "
                "AND reloptions IS NOT NULL"
            )
        ).all()
        for row in rows:
            names = ", ".join(option.split("=", 1)[0] for option in row.reloptions)
            conn.execute(text(f"ALTER TABLE outbox.{row.relname} RESET ({names})"))


def explain_claim(engine: Engine, claim: tuple[str, Any] | None) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of the relay's claim as it last ran, rolled back: the
    buffers it touched and its execution time (noise-free, unlike a latency)."""
    if claim is None:
        return {"claim_buffers": math.nan, "claim_exec_ms": math.nan}
    sql, parameters = claim
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", parameters)
        row = cursor.fetchone()
        cursor.close()
        raw.rollback()
    finally:
        raw.close()
    if row is None:
        return {"claim_buffers": math.nan, "claim_exec_ms": math.nan}
    document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    plan = document[0]["Plan"]
    return {
        "claim_buffers": int(plan.get("Shared Hit Blocks", 0))
        + int(plan.get("Shared Read Blocks", 0)),
        "claim_exec_ms": float(document[0].get("Execution Time", math.nan)),
    }


_SERVER_SETTINGS = (
    "server_version",
    "autovacuum",
    "autovacuum_naptime",
    "autovacuum_vacuum_threshold",
    "autovacuum_vacuum_scale_factor",
    "autovacuum_vacuum_insert_threshold",
    "autovacuum_vacuum_insert_scale_factor",
    "autovacuum_analyze_scale_factor",
    "autovacuum_vacuum_cost_limit",
    "autovacuum_vacuum_cost_delay",
    "shared_buffers",
)


def storage_settings(engine: Engine) -> list[str]:
    """The server's autovacuum settings and the outbox tables' storage options, as lines."""
    with engine.connect() as conn:
        values = {
            row.name: f"{row.setting}{row.unit or ''}"
            for row in conn.execute(
                text("SELECT name, setting, unit FROM pg_settings WHERE name = ANY(:names)"),
                {"names": list(_SERVER_SETTINGS)},
            )
        }
        options = conn.execute(
            text(
                "SELECT relname, reloptions FROM pg_class "
                "WHERE relnamespace = 'outbox'::regnamespace "
                "AND relname IN ('operations', 'events') "
                "ORDER BY relname"
            )
        ).all()
    server = ", ".join(f"{name}={values[name]}" for name in _SERVER_SETTINGS if name in values)
    tables = "; ".join(
        f"outbox.{row.relname}: {', '.join(row.reloptions) if row.reloptions else 'defaults'}"
        for row in options
    )
    return [f"Soak server: {server}", f"Table storage options: {tables}"]


class Soak:
    """The pipeline of the soak: agents, the relay, simulated dispatch, the sweep, lookups."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.args = args
        self.rate: float = args.soak_rate
        threads = args.soak_agents + args.soak_workers
        self.engine = create_engine(url, pool_size=threads + 2, max_overflow=4)
        self.relay_engine = create_engine(url, pool_size=2, max_overflow=2)
        self.recorder = Recorder()
        self.inbox: queue.Queue[OutboundMessage] = queue.Queue()
        self.lookups: queue.Queue[UUID] = queue.Queue()
        self.stop = threading.Event()
        #: Set while the simulated workers take no message (--soak-pause): an outage.
        self.paused = threading.Event()
        self.errors: list[BaseException] = []
        self.tag = uuid.uuid4().hex[:8]
        self.relay = TimedRelay(
            self.relay_engine,
            QueuePublisher(self.inbox),
            RelayConfig(batch_size=BATCH, republish_after_s=REPUBLISH_AFTER_S),
        )
        self.relay.recorder = self.recorder
        time_claims(self.relay_engine, self.recorder)
        self.sweeper = Sweeper(
            self.engine,
            registry=lookup_registry(),
            config=SweepConfig(sent_timeout_s=5.0, sent_max_age_s=600.0, lookup_lease_s=30.0),
            request_lookup=self.lookups.put,
        )
        self._threads: list[threading.Thread] = []
        self._started = 0.0

    def start(self) -> None:
        """Start every thread; the agents' schedule begins now."""
        self._started = time.perf_counter()
        agents = self.args.soak_agents
        targets: list[tuple[str, Callable[[], None]]] = [
            ("relay", self.relay.run_forever),
            ("sweep", self._sweep_loop),
            ("lookups", self._lookup_loop),
        ]
        targets += [
            (f"agent-{i}", functools.partial(self._agent, i, agents)) for i in range(agents)
        ]
        targets += [(f"worker-{i}", self._worker) for i in range(self.args.soak_workers)]
        for name, target in targets:
            thread = threading.Thread(target=self._guard(target), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def finish(self) -> None:
        """Stop every thread and the engines."""
        self.stop.set()
        self.relay.stop()
        for thread in self._threads:
            thread.join(30)
        self.engine.dispose()
        self.relay_engine.dispose()
        if self.errors:
            raise RuntimeError(f"a soak thread failed: {self.errors[0]!r}") from self.errors[0]

    def _guard(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                self.errors.append(exc)
                self.stop.set()
                self.relay.stop()
                raise

        return run

    def _agent(self, index: int, agents: int) -> None:
        """Enqueue intents ``index``, ``index + agents``, ... on the fixed schedule."""
        with Session(self.engine) as session:
            i = index
            while not self.stop.is_set():
                due_at = self._started + i / self.rate
                delay = due_at - time.perf_counter()
                if delay > 0:
                    self.stop.wait(delay)
                    continue
                with session.begin():
                    api.enqueue(
                        session,
                        tool=TOOL,
                        target=f"project-{i % 50}",
                        payload={
                            "version": f"4.0.{i}",
                            "changelog": f"{uuid.uuid4().hex} " * 5,
                            "approvers": ["alice", "bob"],
                        },
                        intent_key=f"soak-{self.tag}-{i}",
                        metadata={"agent": "release-bot", "conversation": i // 7},
                    )
                self.recorder.enqueued()
                i += agents

    def _worker(self) -> None:
        """The dispatcher's state moves for every message: sent, then the outcome."""
        with self.engine.connect() as conn:
            while not self.stop.is_set():
                if self.paused.is_set():
                    self.stop.wait(0.2)
                    continue
                try:
                    message = self.inbox.get(timeout=0.2)
                except queue.Empty:
                    continue
                self._dispatch(conn, message.operation_id)

    def _dispatch(self, conn: Connection, op_id: UUID) -> None:
        fate = op_id.int % 100
        if not self._mark_sent(conn, op_id):
            return
        if fate == 0:
            return  # the dispatcher died after its `sent` commit: the sweep finds it
        with conn.begin():
            if fate < 6:
                transition(
                    conn,
                    op_id,
                    from_state=State.SENT,
                    to_state=State.FAILED,
                    actor=Actor.DISPATCHER,
                    reason="rejected by the remote: HTTP 422",
                    attempt=1,
                    effects=Effects(last_error="HTTP 422: version already released"),
                )
            else:
                transition(
                    conn,
                    op_id,
                    from_state=State.SENT,
                    to_state=State.CONFIRMED,
                    actor=Actor.DISPATCHER,
                    reason="applied",
                    attempt=1,
                    effects=Effects(
                        remote_ref=f"rel_{op_id.hex[:20]}",
                        result={"id": f"rel_{op_id.hex[:20]}", "status": "created"},
                    ),
                )
        self.recorder.done()

    def _mark_sent(self, conn: Connection, op_id: UUID) -> bool:
        """``planned -> sent`` as the dispatcher makes it: the move never waits on a row lock
        (a relay's open claim), so a busy row is waited for outside it and the move retried."""
        for _ in range(3):
            try:
                with conn.begin():
                    found = statements.get_for_dispatch(conn, op_id)
                    if found is None or found[0].state is not State.PLANNED:
                        return False  # a duplicate message: the row moved on
                    statements.require_synchronous_commit(conn)
                    transition(
                        conn,
                        op_id,
                        from_state=State.PLANNED,
                        to_state=State.SENT,
                        actor=Actor.DISPATCHER,
                        reason="dispatching attempt 1",
                        attempt=0,
                    )
            except StaleTransition:
                return False
            except DBAPIError as exc:
                if not statements.is_row_lock_busy(exc):
                    raise
                with conn.begin():
                    statements.wait_for_row_lock(conn, op_id, timeout_s=5.0)
                continue
            return True
        return False  # held three times over: the relay publishes it again

    def _sweep_loop(self) -> None:
        while not self.stop.wait(5.0):
            started = time.perf_counter()
            self.sweeper.run_once()
            self.recorder.sweep(time.perf_counter() - started)

    def _lookup_loop(self) -> None:
        """Lookups that find the effect: ``unknown -> confirmed``."""
        with self.engine.connect() as conn:
            while not self.stop.is_set():
                try:
                    op_id = self.lookups.get(timeout=0.2)
                except queue.Empty:
                    continue
                try:
                    with conn.begin():
                        transition(
                            conn,
                            op_id,
                            from_state=State.UNKNOWN,
                            to_state=State.CONFIRMED,
                            actor=Actor.RECONCILER,
                            reason="lookup: the effect exists",
                            attempt=1,
                            effects=Effects(remote_ref=f"rel_{op_id.hex[:20]}"),
                        )
                except StaleTransition:
                    continue
                self.recorder.done()


@dataclass(frozen=True)
class SoakServer:
    """Where the soak runs; ``log`` is the server's log when the soak started it."""

    url: str
    log: Path | None


@contextlib.contextmanager
def soak_server(args: argparse.Namespace) -> Iterator[SoakServer]:
    """A server with autovacuum on: ``--soak-url``, else a private cluster that logs every
    autovacuum run (``log_autovacuum_min_duration = 0``)."""
    if args.soak_url:
        yield SoakServer(args.soak_url, None)
        return
    from outbox.dev.clusters import LocalCluster  # noqa: PLC0415 -- only for the soak

    root = Path(tempfile.mkdtemp(prefix="outbox-scale-"))
    cluster = LocalCluster(root / "cluster")
    say(f"soak: starting a private PostgreSQL in {root}")
    try:
        cluster.start()
        admin = create_engine(cluster.url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(text("ALTER SYSTEM SET log_autovacuum_min_duration = 0"))
                conn.execute(text("SELECT pg_reload_conf()"))
        finally:
            admin.dispose()
        yield SoakServer(cluster.url, cluster.log_path)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


_AUTOVACUUM_LINE = re.compile(
    r"^(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\S* \S+ \[\d+\] LOG:  automatic "
    r"(?P<kind>vacuum|analyze) of table \"[^\"]+\.outbox\.(?P<table>\w+)\"(?P<rest>.*)$"
)


@dataclass
class AutovacuumRun:
    """One autovacuum (or autoanalyze) of an outbox table, from the server's log."""

    at: str
    kind: str
    table: str
    lines: list[str]

    def field(self, pattern: str) -> str:
        """The first group of ``pattern`` in the report, or ``-``."""
        for line in self.lines:
            found = re.search(pattern, line)
            if found:
                return found.group(1)
        return "-"

    @property
    def index_pass(self) -> str:
        """``done`` (dead index entries removed), ``bypassed`` or ``-``."""
        text_ = " ".join(self.lines)
        if "index scan bypassed" in text_:
            return "bypassed"
        if "index scan needed" in text_:
            return "done"
        return "not needed" if "index scan not needed" in text_ else "-"


def autovacuum_runs(log: Path, since: str) -> list[AutovacuumRun]:
    """Every autovacuum/autoanalyze report of ``operations`` or ``events`` logged at or after
    ``since``."""
    runs: list[AutovacuumRun] = []
    current: AutovacuumRun | None = None
    for line in log.read_text(errors="replace").splitlines():
        found = _AUTOVACUUM_LINE.match(line)
        if found:
            current = AutovacuumRun(found["at"], found["kind"], found["table"], [found["rest"]])
            if found["at"] >= since and found["table"] in ("operations", "events"):
                runs.append(current)
        elif current is not None and line.startswith(("\t", " ")):
            current.lines.append(line.strip())
        else:
            current = None
    return runs


def print_autovacuum(runs: Sequence[AutovacuumRun], out: Console) -> None:
    """The autovacuum reports as a table."""
    table = Table(title="autovacuum of the outbox tables during the soak (the server's log)")
    for column in ("at", "what", "table", "index pass", "dead items", "pages scanned", "elapsed"):
        table.add_column(column)
    for run in runs:
        vacuumed = run.kind == "vacuum"
        table.add_row(
            run.at[11:],
            run.kind,
            run.table,
            run.index_pass if vacuumed else "",
            run.field(r"(\d+) dead item identifiers") if vacuumed else "",
            run.field(r"(\d+) scanned") if vacuumed else "",
            run.field(r"elapsed: ([\d.]+ s)"),
        )
    out.print(table)


def _ms(values: Sequence[float], q: float) -> float:
    return 1000 * percentile(values, q) if values else math.nan


def run_soak(args: argparse.Namespace, summary: Results) -> None:
    """The soak: windows printed as a table, first/last/worst ratios into ``summary``."""
    rows = args.soak_rows
    with soak_server(args) as server, throwaway_database(server.url) as url:
        engine = create_engine(url, pool_size=2)
        try:
            started = time.perf_counter()
            load_terminal(engine, rows, label=f"soak {size_label(rows)}")
            vacuum(engine, "outbox.operations", "outbox.events", analyze=True)
            checkpoint(engine)
            say(f"soak: {rows:,} terminal rows loaded in {time.perf_counter() - started:.0f} s")
            if args.soak_storage == "defaults":
                reset_storage(engine)
            settings = storage_settings(engine)
            with engine.connect() as conn:
                log_since = str(conn.execute(text("SELECT now()::timestamp(0)::text")).scalar())
            soak = Soak(url, args)
            soak.start()
            try:
                table, collected = _soak_windows(args, soak, engine)
            finally:
                soak.finish()
            wide = Console(width=max(console().width, 200), highlight=False)
            wide.print(table)
            for line in settings:
                wide.print(line)
            if server.log is not None:
                print_autovacuum(autovacuum_runs(server.log, log_since), wide)
        finally:
            engine.dispose()
    pause = (
        f"The workers were stopped from {args.soak_pause_at:g} min for {args.soak_pause:g} s."
        if args.soak_pause > 0
        else ""
    )
    _soak_ratios(collected, summary, pause)


def _soak_windows(
    args: argparse.Namespace, soak: Soak, engine: Engine
) -> tuple[Table, list[tuple[Window, dict[str, Any]]]]:
    """Warm up, then record every window: its row in the table, and what it collected."""
    window_s: float = args.soak_window
    windows = max(1, math.ceil(60 * args.soak_minutes / window_s))
    say(f"soak: warming up for {args.soak_warmup:g} s")
    time.sleep(args.soak_warmup)
    soak.recorder.cut()
    table = _soak_table(args)
    collected: list[tuple[Window, dict[str, Any]]] = []
    window_started = time.perf_counter()
    busy_before = machine_busy_s()
    pause_from = window_started + 60 * args.soak_pause_at
    pause_until = pause_from + args.soak_pause
    for w in range(windows):
        next_cut = window_started + (w + 1) * window_s
        while (left := next_cut - time.perf_counter()) > 0:
            now = time.perf_counter()
            if args.soak_pause > 0 and pause_from <= now < pause_until:
                soak.paused.set()
            else:
                soak.paused.clear()
            if soak.stop.wait(min(left, 1.0)):
                raise RuntimeError("the soak stopped early") from (
                    soak.errors[0] if soak.errors else None
                )
        window = soak.recorder.cut()
        stats = sample(engine)
        stats |= explain_claim(engine, soak.recorder.claim_statement)
        busy_now = machine_busy_s()
        stats["busy"] = _busy_percent(busy_before, busy_now)
        busy_before = busy_now
        collected.append((window, stats))
        _soak_row(table, w, window, stats, window_s)
        say(
            f"soak window {w + 1}/{windows}: claim p50 {_ms(window.claims, 50):.2f} ms "
            f"p99 {_ms(window.claims, 99):.2f} ms, claim buffers {stats['claim_buffers']}, "
            f"{window.done / window_s:.0f} ops/s, dead {stats['ops_dead']:,}, "
            f"autovacuums {stats['ops_av']}"
        )
    return table, collected


def _busy_percent(before: tuple[float, float], after: tuple[float, float]) -> float:
    """The machine's busy CPU between two samples, in % of all its cores."""
    spent = after[1] - before[1]
    return 100 * (after[0] - before[0]) / spent if spent > 0 else math.nan


def _soak_table(args: argparse.Namespace) -> Table:
    table = Table(
        title=f"soak: {args.soak_rate:g} intents/s for {args.soak_minutes:g} min over "
        f"{size_label(args.soak_rows)} terminal rows, {args.soak_window:g} s windows "
        "(claim: the claim statement's latency at the driver, ms; claim bufs/exec: EXPLAIN "
        "(ANALYZE, BUFFERS) of it at the window's end, buffers and ms; cpu: the machine's)",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    columns = [
        "end",
        "enq/s",
        "done/s",
        "live",
        "pub wait",
        "claims",
        "claim p50",
        "p99",
        "max",
        "claim bufs",
        "exec",
        "pass p50",
        "sweep p50",
        "ops dead",
        "ops AV",
        "since AV",
        "ev dead",
        "ev AV",
        "idx kB",
        "cpu %",
        "vacuum now",
    ]
    for column in columns:
        if column == "vacuum now":
            table.add_column(column, no_wrap=True)
        else:
            table.add_column(column, justify="right")
    return table


def _soak_row(
    table: Table, index: int, window: Window, stats: Mapping[str, Any], window_s: float
) -> None:
    since = stats["ops_since_av"]
    end = (index + 1) * window_s
    table.add_row(
        f"{int(end // 60)}:{int(end % 60):02d}",
        f"{window.enqueued / window_s:.0f}",
        f"{window.done / window_s:.0f}",
        f"{stats['live']:,}",
        f"{stats['published']:,}",
        f"{len(window.claims):,}",
        f"{_ms(window.claims, 50):.2f}",
        f"{_ms(window.claims, 99):.2f}",
        f"{_ms(window.claims, 100):.1f}",
        f"{stats['claim_buffers']:,}",
        f"{stats['claim_exec_ms']:.2f}",
        f"{_ms(window.passes, 50):.2f}",
        f"{_ms(window.sweeps, 50):.0f}",
        f"{stats['ops_dead']:,}",
        str(stats["ops_av"]),
        "-" if since is None else f"{float(since):.0f} s",
        f"{stats['ev_dead']:,}",
        str(stats["ev_av"]),
        f"{stats['index_kb']:,}",
        f"{stats['busy']:.0f}",
        stats["vacuuming"],
    )


def _soak_ratios(
    collected: Sequence[tuple[Window, Mapping[str, Any]]], summary: Results, pause: str
) -> None:
    if not collected:
        return
    section = "soak: claim latency (the claim statement at the driver)"
    first, last = collected[0][0], collected[-1][0]
    worst50 = max(_ms(w.claims, 50) for w, _ in collected)
    worst99 = max(_ms(w.claims, 99) for w, _ in collected)
    for name, value in (
        ("first window p50", _ms(first.claims, 50)),
        ("last window p50", _ms(last.claims, 50)),
        ("worst window p50", worst50),
        ("first window p99", _ms(first.claims, 99)),
        ("last window p99", _ms(last.claims, 99)),
        ("worst window p99", worst99),
    ):
        summary.add(name, value, unit=MS, section=section)
    buffers = _soak_buffers(collected, summary)
    for q in ("p50", "p99"):
        summary.ratio(
            f"soak claim {q}: last window / first window",
            (section, f"last window {q}"),
            (section, f"first window {q}"),
            section="soak ratios",
        )
        summary.ratio(
            f"soak claim {q}: worst window / first window",
            (section, f"worst window {q}"),
            (section, f"first window {q}"),
            section="soak ratios",
        )
    for which in ("last", "worst"):
        summary.ratio(
            f"soak claim buffers: {which} window / first window",
            (buffers, f"{which} window buffers"),
            (buffers, "first window buffers"),
            section="soak ratios",
        )
    autovacuums = collected[-1][1]["ops_av"] - collected[0][1]["ops_av"]
    if pause:
        summary.note(pause)
    summary.note(
        f"Soak: {len(collected)} windows; autovacuums of outbox.operations during the windows: "
        f"{autovacuums} (count at the end {collected[-1][1]['ops_av']})."
    )


def _soak_buffers(collected: Sequence[tuple[Window, Mapping[str, Any]]], summary: Results) -> str:
    """The claim's buffers (EXPLAIN at each window's end): first, last, worst; the section."""
    section = "soak: claim buffers (EXPLAIN ANALYZE of the claim at the window's end)"
    buffers = [float(stats["claim_buffers"]) for _, stats in collected]
    for name, value in (
        ("first window buffers", buffers[0]),
        ("last window buffers", buffers[-1]),
        ("worst window buffers", max(buffers)),
    ):
        summary.add(name, value, unit="buffers", section=section)
    return section


# --- the run --------------------------------------------------------------------------------


def parse_sizes(value: str) -> list[int]:
    """``1e4,1e5,1e6`` -> [10000, 100000, 1000000]."""
    try:
        sizes = sorted({int(float(part)) for part in value.split(",") if part.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of sizes: {value!r}") from exc
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive: {value!r}")
    return sizes


def _terminate(signum: int, frame: object) -> None:
    del frame
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, rounds=10)
    parser.add_argument(
        "--sizes", type=parse_sizes, default=parse_sizes("1e4,1e5,1e6"), help="terminal rows"
    )
    parser.add_argument("--due", type=int, default=100, help="due live rows of each kind")
    parser.add_argument(
        "--not-due",
        type=int,
        default=0,
        help="live rows of each kind that are not due (backing off, in flight, checked later)",
    )
    parser.add_argument("--claims", type=int, default=30, help="claim calls per round and size")
    parser.add_argument("--passes", type=int, default=10, help="relay passes per round and size")
    parser.add_argument("--idle-runs", type=int, default=5, help="idle sweeps per round and size")
    parser.add_argument("--target", type=float, default=2.0, help="largest/smallest ratio bound")
    parser.add_argument("--soak-minutes", type=float, default=15.0, help="0 skips the soak")
    parser.add_argument("--soak-rate", type=float, default=200.0, help="intents per second")
    parser.add_argument("--soak-window", type=float, default=30.0, help="seconds per window")
    parser.add_argument("--soak-warmup", type=float, default=15.0, help="seconds not recorded")
    parser.add_argument("--soak-rows", type=lambda v: int(float(v)), help="default: max size")
    parser.add_argument(
        "--soak-pause",
        type=float,
        default=0.0,
        help="seconds the simulated workers stop (an outage: a backlog builds, then drains)",
    )
    parser.add_argument(
        "--soak-pause-at", type=float, default=2.0, help="minutes into the soak it begins"
    )
    parser.add_argument("--soak-agents", type=int, default=4, help="enqueueing threads")
    parser.add_argument("--soak-workers", type=int, default=4, help="dispatching threads")
    parser.add_argument(
        "--soak-storage",
        choices=("migrated", "defaults"),
        default="migrated",
        help="the tables' storage options as the migrations set them, or PostgreSQL's "
        "defaults (every option RESET), to compare",
    )
    parser.add_argument("--skip-sizes", action="store_true", help="only the soak")
    parser.add_argument(
        "--soak-url",
        help="a server (autovacuum on) where bench_* databases may be created; "
        "default: a private PostgreSQL started for the soak",
    )
    args = parser.parse_args(argv)
    # SIGTERM (a test's timeout) unwinds like Ctrl-C: the private PostgreSQL is stopped and the
    # throw-away databases are dropped on the way out.
    signal.signal(signal.SIGTERM, _terminate)
    # The sweep warns about every lost dispatcher it finds: here, hundreds on purpose.
    logging.getLogger("outbox.reconcilers").setLevel(logging.ERROR)
    if args.smoke:
        args.sizes, args.rounds, args.due = [1000, 10000], 3, 20
        args.claims, args.passes, args.idle_runs = 10, 3, 3
        args.soak_minutes, args.soak_window, args.soak_warmup = 20 / 60, 5.0, 3.0
        args.soak_rows = args.soak_rows or 10_000
    if args.soak_rows is None:
        args.soak_rows = max(args.sizes)
    tables = []
    if not args.skip_sizes:
        results = Results(
            f"scale: sizes {', '.join(size_label(s) for s in args.sizes)} terminal rows, "
            f"{args.due} due of each live kind, {args.rounds} rounds"
        )
        plans = measure_sizes(args, results)
        results.note(
            "Medians over rounds (each round's claim, relay and idle-sweep value is itself a "
            "median of its calls); ratios are taken within each round, then their median."
        )
        print_plans(plans)
        print_table(results)
        tables.append(results)
    if args.soak_minutes > 0:
        soak = Results(
            f"soak: {args.soak_rate:g} intents/s, {args.soak_minutes:g} min, "
            f"{size_label(args.soak_rows)} terminal rows, storage: {args.soak_storage}"
        )
        run_soak(args, soak)
        print_table(soak)
        tables.append(soak)
    write_json(args.json, tables, vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
