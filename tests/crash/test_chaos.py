"""The bounded chaos run: 500 intents, 20 SIGKILLs, a PostgreSQL crash, a RabbitMQ restart.

``outbox chaos`` makes its own PostgreSQL cluster whatever the test database is, so both CI
passes would repeat the same run; each takes one broker instead: RabbitMQ when the suite runs
against a configured PostgreSQL (``OUTBOX_TEST_DATABASE_URL``), the database broker when
nothing is configured (the machine a new user has). On RabbitMQ it starts and restarts a node
of its own: the machine's broker, if one runs, must not notice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import amqp
import pytest

from outbox.dev.rabbitmq import rabbitmq_installed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CONFIGURED = bool(os.environ.get("OUTBOX_TEST_DATABASE_URL"))


def _chaos(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    completed = subprocess.run(
        [sys.executable, "-m", "outbox", "chaos", "--json", "--workdir", str(tmp_path), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    try:
        report = json.loads(completed.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no JSON verdict (exit {completed.returncode}):\n{completed.stderr[-4000:]}")
    return completed.returncode, report, completed.stderr


def _assert_clean(code: int, report: dict[str, Any], stderr: str) -> None:
    summary = {k: v for k, v in report.items() if k not in {"workdir"}}
    assert report["duplicates"] == 0, summary
    assert report["lost"] == 0, summary
    assert report["wrong"] == 0, summary
    assert code == 0, (summary, stderr[-2000:])
    assert report["intents"] == 500
    assert report["operations"] == 500
    assert report["kills"] >= 20
    assert report["pg_restarts"] >= 1
    assert report["effects"] == report["states"].get("confirmed", 0)


def _machine_broker() -> amqp.Connection | None:
    """A connection to the machine's RabbitMQ on 127.0.0.1:5672, if one runs there."""
    connection = amqp.Connection(
        host="127.0.0.1:5672",
        userid="guest",
        password="guest",  # noqa: S106 -- RabbitMQ's local default user
    )
    try:
        connection.connect()
    except OSError:
        return None
    return connection


@pytest.mark.skipif(not CONFIGURED, reason="the embedded pass runs the database-broker chaos")
def test_chaos_on_rabbitmq(tmp_path: Path) -> None:
    """Kills, a PostgreSQL crash and a restart of its own RabbitMQ node: no duplicate, nothing
    lost, and the machine's RabbitMQ untouched (a connection held to it lives through)."""
    if not rabbitmq_installed():
        if os.environ.get("CI") == "true":
            pytest.fail("CI needs rabbitmq-server and rabbitmqctl on PATH for the chaos run")
        pytest.skip("no RabbitMQ server installed here")
    machine = _machine_broker()
    try:
        code, report, stderr = _chaos(tmp_path, "--broker", "rabbitmq")
        if machine is not None:  # a restart of the machine's node would have reset it
            machine.channel().queue_declare("outbox-chaos-witness", auto_delete=True)
    finally:
        if machine is not None:
            machine.collect()
    _assert_clean(code, report, stderr)
    assert report["rabbitmq_restarts"] >= 1
    assert report["rabbitmq_node"].startswith("outbox-chaos-")


@pytest.mark.skipif(CONFIGURED, reason="the configured pass runs the RabbitMQ chaos")
def test_chaos_on_the_database_broker(tmp_path: Path) -> None:
    """Kills and a PostgreSQL crash, with PostgreSQL as the broker too: no duplicate or loss."""
    code, report, stderr = _chaos(tmp_path, "--broker", "database")
    _assert_clean(code, report, stderr)
