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

* ``claim``: :func:`outbox.sql.relay.claim_and_mark_due` (the statement ``Relay.run_once`` calls),
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
  functions (:func:`outbox.sql.locks.get_for_dispatch`, then
  :func:`outbox.transitions.mark_sent` ``planned -> sent`` with ``synchronous_commit = on``,
  then ``sent -> confirmed``, or ``failed`` for 5 %, each committed): the same row versions
  and events as ``outbox.workers.dispatch.dispatch``, without Celery, the advisory lock and a tool
  call. 1 % are left in ``sent`` (a dispatcher that died);
* the sweep: the real :class:`~outbox.reconcilers.sweep.Sweeper` every 5 s (``sent`` timeout 5 s),
  its lookups answered by a thread that confirms the row (``unknown -> confirmed``).

Per ``--soak-window`` seconds (30): claims and their latency p50/p99/max, EXPLAIN (ANALYZE,
BUFFERS) of the relay's last claim at the window's end (buffers and ms at the server: a
measure the machine's other load does not blur), relay passes, sweeps, throughput, the live
backlog and, of it, the ``planned`` rows already published and waiting for a worker (the claim
read past them before migration 0022), from ``pg_stat_user_tables`` ``n_dead_tup``, the
autovacuum count and the time since ``last_autovacuum`` of ``operations`` and ``events``, any
vacuum running now, the size of the relay's partial index (never-published rows) and the
machine's CPU use. Ratios: the last window's claim p50 and p99 over the first's, and the
worst window's over the first's. The soak is only meaningful while the pipeline keeps up with
``--soak-rate``: a growing "pub wait" means it does not, and the claim then measures that
backlog, not the table.

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
import logging
import signal
import sys
from collections.abc import Sequence

# The bench directory is not a package: `python bench/scale.py` puts it on sys.path.
from arguments import add_common_arguments
from report import Results, print_table, write_json
from scale_data import size_label
from scale_explain import print_plans
from scale_sizes import measure_sizes
from scale_soak_run import run_soak
from throwaway import server_settings


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
        results.note(server_settings(args.url))
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
