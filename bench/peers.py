"""Peers side by side: the same job on naive Celery, Procrastinate, DBOS and ours, in one run.

The job, identical for every system: ``--intents`` operations, each "record the intent
durably, POST once to the reference service with a stable idempotency key, record the result
in the database" (:mod:`peer_drivers.job`). The reference service runs in a process of its own
in its fast configuration (in-memory ledger, no faults, no dedup), as for bench/pipeline.py:
it notes when each key's first request arrived and counts effects per key.

The systems (``--systems``, default all; one module each in ``bench/peer_drivers/``, whose
docstrings say exactly how each is driven and configured):

* ``ours``: bench/pipeline.py's ``Pipeline`` itself (relay + workers, RabbitMQ);
* ``ours-traced``: the same with OpenTelemetry tracing on at 100 % (agents' spans, relay and
  workers exporting OTLP/HTTP to a receiver in its own process): tracing's cost, beside
  ``ours`` in the same rounds (not a default: ask for it);
* ``ours-db``: ours on the database broker, what runs with nothing configured (``make demo``,
  ``outbox up`` on the embedded PostgreSQL), beside ``ours`` on RabbitMQ (ask for it);
* ``celery``: naive Celery, no outbox: COMMIT the intent, then ``task.delay(id)``;
* ``procrastinate``: the job deferred in the intent's own transaction (PostgreSQL queue);
* ``dbos``: a DBOS workflow (transaction, step, transaction) enqueued on a DBOS queue.

Every system gets the same worker budget: ``--workers`` processes (default 2, one per core
here) of ``--concurrency`` jobs in flight each (default 8), as real subprocesses, warmed up
before the clock starts; its own throw-away database(s) (and RabbitMQ vhost where it uses one).

Per system, load and round (a *case*: one system's workers started, warmed, measured,
stopped; :mod:`peer_drivers.base`), agent threads make the intents, each with its own
connection, one intent per transaction: the largest of ``--agents`` (default ``8,1``: eight)
in every load, and each smaller count in a flat load of its own (``flat, 1 agent``: one
agent's stream, where its enqueue alone bounds the throughput):

* flat: as fast as they can; throughput = results / (last result recorded - first intent
  commit), ops/s; and the enqueue rate the agents offered, intents / (last commit - first);
* steady at ``--rate`` intents/s in total: latency from the intent's commit (``time.time()``
  right after the agent's COMMIT returned) to the request arriving at the service (its clock,
  the same host's), p50 / p95 / p99; and to the result being recorded (``clock_timestamp()``
  in the result's transaction). A system whose capacity is below ``--rate`` cannot keep up:
  its steady latencies then measure a backlog that grows with ``--intents``; its ``steady:
  throughput`` row shows it and a note under the table says so.

The cases run **interleaved**: every case once per round, the starting case rotating from
round to round (``rounds.run_rounds``), so a noisy machine disturbs all systems alike. The
ratio rows divide ours by each peer **round by round** and then take the median (above 1:
ours has more throughput; below 1: ours has the lower latency).

Every case checks that each intent reached the service exactly once (``effects_by_key``) and
has its result recorded; otherwise the problems are printed and the script exits 1 (after the
table). A system whose package is not installed is skipped with a line saying so (install the
peers with ``pip install -e '.[bench]'``). Databases, vhosts and processes are removed at the
end, also on a failure, Ctrl-C or SIGTERM.

Usage: python bench/peers.py [--url postgresql://...] [--rounds 3] [--intents 3000]
       [--rate 100] [--agents 8,1] [--workers 2] [--concurrency 8]
       [--systems ours,celery,procrastinate,dbos] [--broker-url amqp://...] [--dbos-poll 0.1]
       [--loads flat,steady,alone] [--contend PCT] [--smoke] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

# The bench directory is not a package: `python bench/peers.py` puts it on sys.path.
from arguments import add_common_arguments, add_contend_argument
from otlp_sink import OtlpSink
from peer_drivers.base import Load, Settings, System, stop_stray_children, tell
from report import Results, print_table, write_json
from rich.markup import escape
from rounds import run_rounds
from services import ServiceProcess
from throwaway import (
    rabbitmq_available,
    server_settings,
    sigterm_as_interrupt,
    throwaway_database,
    throwaway_vhost,
)

SYSTEMS = ("ours", "ours-traced", "ours-db", "celery", "procrastinate", "dbos")
#: What runs when --systems is not given (tracing's cost and the database broker are asked
#: for by name).
DEFAULT_SYSTEMS = ("ours", "celery", "procrastinate", "dbos")
#: The package each system needs beyond our own dependencies.
PACKAGES = {
    "ours-traced": "opentelemetry.sdk",
    "celery": "celery",
    "procrastinate": "procrastinate",
    "dbos": "dbos",
}
INSTALL = "pip install -e '.[bench]'"


def _chosen(value: str, allowed: Sequence[str], what: str) -> list[str]:
    """The comma-separated names of ``value``, each once, in order; an argparse error naming
    the unknown ones (``what``: "system", "load") and the choices."""
    chosen = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in allowed]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown {what}(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(allowed)}"
        )
    return list(dict.fromkeys(chosen))


def _systems(value: str) -> list[str]:
    return _chosen(value, SYSTEMS, "system")


def _agent_counts(value: str) -> list[int]:
    try:
        counts = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a comma-separated list of agent thread counts (each >= 1)"
        )
    return sorted(set(counts), reverse=True)


#: The loads a run may be limited to (``--loads``): flat (every agent count), steady, the
#: enqueue alone.
LOAD_KINDS = ("flat", "steady", "alone")


def _load_kinds(value: str) -> list[str]:
    return _chosen(value, LOAD_KINDS, "load")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--intents", type=int, default=3000, help="per system, load and round")
    parser.add_argument("--rate", type=float, default=100.0, help="steady: intents/s in all")
    parser.add_argument(
        "--agents",
        type=_agent_counts,
        default=[8, 1],
        help="agent threads (connections), comma-separated: the largest in every load, each "
        "smaller count in a flat load of its own (default 8,1)",
    )
    parser.add_argument("--workers", type=int, default=2, help="worker processes per system")
    parser.add_argument("--concurrency", type=int, default=8, help="jobs in flight per worker")
    parser.add_argument(
        "--systems",
        type=_systems,
        default=list(DEFAULT_SYSTEMS),
        help=f"comma-separated, from {','.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)})",
    )
    parser.add_argument("--broker-url", help="an AMQP URL to use as it is (no vhost is made)")
    parser.add_argument(
        "--dbos-poll",
        type=float,
        default=0.1,
        help="DBOS queue polling interval, s (default %(default)s; DBOS's own default is 1)",
    )
    parser.add_argument("--log-level", default="WARNING", help="the workers' log level")
    parser.add_argument(
        "--loads",
        type=_load_kinds,
        default=list(LOAD_KINDS),
        help=f"comma-separated, from {','.join(LOAD_KINDS)} (default: all)",
    )
    add_contend_argument(parser)
    return parser


def _available(names: Sequence[str], rabbitmq: bool, results: Results) -> list[str]:
    """``names`` less the systems that cannot run here, each skipped with a line saying why."""
    kept = []
    for name in names:
        package = PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            line = f"{name}: skipped, {package} is not installed ({INSTALL})"
        elif name == "celery" and not rabbitmq:
            line = f"{name}: skipped, no RabbitMQ on 127.0.0.1:5672 (or no rabbitmqctl)"
        else:
            kept.append(name)
            continue
        tell(line)
        results.note(escape(line))  # the table prints notes as rich markup
    return kept


def _build(
    name: str, settings: Settings, args: argparse.Namespace, stack: contextlib.ExitStack
) -> System:
    """The system ``name`` on throw-away databases (and vhost), removed by ``stack``."""
    system: System
    if name in ("ours", "ours-traced", "ours-db"):
        from peer_drivers.ours import Ours  # noqa: PLC0415 -- only what is chosen is imported

        rabbitmq = name != "ours-db" and (bool(args.broker_url) or rabbitmq_available())
        broker = stack.enter_context(throwaway_vhost(args.broker_url)) if rabbitmq else None
        system = Ours(
            settings,
            database_url=stack.enter_context(throwaway_database(args.url)),
            broker_url=broker,
            sink=stack.enter_context(OtlpSink()) if name == "ours-traced" else None,
            database_broker=name == "ours-db",
        )
    elif name == "celery":
        from peer_drivers.naive_celery import NaiveCelery  # noqa: PLC0415

        system = NaiveCelery(
            settings,
            database_url=stack.enter_context(throwaway_database(args.url, migrated=False)),
            broker_url=stack.enter_context(throwaway_vhost(args.broker_url)),
        )
    elif name == "procrastinate":
        from peer_drivers.procrastinate_peer import Procrastinate  # noqa: PLC0415

        system = Procrastinate(
            settings, database_url=stack.enter_context(throwaway_database(args.url, migrated=False))
        )
    else:
        from peer_drivers.dbos_peer import Dbos  # noqa: PLC0415

        system = Dbos(
            settings,
            system_url=stack.enter_context(throwaway_database(args.url, migrated=False)),
            app_url=stack.enter_context(throwaway_database(args.url, migrated=False)),
            poll_s=args.dbos_poll,
        )
    stack.callback(system.close)
    return system


def _ours(systems: Sequence[System]) -> list[System]:
    """Our systems in the run (``ours`` first), each compared with every peer."""
    return sorted((s for s in systems if s.key.startswith("ours")), key=lambda s: s.key != "ours")


def _name(system: System) -> str:
    """How a ratio row names one of ours: ``ours``, ``ours (database broker)``..."""
    return "ours" if system.key == "ours" else system.label


def _ratios(results: Results, systems: Sequence[System]) -> None:
    """Each of ours / each other system, round by round: flat throughput and enqueue rate,
    the enqueue alone, and steady commit -> arrival p50 and p99."""
    ours_all = _ours(systems)
    prefixes = {row.rsplit(": ", 1)[0] for _, row in results.rows}
    flats = sorted(p for p in prefixes if p.startswith("flat"))
    alones = sorted(p for p in prefixes if p.startswith("enqueue alone"))
    for ours in ours_all:
        # Each pair once: ours against the peers and against the later of our own systems.
        others = [s for s in systems if s is not ours and s not in ours_all[: ours_all.index(ours)]]
        for peer in others:
            for flat in flats:
                for what, row in (
                    ("throughput", "throughput"),
                    ("enqueue rate", "enqueue rate (offered)"),
                ):
                    results.ratio(
                        f"{flat} {what}: {_name(ours)} / {peer.label}",
                        (ours.label, f"{flat}: {row}"),
                        (peer.label, f"{flat}: {row}"),
                    )
            for alone in alones:
                results.ratio(
                    f"{alone} enqueue rate: {_name(ours)} / {peer.label}",
                    (ours.label, f"{alone}: enqueue rate"),
                    (peer.label, f"{alone}: enqueue rate"),
                )
            for q in (50, 99):
                row = f"steady: commit -> arrival p{q}"
                results.ratio(
                    f"steady arrival p{q}: {_name(ours)} / {peer.label}",
                    (ours.label, row),
                    (peer.label, row),
                )


def _targets(results: Results, systems: Sequence[System], loads: Sequence[str]) -> None:
    """Issues 7's and 35's targets of the ``loads`` this run measured (``--loads``), each
    said plainly: met or not."""
    labels = {system.key: system.label for system in systems}
    flat, steady, alone = ("flat" in loads), ("steady" in loads), ("alone" in loads)
    if "ours" in labels and flat:
        # Issue 7's, for ours on RabbitMQ.
        for key, bound in (("celery", 1.2), ("procrastinate", 2.0), ("dbos", 4.0)):
            if key in labels:
                results.target(
                    f"flat throughput >= {bound:g}x {labels[key]}",
                    ("ratios", f"flat throughput: ours / {labels[key]}"),
                    at_least=bound,
                )
    for ours in _ours(systems):
        name = _name(ours)
        # Issue 35's, for each of ours.
        for key, bound in (("procrastinate", 1.5), ("celery", 1.0)):
            if key in labels and flat:
                results.target(
                    f"{name}: flat throughput >= {bound:g}x {labels[key]}",
                    ("ratios", f"flat throughput: {name} / {labels[key]}"),
                    at_least=bound,
                )
        if "procrastinate" in labels and steady:
            results.target(
                f"{name}: steady commit -> arrival p50 <= {labels['procrastinate']}'s",
                ("ratios", f"steady arrival p50: {name} / {labels['procrastinate']}"),
                at_most=1.0,
            )
        if steady:
            results.target(
                f"{name}: steady commit -> arrival p99 <= 15 ms",
                (ours.label, "steady: commit -> arrival p99"),
                at_most=15.0,
            )
        # The agent's own act, enqueue + commit on its connection, against the peers' same
        # act (Procrastinate's defer, DBOS's enqueue), with no worker sharing the CPU.
        for key in ("procrastinate", "dbos"):
            if key in labels and alone:
                results.target(
                    f"{name}: enqueue + commit alone, 1 agent >= 1.0x {labels[key]}",
                    ("ratios", f"enqueue alone, 1 agent enqueue rate: {name} / {labels[key]}"),
                    at_least=1.0,
                )
    if "ours" in labels and "ours-db" in labels and steady:
        row = "steady: commit -> arrival p50"
        results.ratio(
            f"steady arrival p50: {labels['ours-db']} / {labels['ours']}",
            (labels["ours-db"], row),
            (labels["ours"], row),
        )
        results.target(
            f"{labels['ours-db']} steady p50 <= 2x {labels['ours']}'s",
            ("ratios", f"steady arrival p50: {labels['ours-db']} / {labels['ours']}"),
            at_most=2.0,
        )


def _spans_received(results: Results, systems: Sequence[System], intents: int) -> None:
    """For a traced system: the spans its OTLP receiver decoded, said under the table; a
    problem if no dispatch span arrived (tracing was not on, so its figures mean nothing)."""
    for system in systems:
        sink = getattr(system, "sink", None)
        if sink is None:
            continue
        spans = sink.spans()
        total = sum(spans.values())
        top = ", ".join(f"{name} {count}" for name, count in sorted(spans.items()))
        results.note(
            f"{system.label}: {total:,} spans received for {intents:,} measured intents "
            f"(and warm-ups): {top or 'none'}"
        )
        if not spans.get("outbox.dispatch"):
            system.problems.append(f"{system.label}: no outbox.dispatch span was received")


def _notes(results: Results, systems: Sequence[System], rate: float) -> None:
    """What to read the table with: a system that could not keep up, the clocks, the ratios."""
    for system in systems:
        steady = results.find((system.label, "steady: throughput"))
        if steady is not None and steady.values and min(steady.values) < 0.95 * rate:
            results.note(
                f"{system.label} did not keep up with {rate:g}/s in some round: its steady "
                "latencies include a backlog that grows with --intents (compare at a lower --rate)"
            )
    results.note(
        "Latency: from the agent's commit (time.time() after COMMIT returned) to the request "
        "reaching the service; result: to the result's clock_timestamp(). One host, one clock."
    )
    results.note(
        "Ratios, ours / peer, per round then the median: throughput above 1 and latency below "
        "1 mean ours is better."
    )


def _loads(args: argparse.Namespace) -> list[Load]:
    """Flat and steady with the most agent threads; flat again with each smaller count; the
    enqueue alone with one agent thread and with the most (issue 35's ``enqueue`` + commit)."""
    _, *fewer = args.agents  # largest first
    flat = [Load(None), *(Load(None, agents=n) for n in fewer)] if "flat" in args.loads else []
    steady = [Load(args.rate)] if "steady" in args.loads else []
    alone = (
        [Load(None, agents=n, alone=True) for n in sorted({1, args.agents[0]})]
        if "alone" in args.loads
        else []
    )
    return [*flat, *steady, *alone]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.smoke:
        args.rounds, args.intents, args.rate = 1, 100, 100.0
    logging.getLogger("amqp").setLevel(logging.ERROR)
    rabbitmq = bool(args.broker_url) or rabbitmq_available()
    loads = _loads(args)
    results = Results(
        f"peers: {args.intents} intents per case, {'/'.join(map(str, args.agents))} agents, "
        f"{args.workers} workers "
        f"x {args.concurrency} per system, steady at {args.rate:g}/s, {args.rounds} rounds"
    )
    cpu = Results("CPU while measuring, in % of one core (from /proc; rabbitmq: the whole broker)")
    names = _available(args.systems, rabbitmq, results)
    if not names:
        tell("nothing to run")
        return 2
    systems: list[System] = []
    failed = False
    try:
        with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-peers-")))
            service = stack.enter_context(ServiceProcess(port=0, record_arrivals=True))
            settings = Settings(
                intents=args.intents,
                agents=args.agents[0],
                workers=args.workers,
                concurrency=args.concurrency,
                service=service,
                workdir=workdir,
                cpu=cpu,
                log_level=args.log_level,
            )
            for name in names:
                tell(f"setting up {name}")
                systems.append(_build(name, settings, args, stack))
            cases = [system.case(load) for system in systems for load in loads]
            try:
                run_rounds(args.rounds, cases, results, contend_pct=args.contend)
            except RuntimeError as exc:
                tell(f"FAILED: {exc}")
                failed = True
            _spans_received(results, systems, args.intents * args.rounds * len(loads))
            tell("cleaning up")
    except KeyboardInterrupt:
        tell("interrupted: workers stopped, databases and vhosts removed")
        return 130
    finally:
        strays = stop_stray_children()
        if strays:
            tell(f"stopped {len(strays)} stray worker process(es): {strays}")
    if any(s.key == "ours" and getattr(s, "broker", None) == "database" for s in systems):
        results.note("ours ran on the database broker: no RabbitMQ was reachable")
    _ratios(results, systems)
    _targets(results, systems, args.loads)
    _notes(results, systems, args.rate)
    results.note(server_settings(args.url))
    print_table(results)
    print_table(cpu)
    write_json(args.json, [results, cpu], vars(args))
    problems = [problem for system in systems for problem in system.problems]
    for problem in problems:
        tell(f"PROBLEM: {problem}")
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
