"""The dispatcher's lock step with the `sent` move in it, against the lock and the `sent` move
as two statements, side by side in each round (change 45, issue 35).

Operations are enqueued first, then ``--threads`` threads each run :func:`dispatch` on them
(the worker's whole attempt, without the broker: the lock, the `sent` commit, the call, the
outcome's commit) until none is left, taking their locks in turn on one connection per
thread as a message's task does. ``DispatchConfig.send_at_lock`` is the only difference
between the two cases. Two remotes: a Python tool that answers at once (the statements are
then the attempt: the largest share the change can take) and the reference service over
HTTP (in this process). Reported: operations confirmed per second, and the process's CPU per
operation (the dispatcher's Python side: a statement fewer is also one less to run).

Usage: python bench/dispatch_step.py [--url postgresql://...] [--rounds 3] [--ops 600]
[--threads 1] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

# The bench directory is not a package: `python bench/dispatch_step.py` puts it on sys.path.
from arguments import add_common_arguments
from report import Results, print_table, write_json
from rounds import Case, run_rounds
from sqlalchemy import Engine
from sqlalchemy.orm import Session
from throwaway import server_settings, throwaway_database

from outbox import api
from outbox.contracts import ContractTable
from outbox.db import create_engine
from outbox.dev.service import DeployService
from outbox.dev.tool_config import http_tool_toml
from outbox.tools import Applied, ToolCall, ToolRegistry, tool
from outbox.tools.http import load_http_tools
from outbox.workers.dispatch import DispatchConfig, Outcome, dispatch
from outbox.workers.locking import DispatchLocks

#: The two ways of the lock step, by case name.
WAYS = {"one statement": True, "two statements": False}


def _registry(service_url: str, workdir: Path) -> ToolRegistry:
    registry = ToolRegistry(ContractTable())
    config = workdir / "tools.toml"
    config.write_text(http_tool_toml(service_url, "http.plain", lookup=False), encoding="utf-8")
    for loaded in load_http_tools(config):
        registry.register(loaded)

    def answer(call: ToolCall) -> Applied:
        return Applied(f"ref-{call.operation_id}")

    tool("python.plain", registry=registry)(answer)
    return registry


def _enqueue(engine: Engine, tool_name: str, ops: int) -> list[str]:
    with Session(engine) as session, session.begin():
        return [
            str(api.enqueue(session, tool=tool_name, target=f"t{n % 4}", payload={"n": n}).id)
            for n in range(ops)
        ]


def _run(
    engine: Engine, registry: ToolRegistry, tool_name: str, way: str, args: argparse.Namespace
) -> Mapping[str, tuple[float, str]]:
    ids = _enqueue(engine, tool_name, args.ops)
    todo: queue.SimpleQueue[str] = queue.SimpleQueue()
    for op_id in ids:
        todo.put(op_id)
    config = DispatchConfig(send_at_lock=WAYS[way])
    confirmed = [0] * args.threads

    def work(slot: int) -> None:
        with DispatchLocks(engine) as locks:
            while True:
                try:
                    op_id = todo.get_nowait()
                except queue.Empty:
                    return
                report = dispatch(
                    op_id, engine=engine, registry=registry, config=config, locks=locks
                )
                if report.outcome is Outcome.CONFIRMED:
                    confirmed[slot] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(args.threads)]
    cpu_before, started = time.process_time(), time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed, cpu_after = time.perf_counter() - started, time.process_time()
    if sum(confirmed) != len(ids):
        raise SystemExit(f"{tool_name}, {way}: {sum(confirmed)} of {len(ids)} confirmed")
    cpu = cpu_after - cpu_before
    name = f"{tool_name}, {way}"
    return {name: (len(ids) / elapsed, "ops/s"), f"{name}: CPU": (cpu / len(ids) * 1000, "ms/op")}


def _case(
    engine: Engine,
    registry: ToolRegistry,
    tool_name: str,
    way: str,
    *,
    section: str,
    args: argparse.Namespace,
) -> Case:
    return Case(
        f"{tool_name}, {way}", lambda: _run(engine, registry, tool_name, way, args), section
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--ops", type=int, default=600, help="operations per case and round")
    parser.add_argument("--threads", type=int, default=1, help="dispatching threads")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.ops = 1, 40
    results = Results("the lock step: the `sent` move in it, or a statement of its own")
    with contextlib.ExitStack() as stack:
        db_url = stack.enter_context(throwaway_database(args.url))
        engine = create_engine(db_url, pool_size=args.threads + 4, max_overflow=8)
        stack.callback(engine.dispose)
        service = stack.enter_context(DeployService(port=0))
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        registry = _registry(service.url, workdir)
        cases = [
            _case(engine, registry, tool_name, way, section=section, args=args)
            for tool_name, section in (
                ("python.plain", "no remote"),
                ("http.plain", "reference service (HTTP)"),
            )
            for way in WAYS
        ]
        run_rounds(args.rounds, cases, results)
    for tool_name, remote in (("python.plain", "no remote"), ("http.plain", "reference service")):
        results.ratio(
            f"one statement / two, {remote}",
            f"{tool_name}, one statement",
            f"{tool_name}, two statements",
        )
        results.ratio(
            f"CPU one statement / two, {remote}",
            f"{tool_name}, one statement: CPU",
            f"{tool_name}, two statements: CPU",
        )
    results.note(
        f"{args.threads} threads, {args.ops} operations per case and round; medians over "
        "rounds, ratios within each round; CPU is this process's (the dispatcher, and the "
        "reference service's, which runs in it)."
    )
    results.note(server_settings(args.url))
    print_table(results)
    write_json(args.json, [results], vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
