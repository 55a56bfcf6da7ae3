"""`outbox flower`: local by default, basic auth required, dispatch tasks named by operation."""

from __future__ import annotations

import socket

import httpx
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import api
from outbox.states import State
from tests.acceptance.conftest import CLI, clean_environment, run_outbox
from tests.celery_events import TaskEvents, event_exchange, types
from tests.processes import Services, wait_until
from tests.tool_configs import TOOL

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        httpx.get(url, timeout=1)
    except httpx.HTTPError:
        return False
    return True


def test_flower_refuses_to_start_without_credentials(outbox_cli: CLI) -> None:
    """No credentials and no --no-auth: a usage error on one line, exit 2, nothing served."""
    result = outbox_cli("flower")
    assert result.code == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "OUTBOX_FLOWER_BASIC_AUTH" in result.stderr
    assert "--no-auth" in result.stderr


def test_flower_rejects_malformed_credentials(cli_env: dict[str, str]) -> None:
    """Credentials that are not user:password are refused before anything starts."""
    result = run_outbox("flower", env={**cli_env, "OUTBOX_FLOWER_BASIC_AUTH": "no-colon"})
    assert result.code == 2
    assert "user:password" in result.stderr
    assert "no-colon" not in result.stderr  # a password is never echoed


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_flower_shows_dispatch_tasks_behind_basic_auth(
    engine: Engine, services: Services, stack_env: dict[str, str]
) -> None:
    """401 without credentials; with them, a dispatch task's operation id, tool and target."""
    port = _free_port()
    credentials = "op:" + "correct-horse"  # a test's throw-away credentials
    flower = services.start(
        "flower", "flower", "--port", str(port), env={"OUTBOX_FLOWER_BASIC_AUTH": credentials}
    )
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: _answers(base), timeout=30, what="Flower to listen")
    assert httpx.get(f"{base}/api/tasks", timeout=5).status_code == 401
    auth = ("op", "correct-horse")
    assert httpx.get(f"{base}/api/tasks", auth=auth, timeout=5).status_code == 200

    services.start("worker", "worker", "-P", "threads", "-c", "2")
    services.start("relay", "relay")
    with Session(engine) as session, session.begin():
        op = api.enqueue(session, tool=TOOL, target="web", payload={"version": "4.2.0"})

    def dispatch_task_seen() -> bool:
        tasks = httpx.get(f"{base}/api/tasks", auth=auth, timeout=5).json()
        return any(str(op.id) in str(task.get("kwargs")) for task in tasks.values())

    wait_until(dispatch_task_seen, timeout=60, what="the dispatch task in Flower")
    tasks = httpx.get(f"{base}/api/tasks", auth=auth, timeout=5).json()
    [task] = [t for t in tasks.values() if str(op.id) in str(t.get("kwargs"))]
    assert task["name"] == "outbox.dispatch"
    assert TOOL in task["kwargs"]
    assert "web" in task["kwargs"]
    # The password is handed over in the environment, never on a command line.
    with open(f"/proc/{flower.pid}/cmdline", "rb") as cmdline:
        assert b"correct-horse" not in cmdline.read()
    assert "correct-horse" not in flower.output()


def test_flower_help_says_where_the_truth_is() -> None:
    """--help explains binding, auth, and that Flower forgets on restart."""
    result = run_outbox("flower", "--help", env=clean_environment())
    assert result.code == 0
    assert "127.0.0.1" in result.stdout
    assert "forgets" in result.stdout


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
@pytest.mark.parametrize("task_events", ["true", "false"])
def test_the_workers_send_task_events_only_when_told(
    engine: Engine, services: Services, broker: str, database_url: str, task_events: str
) -> None:
    """A real relay and worker: with OUTBOX_TASK_EVENTS on, the dispatch task's received,
    started and succeeded events reach Celery's event exchange (what Flower reads); off, the
    operation is confirmed just the same and no task event is sent."""
    wanted = {"task-sent", "task-received", "task-started", "task-succeeded"}
    with TaskEvents(broker, event_exchange(database_url)) as listener:
        env = {"OUTBOX_TASK_EVENTS": task_events}
        services.start("worker", "worker", "-P", "threads", "-c", "2", env=env)
        services.start("relay", "relay", env=env)
        with Session(engine) as session, session.begin():
            op = api.enqueue(session, tool=TOOL, target="web", payload={"version": "4.3.0"})
        assert api.wait(op.id, timeout=60, engine=engine).state is State.CONFIRMED
        seen = types(
            listener.collect(
                until=lambda events: wanted <= types(events),
                timeout=10.0 if task_events == "true" else 2.0,
            )
        )
    if task_events == "true":
        assert wanted <= seen
    else:
        assert seen == set()


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_flower_warns_that_task_events_are_off(services: Services) -> None:
    """With OUTBOX_TASK_EVENTS=false Flower still starts, and says it will show no tasks."""
    port = _free_port()
    flower = services.start(
        "flower", "flower", "--no-auth", "--port", str(port), env={"OUTBOX_TASK_EVENTS": "false"}
    )
    wait_until(lambda: _answers(f"http://127.0.0.1:{port}/"), timeout=30, what="Flower")
    assert "OUTBOX_TASK_EVENTS is off" in flower.output()


@pytest.mark.parametrize("broker", ["database"], indirect=True)
def test_flower_warns_that_the_database_broker_shows_nothing(services: Services) -> None:
    """On the database broker Flower starts, and says up front that it will show nothing."""
    port = _free_port()
    flower = services.start("flower", "flower", "--no-auth", "--port", str(port))
    wait_until(lambda: _answers(f"http://127.0.0.1:{port}/"), timeout=30, what="Flower")
    assert "database broker carries no Celery events" in flower.output()
