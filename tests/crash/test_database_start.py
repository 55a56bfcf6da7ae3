"""The long-running components ride out a database that is down or restarting (on a cluster
of the test's own, never the machine's shared server).

Started while PostgreSQL is down, the relay, a worker, beat, `outbox api` and `outbox mcp`
wait for it with one line per try, say when it is ready and then work; past
OUTBOX_DB_START_TIMEOUT they exit 1 with one line. A restart under a running worker with
calls in flight is one line per error, never a traceback or the statement's text.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import api, migrate
from outbox.db import create_engine
from outbox.dev.clusters import LocalCluster, free_port
from outbox.dev.service import DeployService
from outbox.logs import Action
from outbox.states import State
from tests.acceptance.conftest import REPO, clean_environment
from tests.acceptance.test_cli_logs import parse_logfmt
from tests.factories import reload
from tests.processes import Service, Services, wait_until
from tests.tool_configs import TOOL, http_tool_toml

pytestmark = pytest.mark.slow

#: The components that wait for the database, and the arguments each is started with.
COMPONENTS: dict[str, tuple[str, ...]] = {
    "relay": ("relay",),
    "worker": ("worker", "-c", "2"),
    "beat": ("beat",),
    "api": ("api", "--port", "0"),
    "mcp": ("mcp", "--http", "--port", "0"),
}
#: What must never be in a log: a traceback, SQLAlchemy's statement or its parameters.
NEVER_LOGGED = ("Traceback", "[SQL", "SQL parameters", "sqlalche.me", "UPDATE outbox", "SELECT ")


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    """A PostgreSQL cluster this test may stop, crash and start (not started yet).

    Outside pytest's temporary root: another session starting on the machine makes that root
    private again, and the server's user could then not read its own pid file mid-start.
    """
    root = Path(tempfile.mkdtemp(prefix="outbox-dbstart-"))
    own = LocalCluster(root / "postgres")
    try:
        yield own
    finally:
        own.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def service() -> Iterator[DeployService]:
    """The reference service; its `slow` fault answers after 4 s."""
    with DeployService(port=0, fault_delay_s=4.0) as running:
        yield running


def _migrated(cluster: LocalCluster) -> str:
    """Start ``cluster``, make the outbox's database on it; its URL."""
    cluster.start()
    url = cluster.create_database("outbox")
    engine = create_engine(url)
    try:
        migrate.upgrade(engine)
    finally:
        engine.dispose()
    return url


def _environment(url: str, tmp_path: Path, service: DeployService, **more: str) -> dict[str, str]:
    config = tmp_path / "tools.toml"
    config.write_text(
        http_tool_toml(service.url, timeout_s=10.0, send_deadline_s=2.0, inflight_horizon_s=60),
        encoding="utf-8",
    )
    return clean_environment(
        OUTBOX_DATABASE_URL=url,
        OUTBOX_CONFIG=str(config),
        OUTBOX_HOME=str(tmp_path / "home"),
        OUTBOX_REPUBLISH_AFTER="2",
        **more,
    )


def _records(output: str) -> list[dict[str, str]]:
    """Every log line of a process's output, parsed (its other lines are the CLI's own)."""
    return [parse_logfmt(line) for line in output.splitlines() if line.startswith("time=")]


def _with(service: Service, action: Action) -> list[dict[str, str]]:
    return [r for r in _records(service.output()) if r.get("action") == action]


def _tried_twice_or_exited(service: Service) -> bool:
    return len(_with(service, Action.DB_WAITING)) >= 2 or not service.alive()


def _ready_or_exited(service: Service) -> bool:
    return bool(_with(service, Action.DB_READY)) or not service.alive()


def _enqueue(engine: Engine, key: str, payload: dict[str, str]) -> UUID:
    with Session(engine) as session, session.begin():
        op = api.enqueue(session, tool=TOOL, target="project-1", payload=payload, intent_key=key)
        return op.id


def _assert_clean(service: Service) -> None:
    output = service.output()
    for never in NEVER_LOGGED:
        assert never not in output, f"{service.name} logged {never!r}:\n{output[-4000:]}"


def test_components_started_while_the_database_is_down_wait_for_it_then_work(
    cluster: LocalCluster, tmp_path: Path, service: DeployService
) -> None:
    """Relay, worker, beat, api and mcp started with PostgreSQL down log one line per try,
    then a ready line once it is up, and an operation is then confirmed."""
    url = _migrated(cluster)
    cluster.stop()
    services = Services(_environment(url, tmp_path, service), tmp_path)
    engine = create_engine(url)
    try:
        started = {name: services.start(name, *args) for name, args in COMPONENTS.items()}
        for name, process in started.items():
            wait_until(
                functools.partial(_tried_twice_or_exited, process),
                timeout=120,
                what=f"{name} to try twice",
            )
            assert process.alive(), f"{name} exited:\n{process.output()[-3000:]}"
        cluster.start()
        for name, process in started.items():
            wait_until(
                functools.partial(_ready_or_exited, process),
                timeout=120,
                what=f"{name} to find the database",
            )
            assert process.alive(), f"{name} exited:\n{process.output()[-3000:]}"
        op_id = _enqueue(engine, "after-the-start", {"version": "1.0.0"})
        wait_until(
            lambda: reload(engine, op_id).state is State.CONFIRMED,
            timeout=120,
            interval=0.5,
            what="the operation to be confirmed",
        )
        for name, process in started.items():
            tries = _with(process, Action.DB_WAITING)
            assert [int(r["tries"]) for r in tries] == list(range(1, len(tries) + 1)), name
            assert all(r["component"] == name for r in tries)
            assert all(r["error"].startswith("OperationalError: ") for r in tries), tries
            (ready,) = _with(process, Action.DB_READY)
            assert int(ready["tries"]) == len(tries) + 1
            _assert_clean(process)
    finally:
        services.stop_all()
        engine.dispose()


def test_past_the_start_timeout_each_component_exits_1_with_one_line(tmp_path: Path) -> None:
    """With nothing listening and OUTBOX_DB_START_TIMEOUT=1, every component logs its tries
    and exits 1 with one line naming the setting."""
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/outbox"
    config = tmp_path / "tools.toml"
    config.write_text(http_tool_toml("http://127.0.0.1:9"), encoding="utf-8")
    env = clean_environment(
        OUTBOX_DATABASE_URL=url,
        OUTBOX_CONFIG=str(config),
        OUTBOX_HOME=str(tmp_path / "home"),
        OUTBOX_DB_START_TIMEOUT="1",
    )
    for name, args in COMPONENTS.items():
        done = subprocess.run(
            [sys.executable, "-m", "outbox", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
            check=False,
        )
        assert done.returncode == 1, (name, done.stderr)
        lines = done.stderr.splitlines()
        errors = [line for line in lines if not line.startswith("time=")]
        assert len(errors) == 1, (name, done.stderr)
        assert errors[0].startswith(f"error: {name}: gave up waiting for the database at ")
        assert "OUTBOX_DB_START_TIMEOUT" in errors[0]
        assert "Connection refused" in errors[0]
        tries = [r for r in _records(done.stderr) if r.get("action") == Action.DB_WAITING]
        assert tries, (name, done.stderr)
        assert "Traceback" not in done.stderr


def test_outbox_up_waits_for_a_configured_database_then_exits_1_with_one_line(
    tmp_path: Path,
) -> None:
    """`outbox up` on a configured server that does not answer waits like its components (one
    warning per try) before migrating, and past OUTBOX_DB_START_TIMEOUT exits 1 with one error
    line naming the setting, having started nothing."""
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/outbox"
    env = clean_environment(
        OUTBOX_DATABASE_URL=url,
        OUTBOX_HOME=str(tmp_path / "home"),
        OUTBOX_DB_START_TIMEOUT="1",
    )
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "up", "--no-tools"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    waits = [line for line in lines if line.startswith("warning: up: waiting for the database")]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(waits) >= 1, done.stderr
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("error: up: gave up waiting for the database at ")
    assert "OUTBOX_DB_START_TIMEOUT" in errors[0]
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "home" / "logs").exists(), "a component was started"


def test_a_restart_under_a_running_worker_is_one_line_per_error_without_sql(
    cluster: LocalCluster, tmp_path: Path, service: DeployService, rabbitmq_url: str
) -> None:
    """PostgreSQL crashed while a worker's calls are in flight: each message that meets the
    outage is one dispatch_error line (the operation's id, error class and message), with no
    traceback nor statement anywhere, and after the restart a new operation is confirmed."""
    url = _migrated(cluster)
    env = _environment(url, tmp_path, service, OUTBOX_BROKER_URL=rabbitmq_url)
    services = Services(env, tmp_path)
    engine = create_engine(url)
    try:
        relay = services.start("relay", "relay")
        worker = services.start("worker", "worker", "-c", "4", "-Q", "dispatch")
        slow = [
            _enqueue(engine, f"slow-{i}", {"version": f"1.{i}", "_fault": "slow"}) for i in range(3)
        ]
        wait_until(
            lambda: all(reload(engine, one).state is State.SENT for one in slow),
            timeout=60,
            what="the slow calls to be in flight",
        )
        engine.dispose()
        cluster.crash()
        # The remote answers while the database is down: the outcomes cannot be written.
        wait_until(lambda: len(service.ledger()) == len(slow), timeout=60, what="the calls")
        wait_until(
            lambda: len(_with(worker, Action.DISPATCH_ERROR)) >= len(slow),
            timeout=60,
            what="the worker to log the outcomes it could not write",
        )
        cluster.start()
        after = _enqueue(engine, "after-the-restart", {"version": "2.0"})
        wait_until(
            lambda: reload(engine, after).state is State.CONFIRMED,
            timeout=120,
            interval=0.5,
            what="an operation enqueued after the restart to be confirmed",
        )
        assert relay.alive(), relay.output()[-6000:]
        assert worker.alive(), worker.output()[-6000:]
        errors = _with(worker, Action.DISPATCH_ERROR)
        assert {r["operation_id"] for r in errors} == {str(one) for one in slow}
        # One line per error: as many as the messages that ended in an error.
        ended_in_error = [
            r
            for r in _records(worker.output())
            if r.get("logger") == "celery.app.trace" and r["msg"].endswith("'error'")
        ]
        assert len(errors) == len(ended_in_error)
        for record in errors:
            assert record["error"].startswith(("OperationalError: ", "DatabaseUnavailable: "))
            assert "\n" not in record["msg"] + record["error"]
            assert "exception" not in record
        for process in (relay, worker):
            _assert_clean(process)
    finally:
        services.stop_all()
        engine.dispose()
