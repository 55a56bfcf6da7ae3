"""``outbox.cli.celery_app`` is the one Celery app, with every task, that the CLI runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from outbox import metrics
from outbox.cli import celery_app as root
from outbox.cli import metrics as metrics_cli
from outbox.cli.extras import needs_extra
from outbox.cli.services import celery_app
from outbox.errors import ConfigError


@pytest.mark.parametrize("command", ["worker", "beat", "flower"])
def test_each_command_gets_the_composition_root_app(command: str) -> None:
    """`outbox worker`, `outbox beat` and `outbox flower` ask celery_app() for their app
    (tests/acceptance/test_composition_root.py runs them): it is the app of `celery -A
    outbox.cli.celery_app`, the same object."""
    assert celery_app(command) is root.app


def test_importing_the_composition_root_configures_nothing() -> None:
    """Importing it reads no setting and starts nothing (no embedded PostgreSQL with no
    OUTBOX_DATABASE_URL): the app configures itself when first used. A fresh interpreter:
    this one's app may have been used by other tests."""
    script = (
        "import outbox.cli.celery_app as root\n"
        "assert not root.app.configured, 'configured at import'\n"
        "print(' '.join(root.TASK_MODULES))\n"
    )
    env = {name: value for name, value in os.environ.items() if not name.startswith("OUTBOX_")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, "OUTBOX_HOME": "/nonexistent/outbox-home"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["outbox.workers.tasks", "outbox.reconcilers.tasks"]


def test_a_missing_extra_is_named_in_one_line() -> None:
    with pytest.raises(ConfigError) as raised, needs_extra("flower", "flower"):
        raise ModuleNotFoundError("No module named 'flower'", name="flower")
    assert str(raised.value) == (
        "outbox flower needs the [flower] extra (flower is not installed): "
        "pip install 'agent-outbox[flower]'"
    )


def test_a_missing_module_of_no_extra_is_a_bug_not_an_extra() -> None:
    with pytest.raises(ModuleNotFoundError), needs_extra("worker", "worker"):
        raise ModuleNotFoundError("No module named 'outbox.nothing'", name="outbox.nothing")


def test_the_metrics_command_defaults_are_the_exporters() -> None:
    """`outbox metrics` spells its defaults out (outbox.metrics needs the [worker] extra,
    `outbox --help` must not): they stay the exporter's."""
    assert (metrics_cli.DEFAULT_HOST, metrics_cli.DEFAULT_PORT) == (
        metrics.DEFAULT_HOST,
        metrics.DEFAULT_PORT,
    )
