"""`outbox demo` as a new user runs it: no OUTBOX_* at all, the embedded PostgreSQL."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.acceptance.conftest import clean_environment

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _stop_embedded(home: Path) -> None:
    pid_file = home / "pgdata" / "postmaster.pid"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text().split("\n", 1)[0]), signal.SIGINT)


def test_the_demo_runs_with_nothing_configured_and_its_checks_hold(tmp_path: Path) -> None:
    """Exit 0; the report shows 0 duplicates, every operation decided, resolve commands."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "outbox", "demo"],
            env=clean_environment(COLUMNS="200"),
            cwd=tmp_path,  # the default OUTBOX_HOME, .outbox, lands here
            capture_output=True,
            text=True,
            timeout=500,
            check=False,
        )
    finally:
        _stop_embedded(tmp_path / ".outbox")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert re.search(r"intents the agent made\s+│\s+200", output), output
    assert re.search(r"releases created twice \(duplicates\)\s+│\s+0\b", output), output
    assert re.search(r"undecided\s+│\s+0\b", output), output
    assert "30 of 30 intents returned their existing operation" in output
    assert "SIGKILL worker-1" in output
    assert "IntentConflict" in output
    # The legacy tool (no lookup, no dedup) leaves some for a person, with the exact command.
    assert re.search(r"outbox ops resolve [0-9a-f-]{36} --", output), output
    assert "OK: no release created twice" in output
