"""The relay's claim against a broker backlog: published `planned` rows waiting for a worker.

When the workers fall behind (stopped, or slower than the agents), the relay keeps publishing:
the rows stay `planned` with ``published_at`` set until a worker takes them, and they are not
claimed again before ``republish_after`` (30 s). The question: does a claim pay for them?

Per backlog size (``--backlogs``, default ``0,2000,20000,100000``), one throw-away database
(``bench_<hex>``, migrated to the latest revision) holding ``--history`` (10^5) finished
operations as bench/scale.py loads them (so the planner sees a table mostly of history, as in
a live system), and:

* the backlog: N `planned` rows published 5 s ago (due before they were published, oldest
  first: the order in which the relay published them);
* ``--new`` (20) `planned` rows never published, due just now (new intents behind the backlog);
* ``--lost`` (20) `planned` rows published 10 minutes ago (their message was lost: to be
  published again), due before the backlog;

then ``VACUUM ANALYZE``. Then ``--claims`` (20) times, each in its own transaction, rolled
back: ``EXPLAIN (ANALYZE, BUFFERS)`` of the claim statement (``outbox.sql.relay``'s, limit
200, republish_after 30 s; shared buffers hit + read and execution time at the server), and
the relay's real :func:`outbox.sql.relay.claim_and_mark_due` timed at the client. Every
claim must return the new and the lost rows and nothing of the backlog. Medians are printed
per size, with the indexes the plan scanned.

The script uses the ``outbox`` it imports, so the same file measures another tree when run
with ``PYTHONPATH`` set to it (before/after a change of the claim).

``--smoke``: backlogs 0 and 500, 3 claims, 10^3 finished operations.

Usage: python bench/claim_backlog.py [--url postgresql://...] [--backlogs 0,2000,20000,100000]
       [--history 1e5] [--claims 20] [--new 20] [--lost 20] [--smoke] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

# `arguments`, `scale_data` and `throwaway` are bench/'s own modules (not a package: the
# script's directory is on sys.path).
from arguments import add_common_arguments
from scale_data import load_terminal
from sqlalchemy import Engine, text
from sqlalchemy.pool import NullPool
from throwaway import throwaway_database

from outbox.db import create_engine
from outbox.sql import relay

LIMIT = 200
REPUBLISH_AFTER_S = 30.0

# `n` planned rows of one kind. `published_ago` NULL: never published.
_LOAD = text(
    """
    INSERT INTO outbox.operations
        (intent_key, tool, target, payload, payload_hash, intent_hash, state,
         created_at, updated_at, available_at, published_at)
    SELECT :kind || '-' || g, 'deploy.create_release', 'project-' || (g % 50), p.payload,
           encode(sha256(convert_to(p.payload::text, 'UTF8')), 'hex'),
           outbox.intent_hash('deploy.create_release', 'project-' || (g % 50),
                              encode(sha256(convert_to(p.payload::text, 'UTF8')), 'hex')),
           'planned', t.due, t.due, t.due,
           now() - CAST(:published_ago AS interval) + g * interval '1 millisecond'
    FROM generate_series(1, :n) AS g
    CROSS JOIN LATERAL (
        SELECT now() - CAST(:due_ago AS interval) + g * interval '1 millisecond' AS due
    ) AS t
    CROSS JOIN LATERAL (
        SELECT jsonb_build_object('version', '3.0.' || g, 'project', 'project-' || (g % 50),
                                  'changelog', substr(repeat(md5(g::text) || ' ', 6), 1, 180))
               AS payload
    ) AS p
    """
)


def parse_sizes(value: str) -> list[int]:
    """``0,2000,2e4`` -> [0, 2000, 20000]."""
    try:
        sizes = sorted({int(float(part)) for part in value.split(",") if part.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of backlog sizes: {value!r}") from exc
    if not sizes or sizes[0] < 0:
        raise argparse.ArgumentTypeError(f"backlog sizes must be 0 or more: {value!r}")
    return sizes


def load(engine: Engine, *, backlog: int, new: int, lost: int) -> None:
    """The backlog, the new rows and the lost ones (see the module's docstring)."""
    with engine.begin() as conn:
        conn.execute(text("SET LOCAL synchronous_commit = off"))
        for kind, n, due_ago, published_ago in (
            ("lost", lost, "20 minutes", "10 minutes"),
            ("backlog", backlog, "10 minutes", "5 seconds"),
            ("new", new, "1 second", None),
        ):
            if n:
                conn.execute(
                    _LOAD,
                    {"kind": kind, "n": n, "due_ago": due_ago, "published_ago": published_ago},
                )
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE outbox.operations"))


def _scans(node: dict[str, Any]) -> Iterator[str]:
    if "Index Name" in node:
        yield f"{node['Node Type']} {node['Index Name']}"
    elif node.get("Node Type") == "Seq Scan":
        yield f"Seq Scan {node.get('Relation Name')}"
    for child in node.get("Plans", []):
        yield from _scans(child)


def explain_claim(engine: Engine) -> tuple[int, float, list[str]]:
    """EXPLAIN (ANALYZE, BUFFERS) of one claim, rolled back: buffers, server ms, scans."""
    sql = str(relay._CLAIM_AND_MARK_DUE.clause)  # the statement as the relay sends it
    with engine.connect() as conn, conn.begin() as tx:
        plan = conn.execute(
            text(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}"),
            {
                "limit": LIMIT,
                "look": LIMIT,
                "republish_after": REPUBLISH_AFTER_S,
                "hold_back": 0,
                # The relay's deferral to RabbitMQ workers taking directly (none here).
                "defer": 0.2,
                "fresh": 30,
                "without_flush": False,
                "lock": False,
                "send": False,
                "send_tools": [],
                "send_max_attempts": [],
                "send_approval": [],
            },
        ).scalar_one()
        tx.rollback()
    top = plan[0]
    node = top["Plan"]
    buffers = int(node["Shared Hit Blocks"]) + int(node["Shared Read Blocks"])
    return buffers, float(top["Execution Time"]), sorted(set(_scans(node)))


def timed_claims(engine: Engine, *, claims: int, new: int, lost: int) -> list[float]:
    """The relay's real claim (``claim_and_mark_due``), each in its own transaction (rolled
    back) on one connection, as the relay keeps one; client ms each."""
    elapsed: list[float] = []
    with engine.connect() as conn:
        for _ in range(claims):
            with conn.begin() as tx:
                start = time.perf_counter()
                claimed = relay.claim_and_mark_due(
                    conn, limit=LIMIT, republish_after_s=REPUBLISH_AFTER_S
                )
                elapsed.append((time.perf_counter() - start) * 1000)
                tx.rollback()
            if len({c.id for c in claimed}) != min(new + lost, LIMIT):
                raise SystemExit(
                    f"claim returned {len(claimed)} rows, expected {min(new + lost, LIMIT)}"
                )
    return elapsed


def measure(
    url: str, *, history: int, backlog: int, new: int, lost: int, claims: int
) -> dict[str, Any]:
    """One backlog size on a database of its own."""
    with throwaway_database(url) as db_url:
        engine = create_engine(db_url, poolclass=NullPool)
        try:
            if history:
                load_terminal(engine, history, label=f"backlog {backlog:,}")
            load(engine, backlog=backlog, new=new, lost=lost)
            explained = [explain_claim(engine) for _ in range(claims)]
            client_ms = timed_claims(engine, claims=claims, new=new, lost=lost)
        finally:
            engine.dispose()
    return {
        "backlog": backlog,
        "buffers": [b for b, _, _ in explained],
        "server_ms": [ms for _, ms, _ in explained],
        "client_ms": client_ms,
        "scans": explained[-1][2],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, rounds=1)
    parser.add_argument(
        "--backlogs", type=parse_sizes, default=[0, 2000, 20000, 100000], help="backlog sizes"
    )
    parser.add_argument(
        "--history", type=lambda v: int(float(v)), default=100_000, help="finished operations"
    )
    parser.add_argument("--claims", type=int, default=20, help="claims per size")
    parser.add_argument("--new", type=int, default=20, help="never-published due rows")
    parser.add_argument("--lost", type=int, default=20, help="rows published 10 minutes ago")
    args = parser.parse_args(argv)
    if args.smoke:
        args.backlogs, args.claims, args.history = [0, 500], 3, 1000
    results = []
    print(
        f"claim: limit {LIMIT}, republish_after {REPUBLISH_AFTER_S:g} s; medians of "
        f"{args.claims} claims; {args.new} new and {args.lost} lost rows beside the backlog"
    )
    print(f"{'backlog':>8} {'buffers':>8} {'server ms':>10} {'client ms':>10}  scans")
    for backlog in args.backlogs:
        r = measure(
            args.url,
            history=args.history,
            backlog=backlog,
            new=args.new,
            lost=args.lost,
            claims=args.claims,
        )
        results.append(r)
        print(
            f"{backlog:>8,} {statistics.median(r['buffers']):>8.0f} "
            f"{statistics.median(r['server_ms']):>10.3f} "
            f"{statistics.median(r['client_ms']):>10.3f}  {', '.join(r['scans'])}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
