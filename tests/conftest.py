"""Fixtures shared by every test: a real PostgreSQL, a fresh database per test session.

``OUTBOX_TEST_DATABASE_URL`` points at a server on which the tests may create and drop
databases (CI: the machine's PostgreSQL). Unset, the tests start the embedded PostgreSQL
under ``.outbox-test/``, which is what a new user's machine does.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, make_url, text
from sqlalchemy.orm import Session

from outbox import embedded, migrate
from outbox.db import create_engine
from outbox.published import PUBLISHED
from outbox.tools import close_thread_loop
from outbox.workers.app import BROKER_MESSAGE_TABLE

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _close_tool_loop() -> Iterator[None]:
    """Close the event loop (and its HTTP client) a test's dispatch opened on this thread:
    each test starts without another's kept-alive connections, and the session ends without
    aiohttp's "Unclosed client session" warnings."""
    yield
    close_thread_loop()


#: The embedded clusters a run can start in the repository: the tests' own, and the CLI's
#: default ``OUTBOX_HOME`` (a command run there with nothing configured starts it).
_REPO_CLUSTERS = (REPO / ".outbox-test", REPO / ".outbox")


@pytest.fixture(scope="session", autouse=True)
def _stop_the_embedded_servers_this_session_started() -> Iterator[None]:
    """Every embedded server under the repository that this session started, by any test or
    subprocess, is stopped when it ends; one that ran before the session is left running.

    Without it a server outlived the run (found orphaned, parent 1, long after), and the next
    session took it for one that ran before and left it too.
    """
    before = {home: embedded.status(home).running for home in _REPO_CLUSTERS}
    yield
    for home, was_running in before.items():
        if not was_running:
            embedded.stop(home)


@pytest.fixture(scope="session")
def admin_url() -> Iterator[str]:
    """A URL on a server where the tests may create databases.

    The embedded server this session started is stopped when the session ends
    (:func:`_stop_the_embedded_servers_this_session_started`).
    """
    configured = os.environ.get("OUTBOX_TEST_DATABASE_URL")
    if configured:
        yield configured
        return
    # Stopped at the end of the session if it started here (the fixture above).
    yield embedded.ensure_running(REPO / ".outbox-test")


class Databases:
    """Creates throw-away databases on the test server and drops them at the end."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        self.created: list[str] = []

    def create(self) -> str:
        """A new, empty database; returns its URL."""
        name = f"outbox_test_{uuid.uuid4().hex[:12]}"
        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        self.created.append(name)
        return make_url(self.admin_url).set(database=name).render_as_string(hide_password=False)

    def drop_all(self) -> None:
        with self.admin.connect() as conn:
            for name in self.created:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        self.admin.dispose()


@pytest.fixture(scope="session")
def databases(admin_url: str) -> Iterator[Databases]:
    """The factory of throw-away databases."""
    factory = Databases(admin_url)
    yield factory
    factory.drop_all()


@pytest.fixture(scope="session")
def database_url(databases: Databases) -> str:
    """A database migrated to head, shared by the session (tables emptied per test)."""
    url = databases.create()
    engine = create_engine(url)
    migrate.upgrade(engine)
    engine.dispose()
    return url


@pytest.fixture(scope="session")
def _session_engine(database_url: str) -> Iterator[Engine]:
    engine = create_engine(database_url, pool_size=10, max_overflow=20)
    yield engine
    engine.dispose()


@pytest.fixture
def engine(_session_engine: Engine) -> Engine:
    """An engine on the migrated test database, emptied before the test (the database
    broker's messages too: a stack an earlier test stopped may have left some)."""
    with _session_engine.begin() as conn:
        conn.execute(
            text(
                "TRUNCATE outbox.operations, outbox.events, outbox.relays, "
                "outbox.webhook_deliveries, outbox.waiters, outbox.pruned_intents, "
                "outbox.tool_policies, outbox.api_tokens, outbox.operators, "
                "outbox.console_sessions, "
                "outbox.signin_failures, outbox.guard_breakers, outbox.guard_buckets, "
                "outbox.guard_resets, outbox.budgets, outbox.budget_usage, outbox.budget_alerts, "
                "outbox.sagas, outbox.saga_steps, outbox.saga_events"
            )
        )
        if conn.execute(text("SELECT to_regclass(:t)"), {"t": BROKER_MESSAGE_TABLE}).scalar():
            conn.execute(text(f"DELETE FROM {BROKER_MESSAGE_TABLE}"))
    # The tools an earlier test published are gone with the table: so is this process's copy.
    PUBLISHED.clear()
    return _session_engine


@pytest.fixture
def session(engine: Engine) -> Iterator[Session]:
    """A session on the emptied test database; the test begins and commits as it needs."""
    with Session(engine) as db_session:
        yield db_session


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.fixture(scope="session")
def rabbitmq_url() -> Iterator[str]:
    """An AMQP URL on a throw-away vhost of the local RabbitMQ (skips without one, not in CI)."""
    configured = os.environ.get("OUTBOX_TEST_BROKER_URL")
    if configured:
        yield configured
        return
    if not _port_open(5672):
        if os.environ.get("CI") == "true":
            pytest.fail("RabbitMQ is not running on 127.0.0.1:5672, and CI requires it")
        pytest.skip("RabbitMQ is not running on 127.0.0.1:5672")
    vhost = f"outbox_test_{uuid.uuid4().hex[:8]}"
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        yield "amqp://guest:guest@127.0.0.1:5672//"
        return
    subprocess.run([ctl, "add_vhost", vhost], check=True, capture_output=True)
    subprocess.run(
        [ctl, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*"],
        check=True,
        capture_output=True,
    )
    yield f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
    subprocess.run([ctl, "delete_vhost", vhost], check=False, capture_output=True)


@pytest.fixture(params=["rabbitmq", "database"])
def broker(request: pytest.FixtureRequest) -> str | None:
    """The broker URL: a RabbitMQ vhost's, or ``None`` for the database broker (a test
    picks one with ``@pytest.mark.parametrize("broker", [...], indirect=True)``)."""
    if request.param == "rabbitmq":
        return str(request.getfixturevalue("rabbitmq_url"))
    return None


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the test item, so fixtures can tell a failed test."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
