"""``outbox db embedded status|stop`` on a real embedded PostgreSQL in a throw-away OUTBOX_HOME."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox import embedded
from tests.acceptance.conftest import clean_environment, run_outbox

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """An OUTBOX_HOME of its own; whatever the test leaves running there is stopped."""
    yield tmp_path
    embedded.stop(tmp_path)


def test_status_and_stop_of_the_embedded_server(home: Path) -> None:
    """Not running, then started by a command, reported with pid and data directory, stopped
    (the process is gone), reported stopped; a second stop is not an error."""
    env = clean_environment(OUTBOX_HOME=str(home))
    before = run_outbox("db", "embedded", "status", "--json", env=env)
    assert before.code == 0, before.stderr
    assert before.json() == {
        "running": False,
        "data_dir": str(home.resolve() / "pgdata"),
        "pid": None,
        "url": None,
    }

    started = run_outbox("db", "upgrade", env=env, timeout=180)  # starts it: no URL is set
    assert started.code == 0, started.stderr
    running = run_outbox("db", "embedded", "status", "--json", env=env).json()
    assert running["running"] is True
    assert running["data_dir"] == str(home.resolve() / "pgdata")
    assert running["url"].startswith("postgresql+psycopg://")
    pid = running["pid"]
    assert isinstance(pid, int)
    assert _alive(pid)
    human = run_outbox("db", "embedded", "status", env=env)
    assert f"running (pid {pid})" in human.stdout

    stopped = run_outbox("db", "embedded", "stop", env=env, timeout=120)
    assert stopped.code == 0, stopped.stderr
    assert f"stopped the embedded PostgreSQL (pid {pid})" in stopped.stdout
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
    assert run_outbox("db", "embedded", "status", "--json", env=env).json()["running"] is False

    again = run_outbox("db", "embedded", "stop", env=env)
    assert again.code == 0, again.stderr
    assert "not running" in again.stdout


def test_embedded_without_a_subcommand_is_help_and_a_bad_one_a_usage_error(home: Path) -> None:
    """`db embedded` alone prints its commands; an unknown one is one line, exit 2."""
    env = clean_environment(OUTBOX_HOME=str(home))
    assert "status" in run_outbox("db", "embedded", "--help", env=env).stdout
    wrong = run_outbox("db", "embedded", "restart", env=env)
    assert wrong.code == 2
    assert wrong.stderr.startswith("error: No such command 'restart'")
