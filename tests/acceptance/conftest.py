"""Run the real ``outbox`` command line as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

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
