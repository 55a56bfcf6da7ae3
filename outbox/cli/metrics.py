"""``outbox metrics``: serve the outbox's Prometheus metrics until SIGTERM (docs/metrics.md)."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Annotated

import typer

from outbox.cli.common import connected, require_schema
from outbox.cli.extras import needs_extra
from outbox.cli.options import LogLevel, LogLevelOption, start_logging
from outbox.cli.output import console, fail
from outbox.logs import Action

log = logging.getLogger(__name__)

#: outbox.metrics.DEFAULT_HOST and DEFAULT_PORT (the OpenTelemetry Prometheus exporter's
#: port), written out: outbox.metrics needs prometheus_client, and `outbox --help` must not.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9464


def metrics_command(
    host: Annotated[
        str, typer.Option(help="Address to listen on (0.0.0.0 for every interface).")
    ] = DEFAULT_HOST,
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")] = DEFAULT_PORT,
    log_level: LogLevelOption = LogLevel.INFO,
) -> None:
    """Serve Prometheus metrics on http://HOST:PORT/metrics, until SIGTERM.

    Each scrape reads the database: operations by state and tool, how long the oldest
    `planned`, `sent`, `unknown` and `needs_human` operation has waited, webhook deliveries,
    the transitions, escalations and dispatch latencies committed since the exporter
    started, and the messages workers dropped for operations not in this database (reported
    on a NOTIFY channel while the exporter listens). If the database is down a scrape still
    answers, with `outbox_database_up 0`.
    Metrics and suggested alert rules: docs/metrics.md. SIGTERM or Ctrl-C exits 0.
    """
    with needs_extra("worker", "metrics"):
        from outbox.metrics import serve_metrics  # noqa: PLC0415 -- prometheus_client

    start_logging(log_level)
    require_schema()
    stop = threading.Event()

    def stopping(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, stopping)
    signal.signal(signal.SIGINT, stopping)
    with connected() as engine:
        try:
            server = serve_metrics(engine, host, port)
        except OSError as exc:
            fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
        console.print(
            f"serving metrics on {server.url}", markup=False, highlight=False, soft_wrap=True
        )
        log.info("serving on %s", server.url, extra={"action": Action.METRICS_STARTED})
        while not stop.wait(0.5):
            pass
        server.shutdown()
    log.info("metrics stopped", extra={"action": Action.METRICS_STOPPED})
