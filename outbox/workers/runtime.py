"""Per-process resources of a worker: the database engine, created after the fork."""

from __future__ import annotations

import functools
import logging
import sys

from celery.signals import worker_init, worker_process_init, worker_shutdown
from celery.worker import WorkController
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from outbox import tracing
from outbox.approval import publish_policies_committed
from outbox.budgets import BUDGETS, publish_budgets_committed
from outbox.config import get_settings
from outbox.contracts import CONTRACTS
from outbox.db import create_engine, database_errors, database_url
from outbox.errors import AsyncReplicas, DatabaseUnavailable
from outbox.logs import Action
from outbox.replicas import check_replicas
from outbox.tools import load_tools

log = logging.getLogger(__name__)

#: How long a thread may run Python before handing the interpreter lock to a waiting one.
#: A worker's threads mostly wait on I/O, and a thread woken by a message (or by its
#: database or HTTP reply) waits for a busy sibling to let go of the lock: with Python's
#: default 5 ms that wait showed in the tail (bench/pipeline.py at a steady 100/s:
#: commit -> request p99 30-36 ms with 5 ms against 22-24 ms with 1 ms, p50 unchanged).
SWITCH_INTERVAL_S = 0.001


@functools.cache
def engine() -> Engine:
    """This process's engine (each attempt checks out its own connection from it).

    Without the pool's pre-ping, one round trip fewer per checkout: the lock step
    (:func:`outbox.workers.locking.operation_lock`) replaces a connection found dead there, before
    anything is written, and any other statement that meets a dead connection fails its
    task once while SQLAlchemy renews the whole pool; the sweep runs again on its beat.

    The pool hands out the connection returned last (LIFO), not the one idle longest: at a
    steady rate the take (and the attempt after it) then runs on a backend that has just
    answered, and the connections beyond the few in use stay idle (``bench/pipeline.py
    --broker database --mode steady``, seven alternations: commit -> arrival p50 3.01 against
    3.48 ms, the workers' CPU a tenth lower; docs/performance.md, change 40).
    """
    return create_engine(
        database_url(get_settings()),
        pool_size=10,
        max_overflow=20,
        pool_pre_ping=False,
        pool_use_lifo=True,
    )


@worker_process_init.connect  # type: ignore[untyped-decorator]
def _forget_parent_engine(**_: object) -> None:
    # A forked child must never reuse its parent's pooled connections.
    engine.cache_clear()


@worker_init.connect  # type: ignore[untyped-decorator]
def _short_switch_interval(**_: object) -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_S)


@worker_init.connect  # type: ignore[untyped-decorator]
def _start_tracing(sender: object = None, **_: object) -> None:
    """The OpenTelemetry SDK, when the OTEL_* variables ask for it (docs/observability.md).
    In the main process before the pool starts: the SDK's batch exporter restarts its thread
    in a forked child."""
    if isinstance(sender, WorkController):
        # A Celery run span per task, an aiohttp span per HTTP tool request (under its
        # outbox.tool.call), SQLAlchemy's per statement only with OUTBOX_OTEL_SQL=1.
        tracing.setup("outbox-worker", instrument=("celery", "aiohttp", "sqlalchemy"))


@worker_shutdown.connect  # type: ignore[untyped-decorator]
def _stop_tracing(**_: object) -> None:
    tracing.shutdown()  # export what is buffered before the process exits


@worker_init.connect  # type: ignore[untyped-decorator]
def _publish_tool_policies(sender: object = None, **_: object) -> None:
    """Write every loaded tool's approval policy to ``outbox.tool_policies`` at start, so an
    agent process that loads no tools still enqueues an approval-required tool's operations
    ``awaiting_approval`` (the dispatcher re-checks too); and the declared budgets to
    ``outbox.budgets``, which every process's ``enqueue`` enforces. A failure is logged, not
    fatal: the dispatcher's re-check still holds every unapproved operation back (a budget
    not yet published is not enforced: the log line says so)."""
    if not isinstance(sender, WorkController):
        return  # the signal sent by hand (tests), not by a starting worker
    publish_loaded_policies()


def publish_loaded_policies() -> None:
    """Load the tools and write their approval policies and the declared budgets
    (committed), on a throw-away engine."""
    settings = get_settings()
    load_tools(settings)
    contracts = [c for name in CONTRACTS.names() if (c := CONTRACTS.get(name)) is not None]
    probe = create_engine(database_url(settings), poolclass=NullPool)
    try:
        count = publish_policies_committed(probe, contracts)
        budgets = publish_budgets_committed(probe, BUDGETS.all())
    except DBAPIError as exc:
        log.warning(
            "could not write the tools' approval policies and budgets: %s",
            type(exc).__name__,
            extra={"action": Action.TOOL_POLICIES_PUBLISHED, "tools": 0},
        )
        return
    finally:
        probe.dispose()
    log.info(
        "approval policies of %d tool(s) written",
        count,
        extra={"action": Action.TOOL_POLICIES_PUBLISHED, "tools": count},
    )
    log.info(
        "%d budget(s) written",
        budgets,
        extra={"action": Action.BUDGETS_PUBLISHED, "budgets": budgets},
    )


@worker_init.connect  # type: ignore[untyped-decorator]
def _refuse_async_replicas(sender: object = None, **_: object) -> None:
    """Stop a starting worker, with one line, if the database's standbys are all asynchronous
    (:mod:`outbox.replicas`) and ``OUTBOX_ALLOW_ASYNC_REPLICAS`` does not accept it.

    Every worker checks, whatever its queues: any may dispatch (the default consumes every
    queue, and Celery's ``add_consumer`` can add the dispatch queue to a running worker).
    Sent once, in the main process before the pool starts (``celery -A`` or ``outbox worker``);
    Celery logs and ignores a handler's exception, so the refusal is a ``SystemExit``.
    """
    if not isinstance(sender, WorkController):
        return  # the signal sent by hand (tests), not by a starting worker
    settings = get_settings()
    url = database_url(settings)
    # A throw-away connection: a forked pool child must inherit no pooled one.
    probe = create_engine(url, poolclass=NullPool)
    try:
        with database_errors(url):
            check_replicas(probe, allow_async=settings.allow_async_replicas)
    except (AsyncReplicas, DatabaseUnavailable) as exc:
        log.error("refusing to start: %s", exc, extra={"action": Action.WORKER_REFUSED})  # noqa: TRY400 -- one line, no traceback
        raise SystemExit(f"outbox worker: refusing to start: {exc}") from None
    finally:
        probe.dispose()
