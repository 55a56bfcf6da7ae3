"""The asyncio agent API (``outbox.aio``): the event loop's lag under load, and its enqueue rate
against the sync API's, side by side in one run.

* **Event-loop lag**: ``--waiters`` (default 200) tasks on one loop, each ``enqueue`` in an
  ``AsyncSession`` + COMMIT, then ``wait`` for its operation, while a settler process moves each
  planned operation to ``confirmed`` through the real transitions (as a dispatcher would: their
  NOTIFY wakes the waiters). A ticker task sleeps 5 ms over and over and records how late it
  wakes: p50, p99 and max (target: p99 under 20 ms), and first, for a second, with nothing
  else on the loop (the machine's own noise). Also: the time until every waiter had its
  operation back, and the most PostgreSQL connections open on the database meanwhile.
* **Enqueue rate**: ``enqueue()+COMMIT`` one at a time on one connection, sync
  (``Connection``, ``Session``) and async (``AsyncConnection``, ``AsyncSession``), and their
  ratio (target: async at least 0.9x sync), with this process's CPU per enqueue; beside them
  psycopg alone, sync and async, one small INSERT+COMMIT at a time (the async driver's own
  cost against its sync one), and the same INSERT through SQLAlchemy's ``Connection`` and
  ``AsyncConnection`` (the floor of an API that joins the caller's SQLAlchemy transaction).

``--publish`` publishes the tool's contract (with an ``input_schema``) first, as a started
worker does, so every enqueue checks the tool and the payload against it (outbox.published).

Usage: python bench/aio.py [--url postgresql://...] [--rounds 3] [--ops 2000] [--waiters 200]
[--publish] [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import multiprocessing.synchronize
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

# The bench directory is not a package: `python bench/aio.py` puts it on sys.path.
import psycopg
from arguments import add_common_arguments
from report import Results, print_table, write_json
from rounds import Case, percentile, run_rounds
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from throwaway import server_settings, throwaway_database

from outbox import aio, api, listener, transitions
from outbox.approval import publish_policies_committed
from outbox.contracts import ToolContract
from outbox.db import create_async_engine, create_engine
from outbox.states import Actor, State
from outbox.urls import libpq_url

Rate = Mapping[str, tuple[float, str]]
TOOL = "deploy.create_release"
#: What ``--publish`` declares: the payload the bench enqueues matches it.
SCHEMA = {
    "type": "object",
    "required": ["version", "run"],
    "properties": {"version": {"type": "string"}, "run": {"type": "string"}},
}
#: The ticker's sleep: it measures how much later than this it wakes.
TICK_S = 0.005
#: How long the ticker runs alone first: the lag this machine gives an idle loop.
IDLE_S = 1.0
#: Connections of the agents' async engine in the lag case (the shared listener holds two).
AGENT_POOL = 10
#: The driver-only case's statement (its table made by the bench).
_RAW_INSERT = "INSERT INTO bench_aio_raw (v) VALUES (%s)"
#: The same through SQLAlchemy.
_SA_INSERT = text("INSERT INTO bench_aio_raw (v) VALUES (:v)")


def _settle(
    url: str, ready: multiprocessing.synchronize.Event, stop: multiprocessing.synchronize.Event
) -> None:
    """In a process of its own: move every planned operation to sent then confirmed, each
    in its own transaction, as a dispatcher would, until ``stop``."""
    engine = create_engine(url, pool_size=2)
    try:
        ready.set()
        while not stop.is_set():
            with engine.connect() as conn:
                ids = list(
                    conn.execute(
                        text("SELECT id FROM outbox.operations WHERE state = 'planned' LIMIT 500")
                    ).scalars()
                )
            for operation_id in ids:
                with Session(engine) as session, session.begin():
                    transitions.apply(
                        session, transitions.mark_sent(operation_id, attempt=0, reason="bench")
                    )
                    transitions.apply(
                        session,
                        transitions.confirm(
                            operation_id,
                            from_state=State.SENT,
                            actor=Actor.DISPATCHER,
                            attempt=1,
                            reason="bench",
                            remote_ref="bench",
                        ),
                    )
            if not ids:
                time.sleep(0.005)
    finally:
        engine.dispose()


class AioBench:
    """The cases, sharing one throw-away database."""

    def __init__(self, url: str, engine: Engine, args: argparse.Namespace) -> None:
        self.url = url
        self.engine = engine
        self.ops: int = args.ops
        self.waiters: int = args.waiters
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE bench_aio_raw (v text)"))

    def _payload(self, i: int) -> dict[str, Any]:
        return {"version": f"1.{i}", "run": uuid.uuid4().hex}

    # --- lag ------------------------------------------------------------------------------

    def lag(self) -> Rate:
        """N concurrent enqueue+commit+wait on one loop; the ticker's lateness."""
        return asyncio.run(self._lag())

    async def _lag(self) -> Rate:
        engine = create_async_engine(self.url, pool_size=AGENT_POOL, max_overflow=0)
        lags: list[float] = []
        connections: list[int] = []
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                before = time.perf_counter()
                await asyncio.sleep(TICK_S)
                lags.append(max(0.0, time.perf_counter() - before - TICK_S))

        async def agent(i: int) -> None:
            async with AsyncSession(engine) as session, session.begin():
                op = await aio.enqueue(session, tool=TOOL, target="lag", payload=self._payload(i))
            settled = await aio.wait(op.id, timeout=120, engine=engine)
            if settled.state is not State.CONFIRMED:
                raise RuntimeError(f"operation {op.id} settled {settled.state.value}")

        async def sample() -> None:
            # On the loop, not in a thread: a thread would take the GIL from the ticker.
            async with await psycopg.AsyncConnection.connect(
                libpq_url(self.url), autocommit=True
            ) as conn:
                while not done.is_set():
                    cursor = await conn.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    )
                    row = await cursor.fetchone()
                    connections.append(int(row[0]) - 1 if row else 0)  # not this one
                    await asyncio.sleep(0.05)

        try:
            tick = asyncio.create_task(ticker())
            await asyncio.sleep(IDLE_S)  # the machine's own noise: the loop with nothing to do
            idle = [lag * 1000 for lag in lags]
            lags.clear()
            sampler = asyncio.create_task(sample())
            started = time.perf_counter()
            await asyncio.gather(*(agent(i) for i in range(self.waiters)))
            elapsed = time.perf_counter() - started
            statements = sum(
                sum(shared.statements.values()) for shared in listener.listeners_of_this_loop()
            )
            done.set()
            await tick
            await sampler
        finally:
            await aio.close()
            await engine.dispose()
        ms = [lag * 1000 for lag in lags]
        return {
            "idle loop lag p99 (before the load)": (percentile(idle, 99), "ms"),
            "loop lag p50": (percentile(ms, 50), "ms"),
            "loop lag p99": (percentile(ms, 99), "ms"),
            "loop lag max": (max(ms), "ms"),
            f"{self.waiters} enqueue+commit+wait": (elapsed, "s"),
            "connections open (max, whole database)": (float(max(connections)), ""),
            "the waiters' statements (register, read, forget)": (float(statements), ""),
        }

    # --- enqueue rate ---------------------------------------------------------------------

    def sync_connection(self) -> Rate:
        with self.engine.connect() as conn:
            started, cpu = time.perf_counter(), time.process_time()
            for i in range(self.ops):
                with conn.begin():
                    api.enqueue(conn, tool=TOOL, target="sync", payload=self._payload(i))
            return self._rates("sync", "Connection", started, cpu)

    def sync_session(self) -> Rate:
        with Session(self.engine) as session:
            started, cpu = time.perf_counter(), time.process_time()
            for i in range(self.ops):
                with session.begin():
                    api.enqueue(session, tool=TOOL, target="sync", payload=self._payload(i))
            return self._rates("sync", "Session", started, cpu)

    def async_connection(self) -> Rate:
        async def run(engine: AsyncEngine) -> Rate:
            async with engine.connect() as conn:
                started, cpu = time.perf_counter(), time.process_time()
                for i in range(self.ops):
                    async with conn.begin():
                        await aio.enqueue(conn, tool=TOOL, target="aio", payload=self._payload(i))
                return self._rates("async", "AsyncConnection", started, cpu)

        return self._in_loop(run)

    def async_session(self) -> Rate:
        async def run(engine: AsyncEngine) -> Rate:
            async with AsyncSession(engine) as session:
                started, cpu = time.perf_counter(), time.process_time()
                for i in range(self.ops):
                    async with session.begin():
                        await aio.enqueue(
                            session, tool=TOOL, target="aio", payload=self._payload(i)
                        )
                return self._rates("async", "AsyncSession", started, cpu)

        return self._in_loop(run)

    # --- the driver's own floor ------------------------------------------------------------

    def raw_sync(self) -> Rate:
        """psycopg alone, no outbox, no SQLAlchemy: one small INSERT+COMMIT at a time."""
        with psycopg.connect(libpq_url(self.url)) as conn:
            started, cpu = time.perf_counter(), time.process_time()
            for i in range(self.ops):
                conn.execute(_RAW_INSERT, (str(i),))
                conn.commit()
            return self._rates("raw psycopg sync", "Connection", started, cpu, what="INSERT")

    def raw_async(self) -> Rate:
        """The same on psycopg's AsyncConnection."""

        async def run() -> Rate:
            async with await psycopg.AsyncConnection.connect(libpq_url(self.url)) as conn:
                started, cpu = time.perf_counter(), time.process_time()
                for i in range(self.ops):
                    await conn.execute(_RAW_INSERT, (str(i),))
                    await conn.commit()
                return self._rates(
                    "raw psycopg async", "AsyncConnection", started, cpu, what="INSERT"
                )

        return asyncio.run(run())

    def sqlalchemy_sync(self) -> Rate:
        """SQLAlchemy alone, no outbox: the same INSERT+COMMIT in ``Connection.begin()``."""
        with self.engine.connect() as conn:
            started, cpu = time.perf_counter(), time.process_time()
            for i in range(self.ops):
                with conn.begin():
                    conn.execute(_SA_INSERT, {"v": str(i)})
            return self._rates("SQLAlchemy sync", "Connection", started, cpu, what="INSERT")

    def sqlalchemy_async(self) -> Rate:
        """The same in ``AsyncConnection.begin()``: the floor of an API that joins the
        caller's SQLAlchemy async transaction, whatever it runs inside."""

        async def run(engine: AsyncEngine) -> Rate:
            async with engine.connect() as conn:
                started, cpu = time.perf_counter(), time.process_time()
                for i in range(self.ops):
                    async with conn.begin():
                        await conn.execute(_SA_INSERT, {"v": str(i)})
                return self._rates(
                    "SQLAlchemy async", "AsyncConnection", started, cpu, what="INSERT"
                )

        return self._in_loop(run)

    def _rates(
        self, kind: str, executor: str, started: float, cpu: float, *, what: str = "enqueue"
    ) -> Rate:
        """The rate since ``started``, and this process's CPU per operation since ``cpu``."""
        elapsed, used = time.perf_counter() - started, time.process_time() - cpu
        return {
            f"{kind} {what}+COMMIT, {executor}": (self.ops / elapsed, "/s"),
            f"{kind} client CPU per {what}, {executor}": (used / self.ops * 1e6, "us"),
        }

    def _in_loop(self, run: Callable[[AsyncEngine], Awaitable[Rate]]) -> Rate:
        async def main() -> Rate:
            engine = create_async_engine(self.url, pool_size=2)
            try:
                return await run(engine)
            finally:
                await engine.dispose()

        return asyncio.run(main())


def _cases(bench: AioBench) -> list[Case]:
    return [
        Case("loop lag", bench.lag, section=f"{bench.waiters} concurrent waiters, one loop"),
        Case("sync Connection", bench.sync_connection, section="enqueue rate, one connection"),
        Case(
            "async AsyncConnection", bench.async_connection, section="enqueue rate, one connection"
        ),
        Case("sync Session", bench.sync_session, section="enqueue rate, one connection"),
        Case("async AsyncSession", bench.async_session, section="enqueue rate, one connection"),
        Case("raw sync", bench.raw_sync, section="the driver alone, one connection"),
        Case("raw async", bench.raw_async, section="the driver alone, one connection"),
        Case("sqlalchemy sync", bench.sqlalchemy_sync, section="SQLAlchemy alone, one connection"),
        Case(
            "sqlalchemy async", bench.sqlalchemy_async, section="SQLAlchemy alone, one connection"
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--ops", type=int, default=2000, help="enqueues per rate case")
    parser.add_argument("--waiters", type=int, default=200, help="concurrent waiters")
    parser.add_argument(
        "--publish",
        action="store_true",
        help="publish the tool's contract with an input_schema first, as a started worker "
        "does: every enqueue then checks the tool and its payload (outbox.published)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.ops, args.waiters = 1, 100, 20
    results = Results(
        f"aio: {args.rounds} rounds, {args.waiters} concurrent waiters, {args.ops} enqueues "
        "per rate case"
    )
    with contextlib.ExitStack() as stack:
        db_url = stack.enter_context(throwaway_database(args.url))
        engine = create_engine(db_url, pool_size=4)
        stack.callback(engine.dispose)
        if args.publish:
            publish_policies_committed(engine, [ToolContract(name=TOOL, input_schema=SCHEMA)])
        spawn = multiprocessing.get_context("spawn")
        ready, stop = spawn.Event(), spawn.Event()
        settler = spawn.Process(target=_settle, args=(db_url, ready, stop), daemon=True)
        settler.start()
        stack.callback(settler.join, 10)
        stack.callback(stop.set)
        if not ready.wait(60):
            raise RuntimeError("the settler process did not start")
        run_rounds(args.rounds, _cases(AioBench(db_url, engine, args)), results)
    results.ratio(
        "async / sync, Connection",
        "async enqueue+COMMIT, AsyncConnection",
        "sync enqueue+COMMIT, Connection",
    )
    results.ratio(
        "async / sync, Session",
        "async enqueue+COMMIT, AsyncSession",
        "sync enqueue+COMMIT, Session",
    )
    results.target("event-loop lag p99 < 20 ms", "loop lag p99", at_most=20)
    results.target("async enqueue >= 0.9x sync (Session)", "async / sync, Session", at_least=0.9)
    results.target(
        "async enqueue >= 0.9x sync (Connection)", "async / sync, Connection", at_least=0.9
    )
    results.ratio(
        "async / sync client CPU, Session",
        "async client CPU per enqueue, AsyncSession",
        "sync client CPU per enqueue, Session",
    )
    results.ratio(
        "raw psycopg async / sync (the driver's floor)",
        "raw psycopg async INSERT+COMMIT, AsyncConnection",
        "raw psycopg sync INSERT+COMMIT, Connection",
    )
    results.ratio(
        "SQLAlchemy async / sync (the API's floor)",
        "SQLAlchemy async INSERT+COMMIT, AsyncConnection",
        "SQLAlchemy sync INSERT+COMMIT, Connection",
    )
    results.note(
        "Medians over rounds; ratios are computed within each round, then their median. The "
        "settler (a process of its own) and PostgreSQL share this machine's cores."
    )
    results.note(server_settings(args.url))
    print_table(results)
    write_json(args.json, [results], vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
