"""PostgreSQL's CPU per operation: ours stage by stage, naive Celery's statements beside it, and
what each schema part of our guarantees costs the server.

Flat out on two cores, throughput is CPU per operation, and the flat runs of ``peers.py`` put
the gap to naive Celery in PostgreSQL (1.5 ms of server CPU per operation against 0.5). This
script measures that share alone: no broker, no remote, no other process, so the server's CPU
is what the statements cost and nothing else; with one thread (``--threads 1``, the default)
the statements' own cost, with eight what running them side by side adds (as flat out, where
eight agents enqueue and a worker's eight threads dispatch). Each case runs on a throw-away
database of its own, the cases side by side in every round (``rounds``):

* ``naive celery``: the statements of ``peer_drivers/naive_celery.py`` (INSERT the intent and
  COMMIT, as its agent; then, as its task, SELECT it and INSERT the result and COMMIT);
* ``ours``: ``enqueue`` and COMMIT, one intent per transaction (as an agent); a worker's take
  of ``OUTBOX_OPS_PER_MESSAGE`` due operations per statement (as a RabbitMQ worker carrying a
  backlog); then each attempt as ``dispatch`` makes it (the lock and the `sent` move in one
  statement, committed durably; the outcome in another) with a Python tool that answers at
  once;
* ``ours`` with one schema part taken away (a database changed after its migrations; nothing
  in ``outbox`` changes): ``no invariants CHECK`` (``ck_operations_invariants``, the state
  machine's fifteen rules in one PL/pgSQL call per written row) and ``no events FK`` (the audit
  events' foreign key to their operation: a lookup per event).

Reported per operation and per stage: the CPU the database's backends used (``/proc/PID/
schedstat``, nanoseconds; the server must run on this machine), and the ratios: ours against
naive Celery's statements, each variant against ours whole. The committed work is the same
in every case (every COMMIT waits for the disk); the variants are measurements only, never
a configuration: the guarantees they remove are not optional (docs/performance.md).

Usage: python bench/server_cost.py [--url postgresql://...] [--rounds 3] [--ops 2000]
[--threads 1] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

# The bench directory is not a package: `python bench/server_cost.py` puts it on sys.path.
from arguments import add_common_arguments
from cpu import command_name, scheduled_cpu_s
from peer_drivers.job import TABLES_DDL, payload_for, target_for
from report import Results, print_table, write_json
from rounds import Case, run_rounds
from sqlalchemy import Connection, Engine, text
from sqlalchemy.orm import Session
from throwaway import server_settings, sigterm_as_interrupt, throwaway_database

from outbox import api, sql
from outbox.config import Settings
from outbox.contracts import ContractTable
from outbox.db import create_engine
from outbox.tools import Applied, ToolCall, ToolRegistry, tool
from outbox.workers.dispatch import DispatchConfig, Outcome, dispatch
from outbox.workers.locking import DispatchLocks

TOOL = "python.answers"
Item = TypeVar("Item")

#: Our cases: the schema change each makes after the migrations (none: ours whole).
VARIANTS: Mapping[str, Sequence[str]] = {
    "ours": (),
    "ours, no invariants CHECK": (
        "ALTER TABLE outbox.operations DROP CONSTRAINT ck_operations_invariants",
    ),
    "ours, no events FK": (
        "ALTER TABLE outbox.events DROP CONSTRAINT fk_events_operation_id_operations",
    ),
}
NAIVE = "naive celery"

#: naive_celery.py's statements, as its agent and its task run them.
INSERT_INTENT = text(
    "INSERT INTO bench_intents (id, target, payload) VALUES (:id, :target, CAST(:payload AS jsonb))"
)
SELECT_INTENT = text("SELECT target, payload FROM bench_intents WHERE id = :id")
INSERT_RESULT = text(
    "INSERT INTO bench_results (id, status, remote_ref) VALUES (:id, :status, :ref)"
)
BACKENDS = text(
    "SELECT pid FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


class ServerNotLocal(SystemExit):
    """The server's backends are not processes of this machine: their CPU cannot be read."""


@dataclass
class ServerClock:
    """The CPU the backends of one database have used, read from this machine's ``/proc``.

    Read it while every connection whose work counts is still open: a backend that exits
    takes its CPU with it (each stage below keeps its connections until it is read)."""

    admin: Connection

    def seconds(self) -> float:
        """The backends' CPU so far (this reader's own backend left out), in seconds."""
        # A backend that exited since the query took its work with it: not in the stages.
        spent = (scheduled_cpu_s(pid) for pid in self.admin.execute(BACKENDS).scalars())
        return sum(seconds for seconds in spent if seconds is not None)

    def check_local(self) -> None:
        """Exit with a clear message unless this server's backends are this machine's."""
        pid = self.admin.execute(text("SELECT pg_backend_pid()")).scalar_one()
        if command_name(pid) != "postgres":
            raise ServerNotLocal(
                "server_cost.py reads the server's CPU from /proc: --url must name a PostgreSQL "
                f"server running on this machine (backend pid {pid} is not a local postgres)"
            )


@contextlib.contextmanager
def _database(url: str, ddl: Sequence[str], threads: int) -> Iterator[tuple[Engine, ServerClock]]:
    """A throw-away migrated database changed by ``ddl``, its engine (enough connections for
    ``threads``, kept open until the end: see :class:`ServerClock`) and its clock."""
    with throwaway_database(url) as db_url:
        # Overflow connections would close, and their backends' CPU with them: a pool large
        # enough for every thread's two (a dispatcher's lock and its pool's) and the take's.
        engine = create_engine(db_url, pool_size=2 * threads + 4, max_overflow=0)
        try:
            with engine.connect() as admin:
                admin.execution_options(isolation_level="AUTOCOMMIT")
                for statement in ddl:
                    admin.execute(text(statement))
                clock = ServerClock(admin)
                clock.check_local()
                yield engine, clock
        finally:
            engine.dispose()


def _registry() -> ToolRegistry:
    registry = ToolRegistry(ContractTable())

    def answer(call: ToolCall) -> Applied:
        return Applied(f"ref-{call.operation_id}")

    tool(TOOL, registry=registry)(answer)
    return registry


#: Operations run through every stage first, unmeasured: each connection's statements
#: prepared (psycopg prepares one on its fifth run) and the catalog caches filled.
WARM_UP = 10

Stages = Sequence[tuple[str, Callable[[], None]]]


def _per_op(clock: ServerClock, stages: Callable[[int, int], Stages], ops: int) -> dict[str, float]:
    """``stages(first, count)`` run for :data:`WARM_UP` operations, then for ``ops`` more,
    each stage in turn: the server CPU each stage used per operation of the second run, µs."""
    for _, run in stages(0, WARM_UP):
        run()
    spent: dict[str, float] = {}
    for name, run in stages(WARM_UP, ops):
        before = clock.seconds()
        run()
        spent[name] = (clock.seconds() - before) / ops * 1e6
    return spent


def _in_threads(threads: int, items: Sequence[Item], work: Callable[[int, Item], None]) -> None:
    """``work(slot, item)`` for every item, on ``threads`` threads taking them in turn; the
    first error any raised is raised here once all have stopped."""
    todo: queue.SimpleQueue[Item] = queue.SimpleQueue()
    for item in items:
        todo.put(item)
    errors: list[BaseException] = []

    def run(slot: int) -> None:
        try:
            while not errors:
                try:
                    item = todo.get_nowait()
                except queue.Empty:
                    return
                work(slot, item)
        except BaseException as exc:  # noqa: BLE001 -- raised again below, in the caller
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(slot,)) for slot in range(threads)]
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            worker.join()
    except BaseException as exc:  # an interrupt: the threads stop after their current item
        errors.append(exc)
        for worker in workers:
            worker.join()
        raise
    if errors:
        raise errors[0]


def _ours(
    url: str, ddl: Sequence[str], ops: int, ops_per_message: int, threads: int
) -> dict[str, float]:
    registry = _registry()
    config = DispatchConfig()
    with _database(url, ddl, threads) as (engine, clock), contextlib.ExitStack() as stack:
        # One per dispatching thread, as each of a worker's threads has its own.
        locks = [stack.enter_context(DispatchLocks(engine)) for _ in range(threads)]

        def stages(first: int, count: int) -> Stages:
            taken: list[str] = []

            def enqueue_one(_: int, i: int) -> None:
                with Session(engine) as session, session.begin():
                    api.enqueue(session, tool=TOOL, target=target_for(i), payload=payload_for(i))

            def take() -> None:
                with engine.connect() as conn:
                    conn.execution_options(isolation_level="AUTOCOMMIT")
                    while claimed := sql.relay.take_due(
                        conn, limit=ops_per_message, republish_after_s=300.0
                    ).claimed:
                        taken.extend(str(c.id) for c in claimed)
                if len(taken) != count:
                    raise SystemExit(f"the take found {len(taken)} of {count} operations")

            def attempt_one(slot: int, op_id: str) -> None:
                report = dispatch(
                    op_id, engine=engine, registry=registry, config=config, locks=locks[slot]
                )
                if report.outcome is not Outcome.CONFIRMED:
                    raise SystemExit(f"{op_id}: {report.outcome.value}, not confirmed")

            return [
                ("enqueue", lambda: _in_threads(threads, range(first, first + count), enqueue_one)),
                ("take", take),
                ("attempt", lambda: _in_threads(threads, taken, attempt_one)),
            ]

        return _per_op(clock, stages, ops)


def _naive(url: str, ops: int, threads: int) -> dict[str, float]:
    with _database(url, TABLES_DDL, threads) as (engine, clock):

        def stages(first: int, count: int) -> Stages:
            ids = [(i, uuid.uuid4()) for i in range(first, first + count)]

            def enqueue_one(_: int, intent: tuple[int, uuid.UUID]) -> None:
                i, intent_id = intent
                payload = json.dumps(payload_for(i))
                with engine.begin() as conn:
                    conn.execute(
                        INSERT_INTENT,
                        {"id": intent_id, "target": target_for(i), "payload": payload},
                    )

            def attempt_one(_: int, intent: tuple[int, uuid.UUID]) -> None:
                intent_id = intent[1]
                with engine.begin() as conn:
                    conn.execute(SELECT_INTENT, {"id": intent_id}).one()
                with engine.begin() as conn:
                    conn.execute(INSERT_RESULT, {"id": intent_id, "status": 201, "ref": "r"})

            return [
                ("enqueue", lambda: _in_threads(threads, ids, enqueue_one)),
                ("attempt", lambda: _in_threads(threads, ids, attempt_one)),
            ]

        return _per_op(clock, stages, ops)


def _rows(case: str, spent: Mapping[str, float]) -> dict[str, tuple[float, str]]:
    rows = {f"{case}: {stage}": (value, "µs/op") for stage, value in spent.items()}
    rows[f"{case}: total"] = (sum(spent.values()), "µs/op")
    return rows


def _case(name: str, measure: Callable[[], dict[str, float]]) -> Case:
    def run() -> dict[str, tuple[float, str]]:
        started = time.perf_counter()
        rows = _rows(name, measure())
        rows[f"{name}: wall"] = (time.perf_counter() - started, "s")
        return rows

    return Case(name, run, "server CPU per operation")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--ops", type=int, default=2000, help="operations per case and round")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="agents enqueuing and threads dispatching at once (default 1: the statements' "
        "own cost; 8: what contention adds, as flat out)",
    )
    args = parser.parse_args()
    for name in ("ops", "threads", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    if args.smoke:
        args.rounds, args.ops = 1, 60
    ops_per_message = Settings().ops_per_message
    cases = [_case(NAIVE, functools.partial(_naive, args.url, args.ops, args.threads))] + [
        _case(
            name, functools.partial(_ours, args.url, ddl, args.ops, ops_per_message, args.threads)
        )
        for name, ddl in VARIANTS.items()
    ]
    results = Results("PostgreSQL's CPU per operation, by stage (the database's backends)")
    with sigterm_as_interrupt():  # a killed run drops its databases too
        run_rounds(args.rounds, cases, results)
    results.ratio("ours / naive celery", "ours: total", f"{NAIVE}: total")
    for name in VARIANTS:
        if name != "ours":
            results.ratio(f"{name.removeprefix('ours, ')} / ours", f"{name}: total", "ours: total")
    results.note(
        f"{args.ops} operations per case and round, {args.threads} thread(s); ours takes "
        f"{ops_per_message} per statement (OUTBOX_OPS_PER_MESSAGE); medians over rounds, "
        "ratios within each round; CPU of the database's backends from /proc/PID/schedstat."
    )
    results.note(server_settings(args.url))
    print_table(results)
    write_json(args.json, [results], vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
