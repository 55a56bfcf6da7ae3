"""`outbox up` and `outbox worker` say which tools they loaded and refuse to start with none,
as real processes against a real PostgreSQL."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.conftest import run_outbox
from tests.acceptance.test_up import Up
from tests.processes import Services, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def bare(cli_env: dict[str, str], tmp_path: Path) -> Iterator[Services]:
    """Processes run with a database and no tool (neither OUTBOX_CONFIG nor OUTBOX_TOOLS)."""
    group = Services(cli_env, tmp_path)
    yield group
    group.stop_all()


def _assert_refused(stderr: str, command: str) -> None:
    [line] = stderr.splitlines()
    assert line.startswith(f"error: outbox {command} has no tool to send operations with"), line
    for named in ("OUTBOX_CONFIG", "OUTBOX_TOOLS", "docs/tools.md", "--no-tools"):
        assert named in line, line


@pytest.mark.parametrize("command", ["worker", "up"])
def test_no_tool_is_refused_in_one_line_naming_where_tools_come_from(
    command: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    """With no tool configured, `outbox worker` and `outbox up` exit 2 with one line naming
    OUTBOX_CONFIG, OUTBOX_TOOLS, docs/tools.md and --no-tools, and start nothing."""
    done = run_outbox(command, *(["--no-panel"] if command == "up" else []), env=cli_env)
    assert done.code == 2, done.stdout + done.stderr
    _assert_refused(done.stderr, command)
    assert not (tmp_path / "logs").exists()  # `up` started no process (none logged)


def test_a_worker_told_no_tools_starts_and_says_it_has_none(bare: Services) -> None:
    """`outbox worker --no-tools` with no tool configured starts and logs that it loaded 0."""
    worker = bare.start("worker", "worker", "-c", "1", "-P", "threads", "--no-tools")
    wait_until(lambda: "ready" in worker.output(), timeout=90, what="the worker ready")
    assert "0 tool(s) loaded from nowhere (OUTBOX_CONFIG and OUTBOX_TOOLS unset)" in (
        worker.output()
    )


@pytest.mark.parametrize("command", [("worker", "-c", "1", "-P", "threads"), ("relay",)])
def test_worker_and_relay_log_how_many_tools_they_loaded_and_from_where(
    command: tuple[str, ...], services: Services, stack_env: dict[str, str]
) -> None:
    """`outbox worker` and `outbox relay` log the number of tools they loaded and the
    OUTBOX_CONFIG file they came from."""
    process = services.start(command[0], *command)
    said = f"1 tool(s) loaded from OUTBOX_CONFIG {stack_env['OUTBOX_CONFIG']}"
    wait_until(lambda: said in process.output(), timeout=90, what="the tools' log line")


def test_up_prints_how_many_tools_it_loaded_and_from_where(stack_env: dict[str, str]) -> None:
    """`outbox up` prints a `tools:` line with the count and the OUTBOX_CONFIG file."""
    up = Up(stack_env, "--no-panel", "--no-metrics", "--no-api", "--workers", "1")
    try:
        wait_until(lambda: "started beat" in up.output, timeout=90, what="every process started")
        [line] = re.findall(r"^tools:.*$", up.output, flags=re.MULTILINE)
        assert line.split() == ["tools:", "1", "from", "OUTBOX_CONFIG", stack_env["OUTBOX_CONFIG"]]
        assert up.interrupt() == 0
    finally:
        up.kill()
