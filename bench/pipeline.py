"""Our system end to end: agents enqueue, the relay publishes, workers call the remote.

Per configuration (broker x mode, and with ``--task-events both`` Celery's task events on and
off) and per round, on a throw-away database (and RabbitMQ
vhost), with the reference service in a process of its own (in-memory ledger, no faults, no
dedup: its fast configuration) recording when each key's first request arrived:

1. starts ``outbox relay`` and ``--workers`` x ``outbox worker -P threads -c C`` as real
   processes (as ``outbox up`` runs them; no beat: nothing in the happy path needs a sweep),
   and warms them up with one intent per worker thread, confirmed before the clock starts;
2. ``--agents`` threads, each with its own connection, enqueue ``--intents`` intents, one per
   transaction: ``flat`` as fast as they can, ``steady`` at ``--rate`` intents/s in total;
   each agent notes ``time.time()`` right after its COMMIT returned;
3. waits until every operation is ``confirmed``, then measures:

   * throughput: intents / (last ``confirmed`` - first commit), ops/s;
   * enqueue rate: intents / (last commit - first commit), what the agents offered;
   * commit -> arrival: from the agent's commit to the request reaching the service;
   * commit -> confirmed: to the ``at`` of the ``confirmed`` event in ``outbox.events``
     (``clock_timestamp()`` of the outcome statement, just before its COMMIT);
   * where the time goes (p50, p99): commit -> published (the relay's claim, which stamps
     ``published_at`` since issue 35: wake-up and claim; the publish itself is now in the
     next leg) and commit -> sent (the worker's ``sent`` event: the publish and the relay's
     commit, the message's delivery, the lock, the read); sent -> arrival is the ``sent``
     commit's WAL flush and the HTTP request;
   * CPU used meanwhile by each component, in % of one core (Linux ``/proc``).

All three clocks (this process, the service's process, PostgreSQL's ``clock_timestamp()``)
are the same host's wall clock, so the differences are meaningful; use a local ``--url``.

Every round checks that every operation reached ``confirmed`` and that no key has two effects
at the service; otherwise the script prints the problems and exits 1 (after the table).

Usage: python bench/pipeline.py [--url postgresql://...] [--broker rabbitmq|database|both]
       [--mode flat|steady|both] [--rate 100] [--intents 2000] [--rounds 3]
       [--workers 2] [--concurrency 8] [--agents 8] [--task-events on|off|both] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy

# The bench directory is not a package: `python bench/pipeline.py` puts it on sys.path.
from arguments import add_common_arguments, add_contend_argument
from cpu import CpuMeter, pids_named
from otlp_sink import OtlpSink
from report import Results, print_table, say, write_json
from rounds import Case, percentile, run_rounds
from services import ServiceProcess
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session
from throwaway import (
    rabbitmq_available,
    server_settings,
    sigterm_as_interrupt,
    throwaway_database,
    throwaway_vhost,
)

from outbox import api
from outbox.db import normalize_url
from outbox.dev.stack import Services
from outbox.dev.tool_config import TOOL, http_tool_toml

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

BROKERS = ("rabbitmq", "database")
MODES = ("flat", "steady")
DECIDED = ("confirmed", "failed", "needs_human", "cancelled")
#: A round fails if no operation is decided for this long.
STALL_S = 60.0
PER_S, MS, CORE = "ops/s", "ms", "% core"


@dataclass(frozen=True)
class Config:
    """One configuration: a broker, a load shape, and whether Celery sends task events."""

    broker: str
    mode: str
    rate: float
    task_events: bool = True
    #: Tracing on at 100 %: every agent intent in a span of its own, relay and workers
    #: exporting OTLP to :class:`otlp_sink.OtlpSink` (issue 34's cost).
    traced: bool = False

    @property
    def name(self) -> str:
        """``rabbitmq, flat`` or ``database, steady 100/s, task events off, traced``."""
        load = "flat" if self.mode == "flat" else f"steady {self.rate:g}/s"
        return (
            f"{self.broker}, {load}"
            + ("" if self.task_events else ", task events off")
            + (", traced" if self.traced else "")
        )


def agent_tracer(sink_url: str) -> Tracer:
    """The agents' tracer, exporting to ``sink_url`` in batches (the SDK's defaults), as an
    application with tracing on has; installed as this process's tracer provider once, so
    outbox's own enqueue spans export too. Untraced agents open no span, so they record no
    trace context and cost what they did before."""
    from opentelemetry import trace  # noqa: PLC0415 -- only a traced run needs the SDK
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
        OTLPSpanExporter,
    )
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider(resource=Resource.create({"service.name": "bench-agent"}))
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{sink_url}/v1/traces"))
        )
        trace.set_tracer_provider(provider)
    return trace.get_tracer("bench.agent")


def flush_agent_spans() -> None:
    """Export the agents' finished spans now (end of a traced round)."""
    from opentelemetry import trace  # noqa: PLC0415

    flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if flush is not None:
        flush()


class Agents:
    """``agents`` threads enqueueing ``intents`` intents, one per transaction.

    ``rate`` None: flat out; else intent ``i`` is due ``i / rate`` seconds after the start
    (an agent that falls behind goes on at once). Returns {operation id: commit wall time}.
    """

    def __init__(
        self, engine: Engine, agents: int, rate: float | None, tracer: Tracer | None = None
    ) -> None:
        self.engine = engine
        self.agents = agents
        self.rate = rate
        #: Each intent in a span of its own (an agent's tool call), when tracing is on.
        self.tracer = tracer

    def run(self, prefix: str, intents: int) -> dict[str, float]:
        commits: dict[str, float] = {}
        errors: list[BaseException] = []
        barrier = threading.Barrier(self.agents)
        lock = threading.Lock()

        def agent(k: int) -> None:
            mine: dict[str, float] = {}
            try:
                with Session(self.engine) as session:
                    session.connection()  # the connection is open before the start
                    session.commit()
                    barrier.wait()
                    start = time.monotonic()
                    for i in range(k, intents, self.agents):
                        if self.rate is not None:
                            wait = start + i / self.rate - time.monotonic()
                            if wait > 0:
                                time.sleep(wait)
                        span = (
                            self.tracer.start_as_current_span("agent.tool_call")
                            if self.tracer is not None
                            else contextlib.nullcontext()
                        )
                        with span, session.begin():
                            op = api.enqueue(
                                session,
                                tool=TOOL,
                                target=f"project-{i % 10}",
                                payload={"version": f"1.{i // 100}.{i % 100}"},
                                intent_key=f"{prefix}-{i}",
                            )
                        mine[str(op.id)] = time.time()
            except BaseException as exc:
                errors.append(exc)
                barrier.abort()
                raise
            with lock:
                commits.update(mine)

        threads = [
            threading.Thread(target=agent, args=(k,), daemon=True) for k in range(self.agents)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise RuntimeError(f"an agent failed: {errors[0]!r}") from errors[0]
        return commits


class Pipeline:
    """Runs rounds of one configuration on its own database; the stack per round."""

    def __init__(
        self,
        config: Config,
        *,
        db_url: str,
        broker_url: str | None,
        service: ServiceProcess,
        args: argparse.Namespace,
        workdir: Path,
        cpu: Results,
        sink: OtlpSink | None = None,
    ) -> None:
        self.config = config
        self.db_url = db_url
        self.broker_url = broker_url
        self.service = service
        self.args = args
        self.workdir = workdir
        self.cpu = cpu
        self.rounds = 0
        self.problems: list[str] = []
        # The agents' engine, as an application makes one (no pre-ping: a connection per agent).
        self.engine = sqlalchemy.create_engine(
            normalize_url(db_url), pool_size=args.agents + 2, max_overflow=4
        )
        tools = workdir / "tools.toml"
        tools.write_text(
            http_tool_toml(service.url, timeout_s=30.0, send_deadline_s=10.0),
            encoding="utf-8",
        )
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        self.env |= {
            "OUTBOX_DATABASE_URL": db_url,
            "OUTBOX_CONFIG": str(tools),
            "OUTBOX_HOME": str(workdir / "home"),
        }
        if broker_url is not None:
            self.env["OUTBOX_BROKER_URL"] = broker_url
        if not config.task_events:
            self.env["OUTBOX_TASK_EVENTS"] = "false"
        self.tracer: Tracer | None = None
        self.sink = sink
        if config.traced:
            if sink is None:
                raise ValueError(f"{config.name}: a traced configuration needs an OTLP sink")
            self.env |= {
                "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_TRACES_SAMPLER": "always_on",
            }
            self.tracer = agent_tracer(sink.url)

    def case(self) -> Case:
        """This configuration as a case of :func:`run_rounds`."""
        return Case(self.config.name, self.run_round, self.config.name)

    def run_round(self) -> Mapping[str, tuple[float, str]]:
        self.rounds += 1
        self._reset()
        logs = self.workdir / f"round-{self.rounds}"
        logs.mkdir()
        stack = Services(self.env, logs)
        failed = True
        try:
            self._start(stack)
            rows = self._measure(stack)
            failed = False
            return rows
        finally:
            stack.stop_all()
            if failed or self.problems:
                for name, output in stack.logs():
                    tail = output.strip().splitlines()[-15:]
                    if tail:
                        say(f"--- {self.config.name}, round {self.rounds}, {name} ---")
                        for line in tail:
                            say(line)

    def _reset(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                text(
                    "TRUNCATE outbox.operations, outbox.events, outbox.relays, "
                    "outbox.webhook_deliveries, outbox.sagas, outbox.saga_steps, "
                    "outbox.saga_events"
                )
            )
            conn.execute(text("DROP TABLE IF EXISTS outbox_kombu_message, outbox_kombu_queue"))
        self.service.clear()

    def _start(self, stack: Services) -> None:
        level = ("--log-level", self.args.log_level)
        for i in range(1, self.args.relays + 1):
            stack.start(f"relay-{i}", "relay", "--batch-size", str(self.args.batch_size), *level)
        for i in range(1, self.args.workers + 1):
            stack.start(
                f"worker-{i}",
                *("worker", "-P", "threads", "-c", str(self.args.concurrency)),
                *("-Q", self.args.queues),
                *("-n", f"bench{i}@%h", *level),
            )
        # Warm up: every worker thread, the relay, the HTTP connections; then the clock.
        warm = self.args.workers * self.args.concurrency
        warming = Agents(self.engine, min(self.args.agents, warm), None, self.tracer)
        warming.run(f"warm-{self.rounds}", warm)
        self._wait_decided(warm, stack, "warming up")
        self.service.clear()

    def _measure(self, stack: Services) -> dict[str, tuple[float, str]]:
        args, config = self.args, self.config
        warm = args.workers * args.concurrency
        processes = {s.name: s.pid for s in stack.started}
        groups = {
            "agents (this process)": lambda: [os.getpid()],
            "relay": lambda: [p for n, p in processes.items() if n.startswith("relay")],
            "workers": lambda: [p for n, p in processes.items() if n.startswith("worker")],
            "service": lambda: [self.service.pid],
            "postgres (this database, background)": self._postgres_pids,
        }
        if config.broker == "rabbitmq":
            groups["rabbitmq"] = lambda: pids_named("beam.smp")
        meter = CpuMeter(groups)
        meter.start()
        rate = config.rate if config.mode == "steady" else None
        agents = Agents(self.engine, args.agents, rate, self.tracer)
        commits = agents.run(f"bench-{self.rounds}", args.intents)
        self._wait_decided(warm + args.intents, stack, "measuring")
        usage = meter.stop()
        if self.tracer is not None:
            flush_agent_spans()
        for name, percent in usage.items():
            self.cpu.add(name, percent, unit=CORE, section=config.name)
        return self._rows(commits)

    def _postgres_pids(self) -> list[int]:
        """Server processes of this database's connections and the background processes
        (WAL writer, checkpointer...), not other databases' backends; meaningful only when the
        server runs on this host."""
        with self.engine.connect() as conn:
            return [
                int(pid)
                for (pid,) in conn.execute(
                    text(
                        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                        "OR backend_type <> 'client backend'"
                    )
                )
            ]

    def _rows(self, commits: dict[str, float]) -> dict[str, tuple[float, str]]:
        arrivals = self.service.arrivals()
        with self.engine.connect() as conn:
            confirmed = {
                str(op): float(at)
                for op, at in conn.execute(
                    text(
                        "SELECT operation_id, extract(epoch FROM at) FROM outbox.events "
                        "WHERE to_state = 'confirmed'"
                    )
                )
            }
            # Where the time goes: the relay's record of the broker's confirm, and the
            # worker's `sent` commit (both database clock, like the `confirmed` event).
            stages = {
                str(op): (float(published), float(sent))
                for op, published, sent in conn.execute(
                    text(
                        "SELECT o.id, extract(epoch FROM o.published_at), "
                        "extract(epoch FROM e.at) FROM outbox.operations o "
                        "JOIN outbox.events e ON e.operation_id = o.id AND e.to_state = 'sent' "
                        "WHERE o.published_at IS NOT NULL"
                    )
                )
            }
            states: dict[str, int] = {
                str(state): int(count)
                for state, count in conn.execute(
                    text("SELECT state, count(*) FROM outbox.operations GROUP BY state")
                )
            }
        self._check(commits, arrivals, confirmed, states)
        to_arrival = [1000 * (arrivals[op] - t) for op, t in commits.items() if op in arrivals]
        to_confirmed = [1000 * (confirmed[op] - t) for op, t in commits.items() if op in confirmed]
        first, last_commit = min(commits.values()), max(commits.values())
        last_confirmed = max((confirmed[op] for op in commits if op in confirmed), default=first)
        rows = {
            "throughput": (len(to_confirmed) / max(last_confirmed - first, 1e-9), PER_S),
            "enqueue rate (offered)": (len(commits) / max(last_commit - first, 1e-9), PER_S),
        }
        for q in (50, 95, 99):
            rows[f"commit -> arrival p{q}"] = (percentile(to_arrival, q), MS)
        for q in (50, 95, 99):
            rows[f"commit -> confirmed p{q}"] = (percentile(to_confirmed, q), MS)
        timed = [(t, *stages[op]) for op, t in commits.items() if op in stages]
        for q in (50, 99) if timed else ():
            rows[f"stage p{q}: commit -> published"] = (
                percentile([1000 * (published - t) for t, published, _ in timed], q),
                MS,
            )
            rows[f"stage p{q}: commit -> sent"] = (
                percentile([1000 * (sent - t) for t, _, sent in timed], q),
                MS,
            )
        return rows

    def _check(
        self,
        commits: Mapping[str, float],
        arrivals: Mapping[str, float],
        confirmed: Mapping[str, float],
        states: Mapping[str, int],
    ) -> None:
        where = f"{self.config.name}, round {self.rounds}"
        missing = [op for op in commits if op not in confirmed]
        if missing:
            self.problems.append(f"{where}: {len(missing)} operations not confirmed ({states})")
        unseen = [op for op in commits if op in confirmed and op not in arrivals]
        if unseen:
            self.problems.append(f"{where}: {len(unseen)} confirmed without a request arriving")
        doubles = {key: n for key, n in self.service.effects_by_key().items() if n > 1}
        if doubles:
            self.problems.append(f"{where}: {len(doubles)} keys with more than one effect")

    def _wait_decided(self, expected: int, stack: Services, what: str) -> None:
        """Until ``expected`` operations are decided; a problem if it stalls or a process died."""
        last, last_change = -1, time.monotonic()
        while True:
            with self.engine.connect() as conn:
                decided = conn.execute(
                    text("SELECT count(*) FROM outbox.operations WHERE state = ANY(:states)"),
                    {"states": list(DECIDED)},
                ).scalar_one()
            if decided >= expected:
                return
            if decided != last:
                last, last_change = decided, time.monotonic()
            dead = [s.name for s in stack.started if not s.alive()]
            stalled = time.monotonic() - last_change > STALL_S
            if dead or stalled:
                why = f"{', '.join(dead)} exited" if dead else f"no progress for {STALL_S:g}s"
                raise RuntimeError(
                    f"{self.config.name}, round {self.rounds}, {what}: {why} "
                    f"({decided} of {expected} decided)"
                )
            time.sleep(0.05)

    def close(self) -> None:
        self.engine.dispose()


def _configs(args: argparse.Namespace, rabbitmq: bool) -> list[Config]:
    brokers: tuple[str, ...] = BROKERS if args.broker == "both" else (args.broker,)
    if not rabbitmq:
        brokers = tuple(b for b in brokers if b != "rabbitmq")
    modes: tuple[str, ...] = MODES if args.mode == "both" else (args.mode,)
    events = {"on": (True,), "off": (False,), "both": (True, False)}[args.task_events]
    return [
        Config(broker, mode, args.rate, task_events=on)
        for broker in brokers
        for mode in modes
        for on in events
    ]


def _ratios(results: Results, configs: Sequence[Config]) -> None:
    _task_event_ratios(results, configs)
    for events in sorted({c.task_events for c in configs}, reverse=True):
        by = {(c.broker, c.mode): c.name for c in configs if c.task_events is events}
        _broker_ratios(results, by, suffix="" if events else ", task events off")


def _targets(results: Results) -> None:
    """Issue 35's target this run measures: the database broker (the default with nothing
    configured) within 2x RabbitMQ's steady commit -> arrival p50."""
    row = "commit -> arrival p50, steady: database / rabbitmq"
    if results.find(("ratios", row)) is not None:
        results.target("database broker steady p50 <= 2x RabbitMQ's", ("ratios", row), at_most=2.0)


def _task_event_ratios(results: Results, configs: Sequence[Config]) -> None:
    """Each configuration run without task events against the same one with them."""
    for off in configs:
        on = replace(off, task_events=True)
        if off.task_events or on not in configs:
            continue
        metrics = (
            ["throughput"] if off.mode == "flat" else [f"commit -> arrival p{q}" for q in (50, 99)]
        )
        for metric in metrics:
            results.ratio(
                f"{metric}, {on.name}: task events off / on", (off.name, metric), (on.name, metric)
            )


def _broker_ratios(results: Results, by: Mapping[tuple[str, str], str], *, suffix: str) -> None:
    """The database broker against RabbitMQ, and flat against steady, for one events setting."""
    for mode in MODES:
        rabbit, database = by.get(("rabbitmq", mode)), by.get(("database", mode))
        if rabbit is None or database is None:
            continue
        if mode == "flat":
            results.ratio(
                f"throughput, flat{suffix}: database / rabbitmq",
                (database, "throughput"),
                (rabbit, "throughput"),
            )
        for metric in ("commit -> arrival p50", "commit -> confirmed p50"):
            results.ratio(
                f"{metric}, {mode}{suffix}: database / rabbitmq",
                (database, metric),
                (rabbit, metric),
            )
    for broker in BROKERS:
        flat, steady = by.get((broker, "flat")), by.get((broker, "steady"))
        if flat is not None and steady is not None:
            results.ratio(
                f"commit -> confirmed p50, {broker}{suffix}: flat / steady",
                (flat, "commit -> confirmed p50"),
                (steady, "commit -> confirmed p50"),
            )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--broker", choices=[*BROKERS, "both"], default="both")
    parser.add_argument("--mode", choices=[*MODES, "both"], default="both")
    parser.add_argument("--rate", type=float, default=100.0, help="steady: intents/s in all")
    parser.add_argument("--intents", type=int, default=2000, help="per configuration and round")
    parser.add_argument("--agents", type=int, default=8, help="agent threads (connections)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=8, help="threads per worker")
    parser.add_argument("--relays", type=int, default=1, help="relay processes")
    parser.add_argument(
        "--queues",
        default="dispatch,lookup,reconcile,human",
        help="the workers' -Q (default: every queue, as `outbox worker` and `outbox up`)",
    )
    parser.add_argument("--batch-size", type=int, default=200, help="the relay's --batch-size")
    parser.add_argument(
        "--task-events",
        choices=["on", "off", "both"],
        default="on",
        help="Celery task events (OUTBOX_TASK_EVENTS; default on, as deployed); both: each "
        "configuration with and without, side by side",
    )
    parser.add_argument("--log-level", default="WARNING", help="the processes' log level")
    parser.add_argument("--broker-url", help="an AMQP URL to use as it is (no vhost is made)")
    add_contend_argument(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    rabbitmq = bool(args.broker_url) or rabbitmq_available()
    if args.smoke:
        args.rounds, args.intents, args.mode = 1, 200, "flat"
        args.broker = "rabbitmq" if rabbitmq else "database"
    if args.broker == "rabbitmq" and not rabbitmq:
        parser.error("--broker rabbitmq: no RabbitMQ on 127.0.0.1:5672 (or no rabbitmqctl)")
    configs = _configs(args, rabbitmq)
    logging.getLogger("amqp").setLevel(logging.ERROR)
    results = Results(
        f"pipeline: {args.intents} intents, {args.agents} agents, {args.relays} relay, "
        f"{args.workers} workers x {args.concurrency} threads, {args.rounds} rounds"
    )
    cpu = Results("CPU while measuring, in % of one core (from /proc; rabbitmq: the whole broker)")
    try:
        return _run(args, configs, results, cpu)
    except KeyboardInterrupt:
        say("interrupted: processes stopped, databases and vhost removed")
        return 130


def _run(
    args: argparse.Namespace,
    configs: Sequence[Config],
    results: Results,
    cpu: Results,
) -> int:
    """Set every configuration up, run the rounds, print the tables; the exit status."""
    pipelines: list[Pipeline] = []
    with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-pipeline-")))
        service = stack.enter_context(ServiceProcess(port=0, record_arrivals=True))
        vhost = None
        if any(c.broker == "rabbitmq" for c in configs):
            vhost = stack.enter_context(throwaway_vhost(args.broker_url))
        for i, config in enumerate(configs):
            db_url = stack.enter_context(throwaway_database(args.url))
            home = workdir / f"config-{i}"
            home.mkdir()
            broker_url = vhost if config.broker == "rabbitmq" else None
            pipeline = Pipeline(
                config,
                db_url=db_url,
                broker_url=broker_url,
                service=service,
                args=args,
                workdir=home,
                cpu=cpu,
            )
            stack.callback(pipeline.close)
            pipelines.append(pipeline)
        try:
            run_rounds(
                args.rounds, [p.case() for p in pipelines], results, contend_pct=args.contend
            )
        except RuntimeError as exc:
            say(f"FAILED: {exc}")
            return 1
    _ratios(results, configs)
    _targets(results)
    results.note(
        "Latencies from the agent's commit (time.time() after COMMIT returned) to the request "
        "reaching the service, and to the `confirmed` event's clock_timestamp(): one host, "
        "one clock."
    )
    results.note(server_settings(args.url))
    print_table(results)
    print_table(cpu)
    write_json(args.json, [results, cpu], vars(args))
    problems = [problem for p in pipelines for problem in p.problems]
    for problem in problems:
        say(f"PROBLEM: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
