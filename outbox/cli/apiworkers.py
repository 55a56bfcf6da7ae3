"""``outbox api --workers N``: N uvicorn worker processes on the one socket the parent bound.

uvicorn's own supervisor (:class:`uvicorn.supervisors.Multiprocess`) starts the workers
(``spawn``: each a fresh interpreter, so each its own GIL and core), starts again one that
dies, and on SIGTERM or SIGINT stops them all, each finishing its requests. What this module
adds, so that N processes behave as one API:

* **the app factory** (:class:`WorkerApp`, pickled to each worker): the worker configures its
  logging, loads the tools and builds the app itself;
* **request metrics across workers**: prometheus_client's multiprocess mode, in a temporary
  directory the parent makes (``PROMETHEUS_MULTIPROC_DIR``, inherited by each worker before
  it imports prometheus_client) and removes when it exits; ``/metrics``, whichever worker
  answers, sums every worker's counters, a dead worker's too; a worker's live gauges (none
  today) are dropped when it exits (``mark_process_dead``);
* **one console session key**: without OUTBOX_CONSOLE_SECRET the parent makes one and hands
  it to every worker inside the factory (never through the environment, never logged), so a
  session signed by one worker is good on the others, and on a worker started again.

The sign-in throttle is in PostgreSQL already (:mod:`outbox.signins`); each worker keeps its
own token cache (a revoked token is refused within OUTBOX_API_TOKEN_CACHE seconds by each).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import multiprocess
from pydantic import SecretStr
from uvicorn import Config
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

from outbox.cli.extras import needs_extra
from outbox.cli.options import LogLevel, start_logging
from outbox.config import Settings, get_settings
from outbox.logs import Action
from outbox.web import create_app
from outbox.web.console.session import session_secret

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger(__name__)

#: prctl(2)'s option: the signal this process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerApp:
    """The app factory each worker process calls (uvicorn ``factory=True``)."""

    log_level: LogLevel
    metrics_dir: Path
    #: The console's session key, the same for every worker (never in a repr or a log line).
    console_secret: str = field(repr=False)

    def __call__(self) -> FastAPI:
        """Configure this worker and build its app; a worker that cannot exits with
        uvicorn's start-up failure code, so the parent stops instead of starting it again."""
        _die_with_parent()
        start_logging(self.log_level)
        logging.getLogger("alembic").setLevel(max(logging.WARNING, logging.getLogger().level))
        try:
            settings = get_settings().model_copy(
                update={"console_secret": SecretStr(self.console_secret)}
            )
            load_configured_tools(settings)
            return create_app(settings, metrics_dir=self.metrics_dir)
        # Any error at start-up ends the worker, in one line (the CLI's errors are one line),
        # with the code that tells uvicorn not to start it again and again.
        except Exception as exc:  # noqa: BLE001
            log.error(  # noqa: TRY400 -- one line, as above
                "an API worker could not start: %s",
                exc,
                extra={"action": Action.API_WORKER_FAILED},
            )
            sys.exit(STARTUP_FAILURE)


def load_configured_tools(settings: Settings) -> None:
    """Load the tools when OUTBOX_CONFIG or OUTBOX_TOOLS names them: then they alone are known
    (and resolve knows their in-flight horizons); else ``outbox.tool_policies`` says."""
    if settings.config is None and not settings.tools:
        log.info(
            "0 tool(s) loaded: OUTBOX_CONFIG and OUTBOX_TOOLS unset, outbox.tool_policies "
            "says which tools are known (docs/tools.md)",
            extra={"action": Action.TOOLS_LOADED, "tools": ""},
        )
        return
    with needs_extra("worker", "api"):
        from outbox.tools import load_tools  # noqa: PLC0415 -- the tools layer, as ops resolve

    load_tools(settings)


def _die_with_parent() -> None:
    """On Linux, SIGTERM this worker when the parent dies, even by SIGKILL: no orphan keeps
    serving the port. (Elsewhere uvicorn's health pipe is all there is.)"""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() == 1:  # the parent died before the call: nobody will signal us
        os.kill(os.getpid(), signal.SIGTERM)


class _Supervisor(Multiprocess):
    """uvicorn's supervisor, also marking exited workers dead for prometheus_client and
    remembering whether a worker failed to start."""

    def __init__(self, config: Config, sockets: list[socket.socket], metrics_dir: Path) -> None:
        super().__init__(config, sockets)
        self.metrics_dir = metrics_dir
        self.start_failed = False
        self._pids: set[int] = set()

    def keep_subprocess_alive(self) -> None:
        """Start again the workers that died (uvicorn), then account for the ones gone."""
        super().keep_subprocess_alive()
        living = {process.pid for process in self.processes if process.pid is not None}
        for pid in self._pids - living:
            # prometheus_client ships no annotations for it.
            multiprocess.mark_process_dead(pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]
        self._pids = living
        if any(process.exitcode == STARTUP_FAILURE for process in self.processes):
            self.start_failed = True


#: How long uvicorn's supervisor waits for a worker's answer to its health ping before it
#: kills the worker and starts another. uvicorn's 5 s killed workers still importing the app
#: on a loaded host (load average above about 8), and their replacements too, in a loop
#: (tests/acceptance/test_api_workers.py, issue 36); a worker that really hangs is still
#: replaced, 30 s later.
WORKER_HEALTHCHECK_TIMEOUT_S = 30


def serve_workers(
    listening: socket.socket,
    *,
    workers: int,
    log_level: LogLevel,
    settings: Settings,
    uvicorn_options: dict[str, Any],
) -> bool:
    """Serve on ``listening`` with ``workers`` processes until SIGTERM or SIGINT; ``False``
    if a worker could not start (its error is logged)."""
    metrics_dir = Path(tempfile.mkdtemp(prefix="outbox-api-metrics-"))
    try:
        # Before any worker starts: prometheus_client reads it when a worker imports it.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        configured = settings.console_secret
        secret = session_secret(configured.get_secret_value() if configured else None)
        config = Config(
            WorkerApp(log_level=log_level, metrics_dir=metrics_dir, console_secret=secret),
            factory=True,
            workers=workers,
            **{"timeout_worker_healthcheck": WORKER_HEALTHCHECK_TIMEOUT_S, **uvicorn_options},
        )
        supervisor = _Supervisor(config, [listening], metrics_dir)
        supervisor.run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return not supervisor.start_failed
