"""``outbox up``: the whole outbox on one host, supervised, with a live status panel."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Group
from rich.live import Live
from rich.table import Table

from outbox.cli.common import await_database, connected
from outbox.cli.extras import needs_extra
from outbox.cli.options import LogLevel
from outbox.cli.output import console, fail
from outbox.cli.toolset import NoToolsOption, load_toolset
from outbox.config import Settings, get_settings, variable
from outbox.errors import ConfigError
from outbox.states import State
from outbox.supervise import ChildSpec, Supervisor

if TYPE_CHECKING:  # prometheus_client: the [worker] extra, imported by up_command
    from sqlalchemy import Engine

    from outbox.metrics import MetricsServer, OutboxCollector
    from outbox.supervise import ChildStatus


#: The states the panel lists, in the order an operation meets them.
PANEL_STATES = (
    State.PLANNED,
    State.SENT,
    State.UNKNOWN,
    State.NEEDS_HUMAN,
    State.CONFIRMED,
    State.FAILED,
    State.CANCELLED,
)
DECIDED = {State.CONFIRMED.value, State.FAILED.value, State.CANCELLED.value}
#: Seconds of history behind the throughput figure.
RATE_WINDOW_S = 10.0


@dataclass
class Figures:
    """What the panel shows about the operations, read through the metrics collector."""

    database_up: bool = False
    states: dict[str, int] = field(default_factory=dict)
    oldest: dict[str, float] = field(default_factory=dict)
    decided_total: float = 0.0
    rate: float = 0.0


class Watcher:
    """Reads :class:`Figures` through the metrics collector (one source for both views)."""

    def __init__(self, collector: OutboxCollector) -> None:
        self.collector = collector
        self.history: deque[tuple[float, float]] = deque()

    def read(self) -> Figures:
        """One scrape's worth of figures, with the decided-per-second rate."""
        figures = Figures()
        for family in self.collector.collect():
            for sample in family.samples:
                labels = sample.labels
                if sample.name == "outbox_database_up":
                    figures.database_up = sample.value == 1.0
                elif sample.name == "outbox_operations":
                    state = labels["state"]
                    figures.states[state] = figures.states.get(state, 0) + int(sample.value)
                elif sample.name == "outbox_oldest_age_seconds":
                    figures.oldest[labels["state"]] = sample.value
                elif sample.name == "outbox_transitions_total" and labels["to_state"] in DECIDED:
                    figures.decided_total += sample.value
        now = time.monotonic()
        self.history.append((now, figures.decided_total))
        while self.history and now - self.history[0][0] > RATE_WINDOW_S:
            self.history.popleft()
        first_at, first_total = self.history[0]
        if now > first_at:
            figures.rate = (figures.decided_total - first_total) / (now - first_at)
        return figures


def up_command(
    *,
    workers: Annotated[int, typer.Option(min=1, max=64, help="Worker processes to run.")] = 1,
    concurrency: Annotated[
        int, typer.Option("-c", "--concurrency", min=1, help="Threads per worker.")
    ] = 4,
    relays: Annotated[int, typer.Option(min=1, max=16, help="Relay processes to run.")] = 1,
    flower: Annotated[
        bool, typer.Option("--flower", help="Run Flower too (needs OUTBOX_FLOWER_BASIC_AUTH).")
    ] = False,
    flower_port: Annotated[int, typer.Option(min=1, max=65535, help="Flower's port.")] = 5555,
    metrics: Annotated[
        bool, typer.Option("--metrics/--no-metrics", help="Serve Prometheus metrics.")
    ] = True,
    metrics_port: Annotated[
        int, typer.Option(min=0, max=65535, help="Metrics port on 127.0.0.1 (0: any free).")
    ] = 9464,
    api: Annotated[
        bool | None,
        typer.Option(
            "--api/--no-api",
            help="Serve the HTTP API (`outbox api`) on 127.0.0.1 (default: when the [api] "
            "extra is installed).",
            show_default=False,
        ),
    ] = None,
    api_port: Annotated[
        int, typer.Option(min=1, max=65535, help="The HTTP API's port on 127.0.0.1.")
    ] = 8600,
    mcp: Annotated[
        bool,
        typer.Option(
            "--mcp/--no-mcp",
            help="Serve the MCP server over HTTP (`outbox mcp --http`) on 127.0.0.1: the tools "
            "of OUTBOX_CONFIG / OUTBOX_TOOLS for agents with a token. Needs the [mcp] extra.",
        ),
    ] = False,
    mcp_port: Annotated[
        int, typer.Option(min=1, max=65535, help="The MCP server's port on 127.0.0.1.")
    ] = 8700,
    api_workers: Annotated[
        int,
        typer.Option(
            envvar=variable("api_workers"),
            min=1,
            max=64,
            help="The HTTP API's worker processes (`outbox api --workers`).",
        ),
    ] = Settings.model_fields["api_workers"].default,
    panel: Annotated[
        bool,
        typer.Option(
            "--panel/--no-panel",
            help="The live panel (default on a terminal; else a status line every 10 s).",
        ),
    ] = True,
    log_level: Annotated[
        LogLevel,
        typer.Option("--log-level", case_sensitive=False, help="The processes' log level."),
    ] = LogLevel.WARNING,
    no_tools: NoToolsOption = False,
    otel: Annotated[
        bool,
        typer.Option(
            "--otel",
            help="Trace every component with OpenTelemetry (OTLP/HTTP to "
            "OTEL_EXPORTER_OTLP_ENDPOINT, default localhost:4318; needs agent-outbox[otel]).",
        ),
    ] = False,
) -> None:
    """Run everything on this host: migrations, relay, workers, beat, metrics, the HTTP API
    (and Flower, and the MCP server over HTTP with --mcp).

    Uses OUTBOX_DATABASE_URL, or the embedded PostgreSQL when it is not set; OUTBOX_BROKER_URL,
    or the database as broker. Each process is supervised: one that dies is started again
    with a backoff (1 s, doubling to 30 s). Their logs go to OUTBOX_HOME/logs. The panel shows
    each process, the operations by state, how long the oldest `planned`, `sent` and
    `unknown` have waited, the `needs_human` count and the decided-per-second rate.
    Ctrl-C (or SIGTERM) stops every process cleanly and exits 0. It prints how many tools it
    loaded and from where (OUTBOX_CONFIG, OUTBOX_TOOLS), and refuses to start with none
    (exit 2) unless `--no-tools` is given.
    """
    # Imported here, not for `outbox up --help`: SQLAlchemy and Alembic (issue 33).
    from outbox import db, migrate  # noqa: PLC0415 -- not for --help

    with needs_extra("worker", "up"):
        # prometheus_client (and the children: Celery), checked before anything starts.
        importlib.import_module("outbox.metrics")

    api = _api_wanted(api)
    settings = get_settings()
    if mcp:
        _check_mcp(settings.config is not None or bool(settings.tools))
    # Here, not in the workers: a bad tool or none is one line now, before anything starts.
    tools, source = load_toolset("up", settings, no_tools=no_tools)
    if flower and settings.flower_basic_auth is None:
        raise typer.BadParameter(
            "needs OUTBOX_FLOWER_BASIC_AUTH=user:password (Flower is never open)",
            param_hint="'--flower'",
        )
    stop = threading.Event()

    def stopping(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, stopping)
    signal.signal(signal.SIGINT, stopping)
    if settings.database_url is not None:
        # A configured server may still be starting (Compose, systemd): wait for it like every
        # component does, rather than fail on the migration's first connection.
        await_database("up")
    with connected() as engine:
        url = engine.url.render_as_string(hide_password=False)
        migrate.upgrade(engine)
        env = {
            **os.environ,
            "OUTBOX_DATABASE_URL": url,
            "OUTBOX_HOME": str(settings.home),
            # --otel: outbox.tracing.setup in each component.
            **({"OUTBOX_OTEL": "1"} if otel else {}),
        }
        supervisor = Supervisor(
            _specs(workers, concurrency, relays, flower, flower_port, log_level, no_tools)
            + ([ChildSpec("api", _api_arguments(api_port, api_workers))] if api else [])
            + (
                [
                    ChildSpec(
                        "mcp",
                        ("mcp", "--http", "--port", str(mcp_port), "--log-level", "warning"),
                    )
                ]
                if mcp
                else []
            ),
            env=env,
            log_dir=settings.home / "logs",
        )
        server = _start_metrics(engine, metrics_port) if metrics else None
        watcher = Watcher(server.collector if server else _collector(engine))
        broker = "RabbitMQ" if settings.broker_url else "the database (no OUTBOX_BROKER_URL)"
        lines = [
            f"database: {db.redact(url)}",
            f"broker:   {broker}",
            f"tools:    {tools} from {source}",
            f"logs:     {supervisor.log_dir}",
        ]
        if server:
            lines.append(f"metrics:  {server.url}")
        if flower:
            lines.append(f"flower:   http://127.0.0.1:{flower_port}")
        if api:
            lines.append(f"api:      http://127.0.0.1:{api_port} (docs: /docs)")
        if mcp:
            lines.append(f"mcp:      http://127.0.0.1:{mcp_port}/mcp (bearer tokens: agent scope)")
        for line in lines:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        supervisor.start()
        for status in supervisor.statuses():
            console.print(f"started {status.name} (pid {status.pid})", highlight=False)
        try:
            if panel and sys.stdout.isatty():
                _live(supervisor, watcher, stop)
            else:
                _lines(supervisor, watcher, stop)
        finally:
            console.print("stopping: SIGTERM to every process, then waiting", highlight=False)
            supervisor.stop()
            if server:
                server.shutdown()
    console.print("stopped", highlight=False)


def _api_arguments(port: int, workers: int) -> tuple[str, ...]:
    return ("api", "--port", str(port), "--workers", str(workers), "--log-level", "warning")


def _api_wanted(asked: bool | None) -> bool:
    """``--api``: the [api] extra must be there; unsaid: serve it when it is."""
    if asked is False:
        return False
    try:
        with needs_extra("api", "up --api"):
            importlib.import_module("outbox.web")
    except ConfigError:
        if asked:
            raise
        return False
    return True


def _check_mcp(tools_named: bool) -> None:
    """``--mcp``: the [mcp] extra must be there, and tools to serve."""
    with needs_extra("mcp", "up --mcp"):
        importlib.import_module("outbox.mcp")
    if not tools_named:
        raise typer.BadParameter(
            "needs OUTBOX_CONFIG or OUTBOX_TOOLS: the MCP server serves the registered tools",
            param_hint="'--mcp'",
        )


def _specs(  # noqa: PLR0917 -- one private call site
    workers: int,
    concurrency: int,
    relays: int,
    flower: bool,
    flower_port: int,
    log_level: LogLevel,
    no_tools: bool,
) -> list[ChildSpec]:
    level = ("--log-level", log_level.value)
    told = ("--no-tools",) if no_tools else ()  # `up --no-tools`: the workers are told too
    specs = [ChildSpec(f"relay-{i}", ("relay", *level)) for i in range(1, relays + 1)]
    specs += [
        ChildSpec(
            f"worker-{i}",
            (
                "worker",
                "-P",
                "threads",
                "-c",
                str(concurrency),
                "-n",
                f"worker{i}@%h",
                *level,
                *told,
            ),
        )
        for i in range(1, workers + 1)
    ]
    specs.append(ChildSpec("beat", ("beat", *level)))
    if flower:
        specs.append(ChildSpec("flower", ("flower", "--port", str(flower_port))))
    return specs


def _start_metrics(engine: Engine, port: int) -> MetricsServer:
    from outbox.metrics import serve_metrics  # noqa: PLC0415 -- see up_command

    try:
        return serve_metrics(engine, "127.0.0.1", port)
    except OSError as exc:
        fail(f"cannot serve metrics on 127.0.0.1:{port}: {exc.strerror or exc} (--metrics-port)")


def _collector(engine: Engine) -> OutboxCollector:
    from outbox.metrics import OutboxCollector  # noqa: PLC0415 -- see up_command

    collector = OutboxCollector(engine)
    collector.baseline()
    return collector


def _live(supervisor: Supervisor, watcher: Watcher, stop: threading.Event) -> None:
    with Live(console=console, refresh_per_second=2, transient=False) as live:
        while not stop.is_set():
            for line in supervisor.poll():
                live.console.print(line, highlight=False)
            live.update(_render(supervisor.statuses(), watcher.read()))
            stop.wait(1.0)


def _lines(supervisor: Supervisor, watcher: Watcher, stop: threading.Event) -> None:
    last = 0.0
    while not stop.is_set():
        for line in supervisor.poll():
            console.print(line, highlight=False)
        if time.monotonic() - last >= 10:
            last = time.monotonic()
            console.print(_status_line(supervisor.statuses(), watcher.read()), highlight=False)
        stop.wait(0.5)


def _age(seconds: float | None) -> str:
    if not seconds:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _render(statuses: list[ChildStatus], figures: Figures) -> Group:
    processes = Table(title="processes", title_justify="left", expand=False)
    for column in ("name", "pid", "status", "restarts", "up"):
        processes.add_column(column)
    for status in statuses:
        state = "[green]running[/]" if status.running else "[red]restarting[/]"
        processes.add_row(
            status.name,
            str(status.pid or "-"),
            state,
            str(status.restarts),
            _age(status.uptime_s),
        )
    operations = Table(title="operations", title_justify="left", expand=False)
    for column in ("state", "count", "oldest"):
        operations.add_column(column, justify="right" if column != "state" else "left")
    for state in PANEL_STATES:
        count = figures.states.get(state.value, 0)
        name = state.value
        if state is State.NEEDS_HUMAN and count:
            name = f"[bold yellow]{name}[/]"
        operations.add_row(name, str(count), _age(figures.oldest.get(state.value)))
    database = "[green]up[/]" if figures.database_up else "[red]unreachable[/]"
    summary = (
        f"database {database}   decided {figures.rate:.1f}/s   "
        f"needs_human {figures.states.get(State.NEEDS_HUMAN.value, 0)}   Ctrl-C stops everything"
    )
    return Group(processes, operations, summary)


def _status_line(statuses: list[ChildStatus], figures: Figures) -> str:
    running = sum(1 for status in statuses if status.running)
    restarts = sum(status.restarts for status in statuses)
    states = " ".join(
        f"{state.value} {figures.states.get(state.value, 0)}" for state in PANEL_STATES
    )
    ages = " ".join(
        f"oldest {state} {_age(figures.oldest.get(state))}"
        for state in ("planned", "sent", "unknown")
    )
    database = "up" if figures.database_up else "unreachable"
    return (
        f"processes {running}/{len(statuses)} running, {restarts} restarts | database {database} | "
        f"{states} | {ages} | decided {figures.rate:.1f}/s"
    )
