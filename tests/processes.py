"""Real processes for tests: start the CLI's long-running commands, stop or SIGKILL them."""

from __future__ import annotations

import time
from collections.abc import Callable

from outbox.dev.stack import Service, Services

__all__ = ["Service", "Services", "wait_until"]


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
