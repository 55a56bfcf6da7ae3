"""The composition root, proven: Celery's own command line on ``outbox.cli.celery_app``, started
by hand, has every task and runs the sweep; ``outbox worker|beat|flower`` start that app."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from outbox import migrate
from outbox.db import create_engine
from outbox.states import State
from outbox.workers.app import DISPATCH_TASK, ESCALATE_TASK, LOOKUP_TASK, SWEEP_TASK
from tests.acceptance.conftest import REPO, Result, clean_environment
from tests.conftest import Databases
from tests.factories import age, make_operation
from tests.processes import Service, wait_until

APP = "outbox.cli.celery_app"
EVERY_TASK = {DISPATCH_TASK, LOOKUP_TASK, SWEEP_TASK, ESCALATE_TASK}


@pytest.fixture
def own_database(databases: Databases) -> Iterator[tuple[str, Engine]]:
    """A database of its own (so a deployment of its own: queues no other test uses)."""
    url = databases.create()
    engine = create_engine(url)
    migrate.upgrade(engine)
    yield url, engine
    engine.dispose()


def _celery(*args: str, env: dict[str, str], timeout: float = 60) -> Result:
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )
    return Result(done.returncode, done.stdout, done.stderr)


def _state(engine: Engine, operation_id: uuid.UUID) -> str:
    with engine.connect() as conn:
        return str(
            conn.execute(
                text("SELECT state FROM outbox.operations WHERE id = :id"), {"id": operation_id}
            ).scalar_one()
        )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_started_by_hand_has_every_task_and_runs_the_sweep(
    own_database: tuple[str, Engine],
    rabbitmq_url: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """`celery -A outbox.cli.celery_app worker` (not `outbox worker`) answers `inspect
    registered` with the dispatch, lookup, sweep and escalation tasks; with `celery -A … beat`
    it sweeps: a `sent` operation whose dispatcher is gone moves on to `unknown`."""
    url, engine = own_database
    stuck = make_operation(engine, State.SENT)
    age(engine, stuck.id, 600, "sent_at", "first_sent_at")  # past OUTBOX_SENT_TIMEOUT (60 s)
    env = clean_environment(
        OUTBOX_DATABASE_URL=url,
        OUTBOX_BROKER_URL=rabbitmq_url,
        OUTBOX_HOME=str(tmp_path / "home"),
        OUTBOX_SWEEP_INTERVAL="1",
    )
    node = f"byhand-{uuid.uuid4().hex[:8]}@localhost"
    worker = Service(
        "celery-worker",
        [
            *("-A", APP, "worker", "-Q", "dispatch,lookup,reconcile,human", "-P", "threads"),
            *("-c", "2", "-n", node, "-l", "INFO"),
        ],
        env,
        tmp_path,
        module="celery",
    )
    started = [worker]
    try:
        wait_until(
            lambda: " ready." in worker.output() or not worker.alive(),
            timeout=60,
            what="the hand-started worker to be ready",
        )
        assert worker.alive(), worker.output()[-4000:]

        inspected = _celery("inspect", "registered", "--json", "-d", node, "-t", "10", env=env)
        assert inspected.code == 0, inspected.stdout + inspected.stderr
        registered = json.loads(inspected.stdout)[node]
        assert {entry.split()[0] for entry in registered} >= EVERY_TASK, registered
        assert _state(engine, stuck.id) == State.SENT.value  # nothing swept it yet

        beat = Service(
            "celery-beat",
            ["-A", APP, "beat", "-s", str(tmp_path / "celerybeat-schedule"), "-l", "INFO"],
            env,
            tmp_path,
            module="celery",
        )
        started.append(beat)
        wait_until(
            lambda: _state(engine, stuck.id) != State.SENT.value,
            timeout=60,
            interval=0.5,
            what="the sweep to move the lost dispatcher's operation out of `sent`",
        )
        with engine.connect() as conn:
            moves = conn.execute(
                text(
                    "SELECT from_state, to_state, actor FROM outbox.events "
                    "WHERE operation_id = :id ORDER BY id"
                ),
                {"id": stuck.id},
            ).all()
        assert ("sent", "unknown", "sweep") in [tuple(move) for move in moves], moves
    finally:
        for service in reversed(started):
            service.stop()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            for service in started:
                print(f"----- {service.name} -----\n{service.output()[-6000:]}")  # noqa: T201


#: Replaces the Celery start of the one app object, then runs the real `outbox` CLI: what it
#: prints proves which object the command started, with which arguments.
_RECORD_THE_START = """
import sys
import outbox.cli.celery_app as root

def record(how):
    def started(argv):
        print("started outbox.cli.celery_app.app", how, *argv)
    return started

root.app.worker_main = record("worker_main")
root.app.start = record("start")
sys.argv = ["outbox", *sys.argv[1:]]
from outbox.cli import main
main()
"""


@pytest.mark.parametrize(
    ("command", "started"),
    [
        (
            ("worker", "-c", "1", "--no-tools"),
            "worker_main worker -Q dispatch,lookup,reconcile,human -c 1",
        ),
        (("beat",), "start beat"),
        (("flower", "--no-auth"), "start flower --address=127.0.0.1 --port=5555"),
    ],
)
def test_outbox_commands_start_the_composition_root_app(
    command: tuple[str, ...], started: str, cli_env: dict[str, str], engine: Engine
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _RECORD_THE_START, *command],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"started outbox.cli.celery_app.app {started}" in done.stdout, done.stdout
