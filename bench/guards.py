"""The guards' cost on the dispatcher's hot path: throughput with a breaker, a rate limit and a
concurrency cap declared (none of them binding) against the same tool with none, side by side
in each round; and a breaker with a rate limit, without a cap.

Operations are enqueued first, then ``--threads`` threads each run :func:`dispatch` on them
(the lock, the ``sent`` commit, the call, the outcome's commit: the worker's whole attempt,
without the broker) until none is left; the rate is operations confirmed per second. Two
remotes: the reference service over HTTP (in this process: a fast remote), and a Python tool
that answers at once (no remote at all: the guards' statements are then the largest share of
an attempt, the worst case). The guards are per target, on ``--targets`` targets.
Target: with guards at least 0.9x without, against the reference service.

Usage: python bench/guards.py [--url postgresql://...] [--rounds 3] [--ops 600] [--threads 8]
[--targets 4] [--smoke]
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

# The bench directory is not a package: `python bench/guards.py` puts it on sys.path.
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
from outbox.tools import Applied, Breaker, Concurrency, Rate, ToolCall, ToolRegistry, tool
from outbox.tools.http import load_http_tools
from outbox.workers.dispatch import Outcome, dispatch

GUARDS_TOML = """
[tools."{name}".breaker]
failures = 5
[tools."{name}".rate]
per_second = 1000000
burst = 100000
"""
CAP_TOML = """
[tools."{name}".concurrency]
max_in_flight = 10000
"""
GUARDS = {
    "breaker": Breaker(failures=5),
    "rate": Rate(per_second=1_000_000, burst=100_000),
    "concurrency": Concurrency(max_in_flight=10_000),
}


def _registry(service_url: str, workdir: Path) -> ToolRegistry:
    """Five tools: HTTP and Python, each with every guard and with none; and HTTP with a
    breaker and a rate limit but no cap (whose admission needs no transaction)."""
    registry = ToolRegistry(ContractTable())
    config = workdir / "tools.toml"
    config.write_text(
        http_tool_toml(service_url, "http.plain", lookup=False)
        + http_tool_toml(service_url, "http.guarded", lookup=False)
        + GUARDS_TOML.format(name="http.guarded")
        + CAP_TOML.format(name="http.guarded")
        + http_tool_toml(service_url, "http.no_cap", lookup=False)
        + GUARDS_TOML.format(name="http.no_cap"),
        encoding="utf-8",
    )
    for loaded in load_http_tools(config):
        registry.register(loaded)

    def answer(call: ToolCall) -> Applied:
        return Applied(f"ref-{call.operation_id}")

    tool("python.plain", registry=registry)(answer)
    tool("python.guarded", registry=registry, **GUARDS)(answer)  # type: ignore[arg-type]
    return registry


def _enqueue(engine: Engine, tool_name: str, ops: int, targets: int) -> list[str]:
    with Session(engine) as session, session.begin():
        return [
            str(api.enqueue(session, tool=tool_name, target=f"t{n % targets}", payload={"n": n}).id)
            for n in range(ops)
        ]


def _throughput(
    engine: Engine, registry: ToolRegistry, tool_name: str, args: argparse.Namespace
) -> Mapping[str, tuple[float, str]]:
    ids = _enqueue(engine, tool_name, args.ops, args.targets)
    todo: queue.SimpleQueue[str] = queue.SimpleQueue()
    for op_id in ids:
        todo.put(op_id)
    confirmed = [0] * args.threads

    def work(slot: int) -> None:
        while True:
            try:
                op_id = todo.get_nowait()
            except queue.Empty:
                return
            if dispatch(op_id, engine=engine, registry=registry).outcome is Outcome.CONFIRMED:
                confirmed[slot] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(args.threads)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if sum(confirmed) != len(ids):
        raise SystemExit(f"{tool_name}: {sum(confirmed)} of {len(ids)} confirmed")
    return {tool_name: (len(ids) / elapsed, "ops/s")}


def _case(
    engine: Engine, registry: ToolRegistry, name: str, section: str, args: argparse.Namespace
) -> Case:
    return Case(name, lambda: _throughput(engine, registry, name, args), section)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_arguments(parser)
    parser.add_argument("--ops", type=int, default=600, help="operations per case and round")
    parser.add_argument("--threads", type=int, default=8, help="dispatching threads")
    parser.add_argument("--targets", type=int, default=4, help="targets the operations spread on")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.ops = 1, 60
    results = Results("guards on the dispatch hot path")
    with contextlib.ExitStack() as stack:
        db_url = stack.enter_context(throwaway_database(args.url))
        engine = create_engine(db_url, pool_size=args.threads + 4, max_overflow=8)
        stack.callback(engine.dispose)
        service = stack.enter_context(DeployService(port=0))
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        registry = _registry(service.url, workdir)
        cases = [
            _case(engine, registry, name, section, args)
            for name, section in (
                ("http.plain", "reference service (HTTP)"),
                ("http.guarded", "reference service (HTTP)"),
                ("http.no_cap", "reference service (HTTP)"),
                ("python.plain", "no remote"),
                ("python.guarded", "no remote"),
            )
        ]
        run_rounds(args.rounds, cases, results)
    results.ratio("guarded / plain, reference service", "http.guarded", "http.plain")
    results.ratio("breaker + rate / plain, reference service", "http.no_cap", "http.plain")
    results.ratio("guarded / plain, no remote", "python.guarded", "python.plain")
    results.target(
        "guards declared >= 0.9x none (reference service)",
        "guarded / plain, reference service",
        at_least=0.9,
    )
    results.note(
        f"{args.threads} threads, {args.ops} operations per case and round on {args.targets} "
        "targets; medians over rounds, ratios within each round. The service runs in this "
        "process and shares its cores."
    )
    results.note(server_settings(args.url))
    print_table(results)
    write_json(args.json, [results], vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
