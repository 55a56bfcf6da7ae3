"""The real ``outbox api`` as a subprocess on an ephemeral port, for tests and benchmarks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

_SERVING = re.compile(r"serving the API on (\S+)")


@dataclass(frozen=True)
class ApiServer:
    """A running ``outbox api``: its base URL, the file its stderr (logs) goes to, and its
    process."""

    url: str
    log: Path
    process: subprocess.Popen[str] = field(repr=False, compare=False)

    def logs(self) -> str:
        """Everything the server logged so far."""
        return self.log.read_text(encoding="utf-8", errors="replace")


@contextmanager
def running_api(
    env: Mapping[str, str], log: Path, *args: str, timeout: float = 60, verify: bool = True
) -> Iterator[ApiServer]:
    """Start ``python -m outbox api --port 0 ARGS``, wait until /healthz answers, yield it;
    SIGTERM it at the end (its log stays in ``log``)."""
    with log.open("w", encoding="utf-8") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "outbox", "api", "--port", "0", *args],
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        found = _SERVING.search(line)
        if found is None:
            process.wait(timeout=timeout)
            raise AssertionError(f"outbox api did not start: {line!r}\n{log.read_text()}")
        server = ApiServer(url=found.group(1), log=log, process=process)
        _wait_healthy(server.url, process, timeout, verify=verify)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
        if process.stdout is not None:
            process.stdout.close()


def _wait_healthy(
    url: str, process: subprocess.Popen[str], timeout: float, *, verify: bool
) -> None:
    """Poll /healthz until it answers 200 (uvicorn listens once its loop has started)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"outbox api exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2, verify=verify).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"outbox api at {url} did not answer /healthz in {timeout:g}s")


def api_environment(database_url: str, home: Path, **overrides: str) -> dict[str, str]:
    """This process's environment without OUTBOX_* variables, on ``database_url``; console
    passwords checked without the pacing that protects a production host's agents (tests sign
    in many times a minute; test_console_signin.py sets its own)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OUTBOX_")}
    env.update(OUTBOX_DATABASE_URL=database_url, OUTBOX_HOME=str(home))
    env.update({"OUTBOX_CONSOLE_HASH_RATE": "1000", **overrides})
    return env
