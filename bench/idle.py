"""What an idle stack costs: relay, one worker and beat, nothing enqueued, CPU from /proc.

Per broker (the database broker, then RabbitMQ when one answers on 127.0.0.1:5672), on a
throw-away database (and vhost): starts ``outbox relay``, ``outbox worker`` and ``outbox
beat`` as real processes (as ``outbox up`` runs them), lets them settle for ``--settle``
seconds, then samples the CPU of each process and its children from ``/proc`` over
``--seconds`` (60 by default) with nothing enqueued, and prints it in % of one core per
component, the PostgreSQL server processes of that database, and the total of the stack.

The database broker's latency at a steady 10/s is measured by ``bench/pipeline.py --broker
database --mode steady --rate 10`` (docs/performance.md, entry 32).

Usage: python bench/idle.py [--url postgresql://...] [--seconds 60] [--settle 10]
       [--broker database|rabbitmq|both] [--rounds 1] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import sqlalchemy

# The bench directory is not a package: `python bench/idle.py` puts it on sys.path.
from arguments import add_common_arguments
from cpu import CpuMeter
from report import Results, print_table, say, write_json
from sqlalchemy import text
from throwaway import rabbitmq_available, server_settings, throwaway_database, throwaway_vhost

from outbox.db import normalize_url
from outbox.dev.stack import Services
from outbox.dev.tool_config import http_tool_toml

CORE = "% core"
COMPONENTS = ("relay", "worker", "beat")


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants now (a prefork worker's children, say)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def _postgres_pids(engine: sqlalchemy.Engine) -> list[int]:
    """Server processes of this database's connections (not other databases' backends)."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")
        )
        own = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        return [int(pid) for (pid,) in rows if pid != own]


def measure(
    broker: str, db_url: str, broker_url: str | None, args: argparse.Namespace, workdir: Path
) -> dict[str, float]:
    """One round: start the stack, settle, measure ``--seconds``; {group: % of one core}."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    # A worker needs a tool; nothing is enqueued, so nothing ever calls it.
    tools = workdir / "tools.toml"
    tools.write_text(http_tool_toml("http://127.0.0.1:9"), encoding="utf-8")
    env |= {
        "OUTBOX_DATABASE_URL": db_url,
        "OUTBOX_HOME": str(workdir / "home"),
        "OUTBOX_CONFIG": str(tools),
    }
    if broker_url is not None:
        env["OUTBOX_BROKER_URL"] = broker_url
    stack = Services(env, workdir)
    engine = sqlalchemy.create_engine(normalize_url(db_url))
    try:
        for name in COMPONENTS:
            stack.start(name, name, "--log-level", "WARNING")
        time.sleep(args.settle)  # imports, connections, the first polls: not the idle cost
        pids = {s.name: s.pid for s in stack.started}
        for service in stack.started:
            if not service.alive():
                raise RuntimeError(f"{broker}: {service.name} exited during start-up")
        groups: dict[str, Callable[[], Iterable[int]]] = {
            name: functools.partial(_tree, pids[name]) for name in COMPONENTS
        }
        groups["postgres (this database)"] = functools.partial(_postgres_pids, engine)
        meter = CpuMeter(groups)
        meter.start()
        time.sleep(args.seconds)
        usage = meter.stop()
    finally:
        stack.stop_all()
        engine.dispose()
        for name, output in stack.logs():
            lines = output.splitlines()
            if not args.show_logs:
                lines = [line for line in lines if "ERROR" in line or "Traceback" in line]
            for line in lines[-10:]:
                say(f"--- {broker}, {name}: {line}")
    usage["stack (relay + worker + beat)"] = sum(usage[name] for name in COMPONENTS)
    return usage


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, rounds=1)
    parser.add_argument("--broker", choices=["database", "rabbitmq", "both"], default="both")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured idle time")
    parser.add_argument("--show-logs", action="store_true", help="the processes' last lines")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds before measuring")
    return parser


def _brokers(choice: str) -> Iterable[str]:
    if choice in ("database", "both"):
        yield "database"
    if choice in ("rabbitmq", "both") and rabbitmq_available():
        yield "rabbitmq"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.smoke:
        args.seconds, args.settle, args.rounds = 5.0, 5.0, 1
    results = Results(
        f"idle stack: relay, one worker, beat, nothing enqueued; CPU over {args.seconds:g} s "
        f"in % of one core (from /proc), {args.rounds} round(s)"
    )
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-idle-")))
        for broker in _brokers(args.broker):
            vhost = stack.enter_context(throwaway_vhost()) if broker == "rabbitmq" else None
            for round_ in range(1, args.rounds + 1):
                db_url = stack.enter_context(throwaway_database(args.url))
                home = workdir / f"{broker}-{round_}"
                home.mkdir()
                say(f"{broker}, round {round_}: measuring {args.seconds:g} s")
                try:
                    usage = measure(broker, db_url, vhost, args, home)
                except RuntimeError as exc:
                    say(f"FAILED: {exc}")
                    return 1
                for name, percent in usage.items():
                    results.add(name, percent, unit=CORE, section=broker)
    results.note(
        "Each component with its children; postgres: the server processes of the stack's "
        "database connections; the machine's other load is not counted."
    )
    results.note(server_settings(args.url))
    print_table(results)
    write_json(args.json, [results], vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
