"""Run the outbox's long-running commands as real processes (tests, scenarios, the demo)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path


class Service:
    """One ``python -m outbox …`` process (or ``-m module``) whose output goes to a log file."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        env: Mapping[str, str],
        log_dir: Path,
        *,
        module: str = "outbox",
    ) -> None:
        self.name = name
        self.args = list(args)
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(  # noqa: S603 -- our own CLI, argv from our code
            [sys.executable, "-m", module, *args],
            env=dict(env),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a kill takes its children too
        )

    @property
    def pid(self) -> int:
        """The process id."""
        return self.process.pid

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.process.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM the process group, then SIGKILL it if it lingers; the exit code."""
        if self.alive():
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(5)
        self._signal(signal.SIGKILL)  # stray children (pool processes) of a stopped parent
        self._log.close()
        return int(self.process.returncode)

    def kill(self) -> None:
        """SIGKILL the whole process group, like a machine losing power under it."""
        self._signal(signal.SIGKILL)
        self.process.wait(10)

    def output(self) -> str:
        """Everything the process printed so far."""
        return self.log_path.read_text(errors="replace")

    def _signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)


class Services:
    """The processes a test started, all stopped at teardown."""

    def __init__(self, env: Mapping[str, str], log_dir: Path) -> None:
        self.env = dict(env)
        self.log_dir = log_dir
        self.started: list[Service] = []

    def start(self, name: str, *args: str, env: Mapping[str, str] | None = None) -> Service:
        """Start ``python -m outbox ARGS`` as ``name``."""
        service = Service(name, list(args), {**self.env, **(env or {})}, self.log_dir)
        self.started.append(service)
        return service

    def stop_all(self) -> None:
        """Stop every process still running."""
        for service in reversed(self.started):
            service.stop()

    def logs(self) -> Iterator[tuple[str, str]]:
        """(name, output) of every process started."""
        for service in self.started:
            yield service.name, service.output()
