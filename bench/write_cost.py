"""What one write of an operation's row costs PostgreSQL, part by part, and what a commit adds.

``server_cost.py`` measures our statements stage by stage against naive Celery's: they cost
the server 1.65 times as much in one thread. This script takes one of them apart: the
dispatcher's outcome move (``sent -> confirmed``), the write every attempt ends with and the
shape of every move (the compare-and-set UPDATE of ``outbox.operations``, the row returned,
its audit event, the NOTIFY for a waiter if any). Each case runs on a throw-away migrated
database of its own (changed by the case's DDL, if any), side by side in every round
(``rounds``): ``--ops`` operations are inserted and moved to ``sent`` (not measured), then the
case's statement runs once per operation on one connection (autocommit, ``synchronous_commit``
on, prepared once warm), and the CPU its backend used is read from ``/proc/PID/schedstat``
(the server must run on this machine):

* ``a plain row's UPDATE``: one UPDATE by primary key of a table with nothing but its key (as
  naive Celery's rows), for scale;
* ``the UPDATE alone``: the move's compare-and-set of ``outbox.operations``, nothing returned;
* ``+ the row returned``: with ``RETURNING`` the whole row (what ``transitions`` reads back);
* ``+ its event``: and the ``outbox.events`` row in the same statement;
* ``the dispatcher's move``: the statement as the dispatcher sends it (the above, and the
  NOTIFY for a waiter: ``outbox.sql.moves``), in the shape ``pg_stat_statements`` shows it;
* the dispatcher's move on a schema without one part: ``no invariants CHECK``, ``no partial
  indexes`` (the eight live-queue and retention indexes);
* ``two moves per commit``: the dispatcher's move for two operations in one transaction (as an
  outcome recorded with the next operation's `sent` move would be), per move;
* ``HOT move + a queue row``: a design sketch, not ours: the live queues' indexes moved to a
  narrow table of their own, so that the move's UPDATE of the operation's row can be
  heap-only (HOT, no index entry written), the queue row moved in the same statement.

The variants are measurements only: the guarantees they take away are not optional
(docs/performance.md). The SQL here is a copy made for measuring; the dispatcher's own is in
``outbox.sql.moves``.

Usage: python bench/write_cost.py [--url postgresql://...] [--rounds 3] [--ops 2000] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg

# The bench directory is not a package: `python bench/write_cost.py` puts it on sys.path.
from arguments import add_common_arguments
from cpu import command_name, scheduled_cpu_s
from report import Results, print_table, write_json
from rounds import Case, run_rounds
from throwaway import server_settings, sigterm_as_interrupt, throwaway_database

from outbox.urls import libpq_url

#: Operations moved first on every case's connection, unmeasured: the statement prepared
#: (psycopg prepares one on its fifth run) and the catalog caches filled.
WARM_UP = 20

_RETURNED = "RETURNING o.*"
_UPDATE = (
    "UPDATE outbox.operations AS o SET state = 'confirmed', remote_ref = %(ref)s,"
    " result = CAST(%(result)s AS jsonb), updated_at = statement_timestamp(),"
    " next_check_at = NULL, resolved_at = statement_timestamp()"
    # COLLATE "C" as the dispatcher's: no partial index on ``state`` matches it, so the
    # planner keeps to the primary key on a table never analysed (outbox.sql.moves).
    " WHERE o.id = %(id)s AND o.state COLLATE \"C\" = 'sent' AND o.attempts = 1"
)
_EVENT = (
    "INSERT INTO outbox.events (operation_id, from_state, to_state, attempt, actor, reason)"
    " SELECT moved.id, 'sent', 'confirmed', moved.attempts, 'dispatcher', 'confirmed'"
    " FROM moved"
)
UPDATE_ALONE = _UPDATE
WITH_ROW = f"{_UPDATE} {_RETURNED}"
WITH_EVENT = (
    f"WITH moved AS ({_UPDATE} {_RETURNED}), logged AS ({_EVENT}) SELECT moved.* FROM moved"
)
#: As ``outbox.sql.moves`` builds a confirmed outcome: the move, its event, and a NOTIFY on the
#: settled channel only while someone waits for the operation.
_SETTLED = (
    " SELECT moved.*, (SELECT pg_notify('outbox_settled', CAST(moved.id AS text)) FROM moved"
    " WHERE EXISTS (SELECT FROM outbox.waiters AS w WHERE w.operation_id = moved.id))"
    " AS notified FROM moved"
)
DISPATCHER_MOVE = f"WITH moved AS ({_UPDATE} {_RETURNED}), logged AS ({_EVENT}){_SETTLED}"
#: A design sketch, not ours: the live queues' indexes on a narrow table of their own, so
#: that the operation's row has no index on a column a move changes and its UPDATE can be
#: heap-only (HOT: no index entry written); the queue row moves in the same statement.
_QUEUE_DDL = (
    "CREATE TABLE outbox.bench_queue (operation_id uuid PRIMARY KEY, state text NOT NULL,"
    " at timestamptz NOT NULL)",
    "CREATE INDEX ON outbox.bench_queue (at) WHERE state = 'planned'",
    "CREATE INDEX ON outbox.bench_queue (at) WHERE state = 'sent'",
    "CREATE INDEX ON outbox.bench_queue (at) WHERE state = 'unknown'",
    "CREATE INDEX ON outbox.bench_queue (at) WHERE state = 'resolved'",
)
_QUEUE_FILL = (
    "INSERT INTO outbox.bench_queue SELECT id, state, sent_at FROM outbox.operations"
    " WHERE state = 'sent' ON CONFLICT DO NOTHING",
)
QUEUE_MOVE = (
    f"WITH moved AS ({_UPDATE} {_RETURNED}),"
    " queued AS (UPDATE outbox.bench_queue SET state = 'resolved', at = statement_timestamp()"
    f" WHERE operation_id = %(id)s), logged AS ({_EVENT}){_SETTLED}"
)
PLAIN_UPDATE = "UPDATE bench_plain SET state = 'confirmed', n = n + 1 WHERE id = %(id)s"

_NO_CHECK = "ALTER TABLE outbox.operations DROP CONSTRAINT ck_operations_invariants"
#: Every index of the table but its primary key and the intent key's unique rule.
_NO_PARTIAL_INDEXES = """
DO $$
DECLARE name text;
BEGIN
  FOR name IN SELECT indexname FROM pg_indexes
              WHERE schemaname = 'outbox' AND tablename = 'operations' AND indexname LIKE 'ix_%'
  LOOP
    EXECUTE format('DROP INDEX outbox.%I', name);
  END LOOP;
END $$
"""


@dataclass(frozen=True)
class WriteCase:
    """One statement run once per operation, on a database changed by ``ddl``."""

    name: str
    statement: str
    ddl: Sequence[str] = ()
    #: Operations per transaction (1: autocommit, a commit per statement).
    per_commit: int = 1
    #: A table of plain rows instead of ``outbox.operations``.
    plain: bool = False
    #: Statements run after each batch of operations is made (not measured).
    after_insert: Sequence[str] = ()


CASES = (
    WriteCase("a plain row's UPDATE", PLAIN_UPDATE, plain=True),
    WriteCase("the UPDATE alone", UPDATE_ALONE),
    WriteCase("+ the row returned", WITH_ROW),
    WriteCase("+ its event", WITH_EVENT),
    WriteCase("the dispatcher's move", DISPATCHER_MOVE),
    WriteCase("no invariants CHECK", DISPATCHER_MOVE, ddl=(_NO_CHECK,)),
    WriteCase("no partial indexes", DISPATCHER_MOVE, ddl=(_NO_PARTIAL_INDEXES,)),
    WriteCase("two moves per commit", DISPATCHER_MOVE, per_commit=2),
    WriteCase(
        "HOT move + a queue row",
        QUEUE_MOVE,
        ddl=(_NO_PARTIAL_INDEXES, *_QUEUE_DDL),
        after_insert=_QUEUE_FILL,
    ),
)
REFERENCE = "the dispatcher's move"


def _backend_cpu_s(conn: psycopg.Connection) -> float:
    pid = conn.info.backend_pid
    seconds = scheduled_cpu_s(pid)
    if seconds is None or command_name(pid) != "postgres":
        raise SystemExit(
            "write_cost.py reads the server's CPU from /proc: --url must name a PostgreSQL "
            f"server running on this machine (backend pid {pid} is not a local postgres)"
        )
    return seconds


def _sent_operations(conn: psycopg.Connection, count: int, *, plain: bool) -> list[uuid.UUID]:
    """``count`` operations in ``sent`` (or plain rows), made in two statements."""
    ids = [uuid.uuid4() for _ in range(count)]
    if plain:
        conn.execute(
            "INSERT INTO bench_plain (id, state, n) SELECT i, 'sent', 0 FROM unnest(%s::uuid[]) i",
            (ids,),
        )
        return ids
    conn.execute(
        "INSERT INTO outbox.operations (id, intent_key, tool, target, payload, payload_hash,"
        " intent_hash) SELECT i, i::text, 'bench.tool', 'target', '{\"n\": 1}',"
        " repeat('a', 64), repeat('b', 64) FROM unnest(%s::uuid[]) AS i",
        (ids,),
    )
    conn.execute(
        "UPDATE outbox.operations SET state = 'sent', attempts = 1, sent_at = now(),"
        " first_sent_at = now() WHERE id = ANY(%s)",
        (ids,),
    )
    return ids


def _move_all(conn: psycopg.Connection, case: WriteCase, ids: Sequence[uuid.UUID]) -> None:
    params = {"ref": "ref-1", "result": json.dumps({"id": "ref-1"})}
    for start in range(0, len(ids), case.per_commit):
        with conn.transaction() if case.per_commit > 1 else contextlib.nullcontext():
            for one in ids[start : start + case.per_commit]:
                moved = conn.execute(case.statement, {**params, "id": one}, prepare=True)
                if moved.rowcount != 1:
                    raise SystemExit(f"{case.name}: operation {one} was not moved")


def measure(url: str, case: WriteCase, ops: int) -> float:
    """The server CPU ``case``'s statement used per operation, µs (on a new database)."""
    with throwaway_database(url) as db_url, psycopg.connect(libpq_url(db_url)) as conn:
        conn.autocommit = True
        _backend_cpu_s(conn)  # a server elsewhere is refused before any setup
        conn.execute("SET synchronous_commit = on")
        if case.plain:
            conn.execute("CREATE TABLE bench_plain (id uuid PRIMARY KEY, state text, n int)")
        for statement in case.ddl:
            conn.execute(statement)
        warm = _sent_operations(conn, WARM_UP, plain=case.plain)
        ids = _sent_operations(conn, ops, plain=case.plain)
        for statement in case.after_insert:
            conn.execute(statement)
        _move_all(conn, case, warm)
        conn.execute("CHECKPOINT")  # every case starts from clean pages
        before = _backend_cpu_s(conn)
        _move_all(conn, case, ids)
        return (_backend_cpu_s(conn) - before) / ops * 1e6


def _case(url: str, case: WriteCase, ops: int) -> Case:
    def run() -> dict[str, tuple[float, str]]:
        return {case.name: (measure(url, case, ops), "µs/write")}

    return Case(case.name, run, "server CPU per write")


def cases(url: str, ops: int) -> list[Case]:
    """Every :data:`CASES` entry as a round's case."""
    return [_case(url, case, ops) for case in CASES]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--ops", type=int, default=2000, help="writes per case and round")
    args = parser.parse_args()
    for name in ("ops", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    if args.smoke:
        args.rounds, args.ops = 1, 60
    results = Results("PostgreSQL's CPU per write of an operation's row (its backend)")
    with sigterm_as_interrupt():  # a killed run drops its databases too
        run_rounds(args.rounds, cases(args.url, args.ops), results)
    for case in CASES:
        if case.name != REFERENCE:
            results.ratio(f"{case.name} / {REFERENCE}", case.name, REFERENCE)
    results.note(
        f"{args.ops} writes per case and round, one connection, autocommit unless stated; "
        "medians over rounds, ratios within each round; CPU from /proc/PID/schedstat."
    )
    results.note(server_settings(args.url))
    print_table(results)
    write_json(args.json, [results], vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
