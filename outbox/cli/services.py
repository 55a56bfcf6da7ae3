"""``outbox relay`` and ``outbox worker``: the long-running processes."""

from __future__ import annotations

import logging
import signal
from types import FrameType
from typing import Annotated, Any

import typer

from outbox.cli.common import await_database, connected, require_schema
from outbox.cli.extras import needs_extra
from outbox.cli.options import LogLevel, LogLevelOption, Pool, queue_list, start_logging
from outbox.cli.toolset import NoToolsOption, load_toolset
from outbox.config import get_settings
from outbox.logs import Action

log = logging.getLogger(__name__)


def relay_command(
    batch_size: Annotated[
        int, typer.Option(min=1, max=10_000, help="Rows claimed and published per batch.")
    ] = 200,
    poll_interval: Annotated[
        float,
        typer.Option(min=0.01, help="Seconds between polls while idle (NOTIFY wakes sooner)."),
    ] = 1.0,
    republish_after: Annotated[
        float | None,
        typer.Option(
            min=0.1,
            help="Publish a row again after this many seconds (default: OUTBOX_REPUBLISH_AFTER).",
        ),
    ] = None,
    ops_per_message: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=100,
            help="Operations one message may name (default: OUTBOX_OPS_PER_MESSAGE, 8).",
        ),
    ] = None,
    log_level: LogLevelOption = LogLevel.INFO,
) -> None:
    """Publish a dispatch message for every due `planned` operation, until SIGTERM.

    Several relays may run at once: each claims its own batches. A broker or database
    outage is retried with backoff; nothing is marked published unless the broker
    confirmed it. A message names up to --ops-per-message operations, each dispatched
    with its own lock and attempt; a batch still goes out as at least 16 messages when it
    has that many operations. SIGTERM or Ctrl-C finishes the current batch and exits 0.
    """
    with needs_extra("worker", "relay"):
        from outbox.relay import Relay, RelayConfig  # noqa: PLC0415 -- see celery_app()
        from outbox.workers.app import OUTBOX_DEPLOYMENT_KEY, app  # noqa: PLC0415
        from outbox.workers.publish import CeleryPublisher  # noqa: PLC0415

    from outbox import tracing  # noqa: PLC0415 -- only the components set tracing up

    start_logging(log_level)
    # Celery's publish span per message (its context in the message headers, for the
    # worker's run span), SQLAlchemy's per statement only with OUTBOX_OTEL_SQL=1.
    tracing.setup("outbox-relay", instrument=("celery", "sqlalchemy"))
    await_database("relay")
    require_schema()
    settings = get_settings()
    config = RelayConfig(
        batch_size=batch_size,
        poll_interval_s=poll_interval,
        republish_after_s=republish_after or settings.republish_after,
    )
    with connected() as engine:
        publisher = CeleryPublisher(
            app, engine=engine, ops_per_message=ops_per_message or settings.ops_per_message
        )
        relay = Relay(engine, publisher, config)

        def stop(signum: int, _frame: FrameType | None) -> None:
            log.info("stopping after this batch", extra={"action": Action.RELAY_STOPPING})
            relay.stop()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        log.info(
            "relay %s started",
            relay.name,
            extra={
                "action": Action.RELAY_STARTED,
                "deployment": app.conf.get(OUTBOX_DEPLOYMENT_KEY),
            },
        )
        relay.run_forever()
    tracing.shutdown()
    log.info("relay stopped", extra={"action": Action.RELAY_STOPPED})


def celery_app(command: str) -> Any:
    """The outbox Celery app with every task registered (:mod:`outbox.cli.celery_app`).

    Imported here, not at the top: the workers and reconcilers layers need the ``[worker]``
    extra, and ``outbox --help`` or ``outbox enqueue`` must work without it.
    """
    with needs_extra("worker", command):
        from outbox.cli.celery_app import app  # noqa: PLC0415 -- see the docstring
    return app


def beat_command(
    log_level: LogLevelOption = LogLevel.INFO,
) -> None:
    """Run the schedule: a sweep every OUTBOX_SWEEP_INTERVAL seconds, webhook redelivery.

    Run exactly one beat per deployment (a second one only doubles harmless sweeps). Its
    schedule state lives in OUTBOX_HOME/celerybeat-schedule.
    """
    start_logging(log_level)
    app = celery_app("beat")
    await_database("beat")
    require_schema()
    home = get_settings().home
    home.mkdir(parents=True, exist_ok=True)
    schedule = str(home / "celerybeat-schedule")
    scheduler = "outbox.workers.beat:RecoveringScheduler"  # reconnects after a broker outage
    app.start(["beat", "-l", log_level.value, "-s", schedule, "-S", scheduler])


def worker_command(  # noqa: PLR0917 -- Click passes the options by name
    queues: Annotated[
        str,
        typer.Option(
            "-Q",
            "--queues",
            callback=queue_list,
            help="Comma-separated queues to consume: dispatch, lookup, reconcile, human.",
        ),
    ] = "dispatch,lookup,reconcile,human",
    concurrency: Annotated[
        int,
        typer.Option("-c", "--concurrency", min=1, help="Threads (or processes with -P prefork)."),
    ] = 8,
    pool: Annotated[
        Pool,
        typer.Option(
            "-P",
            "--pool",
            case_sensitive=False,
            help=(
                "Celery pool. threads (the default) suits tools that wait on the network; "
                "prefork for CPU-bound Python tools or ones that may hang in C code "
                "(only prefork enforces Celery's hard time limit)."
            ),
        ),
    ] = Pool.THREADS,
    name: Annotated[
        str | None, typer.Option("-n", "--hostname", help="Worker name (default: celery@host).")
    ] = None,
    log_level: LogLevelOption = LogLevel.INFO,
    no_tools: NoToolsOption = False,
) -> None:
    """Run a Celery worker on the outbox app: dispatch, lookups, sweeps, escalations.

    Tools come from OUTBOX_TOOLS (Python modules) and OUTBOX_CONFIG (HTTP tools in TOML);
    it logs how many it loaded and from where, and refuses to start with none (exit 2)
    unless `--no-tools` is given. By default one worker consumes every queue; split them
    across workers with -Q.
    """
    start_logging(log_level)
    app = celery_app("worker")
    load_toolset("worker", get_settings(), no_tools=no_tools)  # logs "N tool(s) loaded from"
    await_database("worker")
    require_schema()
    argv = ["worker", "-Q", queues, "-c", str(concurrency), "-P", pool.value, "-l", log_level.value]
    if name:
        argv += ["-n", name]
    app.worker_main(argv)
