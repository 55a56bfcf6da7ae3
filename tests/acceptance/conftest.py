"""Run the real ``outbox`` command line as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from outbox.dev.service import DeployService
from tests.processes import Services
from tests.tool_configs import http_tool_toml

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Result:
    """What one CLI run printed and how it exited."""

    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        """stdout parsed as JSON."""
        return json.loads(self.stdout)


def clean_environment(**overrides: str) -> dict[str, str]:
    """This process's environment without any OUTBOX_* variable, plus ``overrides``."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OUTBOX_")}
    env.update(overrides)
    return env


def run_outbox(
    *args: str, env: Mapping[str, str], stdin: str | None = None, timeout: float = 60
) -> Result:
    """Run ``python -m outbox ARGS`` and capture its output."""
    done = subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        env=dict(env),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )
    return Result(done.returncode, done.stdout, done.stderr)


CLI = Callable[..., Result]


def _tool_config(path: Path, service_url: str) -> Path:
    path.write_text(
        http_tool_toml(service_url, timeout_s=5.0, send_deadline_s=2.0, inflight_horizon_s=60),
        encoding="utf-8",
    )
    return path


@pytest.fixture
def service() -> Iterator[DeployService]:
    """The reference deploy service (no dedup: a second call would be a second effect);
    its `slow` fault takes 3 s."""
    with DeployService(port=0, fault_delay_s=3.0) as running:
        yield running


@pytest.fixture
def stack_env(
    database_url: str, broker: str | None, service: DeployService, tmp_path: Path
) -> dict[str, str]:
    """The environment every process of the stack runs with."""
    env = clean_environment(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_CONFIG=str(_tool_config(tmp_path / "tools.toml", service.url)),
        OUTBOX_HOME=str(tmp_path / "home"),
        OUTBOX_REPUBLISH_AFTER="5",
    )
    if broker is not None:
        env["OUTBOX_BROKER_URL"] = broker
    return env


@pytest.fixture
def services(
    stack_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Services]:
    """The stack's processes; their logs are printed if the test fails."""
    group = Services(stack_env, tmp_path)
    yield group
    group.stop_all()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for name, output in group.logs():
            print(f"----- {name} -----\n{output[-6000:]}")  # noqa: T201


@pytest.fixture
def cli_env(database_url: str, tmp_path: Path) -> dict[str, str]:
    """An environment pointing the CLI at the migrated test database."""
    return clean_environment(OUTBOX_DATABASE_URL=database_url, OUTBOX_HOME=str(tmp_path))


@pytest.fixture
def outbox_cli(cli_env: dict[str, str], engine: object) -> CLI:
    """Run the CLI against the (emptied) test database."""

    def run(*args: str, stdin: str | None = None) -> Result:
        return run_outbox(*args, env=cli_env, stdin=stdin)

    return run
