"""Real processes for tests: start the CLI's long-running commands, stop or SIGKILL them."""

from __future__ import annotations

import time
from collections.abc import Callable

from sqlalchemy import Engine, text

from outbox.dev.stack import Service, Services

__all__ = ["Service", "Services", "wait_for_session_end", "wait_until"]


def wait_until(
    condition: Callable[[], bool], *, timeout: float, interval: float = 0.1, what: str = ""
) -> None:
    """Poll ``condition`` until it holds; fail the test with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what or condition}")


def wait_for_session_end(engine: Engine, backend_pid: int, *, timeout: float = 10.0) -> None:
    """Until PostgreSQL no longer lists the session ``backend_pid`` (its client's socket
    closed: a SIGKILLed process's is closed by the kernel)."""

    def ended() -> bool:
        with engine.connect() as conn:
            found = conn.execute(
                text("SELECT count(*) FROM pg_stat_get_activity(:pid)"), {"pid": backend_pid}
            ).scalar_one()
        return bool(found == 0)

    wait_until(ended, timeout=timeout, interval=0.05, what=f"session {backend_pid} to end")
