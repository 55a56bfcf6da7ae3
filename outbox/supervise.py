"""Supervise the outbox's long-running processes on one host (``outbox up``).

Each child is ``python -m outbox <command>`` in its own process group, its output appended to
``<log dir>/<name>.log``. A child that exits is started again after a backoff that doubles
with each quick failure (1 s, 2 s, 4 s … 30 s) and resets once it has run for a minute, so a
database outage does not turn into a fork loop. :meth:`Supervisor.stop` sends SIGTERM to
every child (a relay finishes its batch, a worker its tasks), waits, then SIGKILLs stragglers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from outbox.backoff import Backoff

#: Backoff before restarting a child that failed quickly: first, ceiling, and the run time
#: after which a child counts as healthy again (its next failure waits the first delay).
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
HEALTHY_AFTER_S = 60.0


@dataclass(frozen=True)
class ChildSpec:
    """What to run: ``python -m outbox ARGS`` under ``name``, with extra environment."""

    name: str
    args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class ChildStatus:
    """One child as the status panel shows it."""

    name: str
    pid: int | None
    running: bool
    restarts: int
    uptime_s: float
    last_exit: int | None


class _Child:
    def __init__(self, spec: ChildSpec, env: Mapping[str, str], log_dir: Path) -> None:
        self.spec = spec
        self.env = {**env, **spec.env}
        self.log_path = log_dir / f"{spec.name}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.restarts = 0
        self.last_exit: int | None = None
        self.backoff = Backoff(base_s=FIRST_BACKOFF_S, max_s=MAX_BACKOFF_S, jitter=False)
        self.restart_at: float | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(  # noqa: S603 -- our own CLI, argv from our code
                [sys.executable, "-m", "outbox", *self.spec.args],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own group: a stop reaches its pool processes
            )
        self.started_at = time.monotonic()
        self.restart_at = None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def check(self, now: float) -> str | None:
        """Restart the child when due; a line saying what happened, if anything did."""
        if self.process is None or self.alive():
            return None
        if self.restart_at is None:
            self.last_exit = self.process.returncode
            ran = now - self.started_at
            if ran >= HEALTHY_AFTER_S:
                self.backoff.reset()
            delay = self.backoff.next_s()
            self.restart_at = now + delay
            return (
                f"{self.spec.name} exited with {self.last_exit} after {ran:.0f}s; "
                f"restarting in {delay:g}s (log: {self.log_path})"
            )
        if now >= self.restart_at:
            self.restarts += 1
            self.start()
            return f"{self.spec.name} restarted (pid {self.pid})"
        return None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def signal(self, signum: int) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signum)

    def status(self, now: float) -> ChildStatus:
        running = self.alive()
        return ChildStatus(
            name=self.spec.name,
            pid=self.pid if running else None,
            running=running,
            restarts=self.restarts,
            uptime_s=now - self.started_at if running else 0.0,
            last_exit=self.last_exit,
        )


class Supervisor:
    """Start, watch and stop a set of children; call :meth:`poll` regularly."""

    def __init__(
        self, specs: Sequence[ChildSpec], *, env: Mapping[str, str], log_dir: Path
    ) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.children = [_Child(spec, env, log_dir) for spec in specs]

    def start(self) -> None:
        """Start every child."""
        for child in self.children:
            child.start()

    def poll(self) -> list[str]:
        """Restart children that died (after their backoff); what happened, one line each."""
        now = time.monotonic()
        return [line for child in self.children if (line := child.check(now))]

    def statuses(self) -> list[ChildStatus]:
        """Every child's status, in start order."""
        now = time.monotonic()
        return [child.status(now) for child in self.children]

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every child, wait up to ``timeout_s`` in all, then SIGKILL what is left."""
        for child in self.children:
            child.restart_at = None
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in self.children:
            if child.process is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(max(0.0, deadline - time.monotonic()))
        for child in self.children:
            child.signal(signal.SIGKILL)  # stragglers, and pool processes of stopped parents
            if child.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.process.wait(5)
