"""A worker refuses to start on a primary whose streaming standbys are all asynchronous.

A real primary and a real streaming standby (``pg_basebackup -R``) of the test's own, and the
real ``outbox worker`` as a subprocess on the database broker.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from outbox import migrate
from outbox.db import create_engine
from outbox.dev.clusters import LocalCluster
from outbox.dev.stack import Service, Services
from outbox.logs import Action
from tests.acceptance.conftest import clean_environment
from tests.processes import wait_until

pytestmark = pytest.mark.slow

REFUSAL = "outbox worker: refusing to start: the database streams to 1 standby(s) and none is"


class Replicated:
    """A primary with one streaming standby, and the primary's migrated database."""

    def __init__(self, root: Path) -> None:
        self.primary = LocalCluster(root / "primary")
        self.primary.start()
        self.url = self.primary.create_database("outbox")
        self.engine = create_engine(self.url)
        try:
            migrate.upgrade(self.engine)
            self.standby = self.primary.start_standby(root / "standby")
        except BaseException:
            self.engine.dispose()
            self.primary.stop()
            raise

    def sync_states(self) -> list[str]:
        """The standbys' ``sync_state`` as the primary reports them."""
        with self.engine.connect() as conn:
            return list(conn.execute(text("SELECT sync_state FROM pg_stat_replication")).scalars())

    def make_synchronous(self) -> None:
        """Name every standby in ``synchronous_standby_names`` and reload the configuration."""
        with self.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            conn.execute(text("ALTER SYSTEM SET synchronous_standby_names = '*'"))
            conn.execute(text("SELECT pg_reload_conf()"))

    def close(self) -> None:
        self.engine.dispose()
        try:
            self.standby.stop()
        finally:
            self.primary.stop()


@pytest.fixture
def replicated() -> Iterator[Replicated]:
    """A primary streaming to an asynchronous standby (both stopped at the end).

    Not under pytest's tmp_path: a pytest session starting meanwhile makes its parent
    ``/tmp/pytest-of-<user>`` private again, and the servers' own user (under root) could no
    longer reach their files to reload or stop.
    """
    root = Path(tempfile.mkdtemp(prefix="outbox-replicas-"))
    cluster = Replicated(root)
    try:
        wait_until(lambda: cluster.sync_states() == ["async"], timeout=60, what="the standby")
        yield cluster
    finally:
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)


def _worker(services: Services, name: str, **env: str) -> Service:
    # No tools: what is checked here is the start-up's replica check, not a tool.
    return services.start(name, "worker", "-P", "threads", "-c", "1", "--no-tools", env=env)


def _ready(worker: Service) -> bool:
    """Celery's own "celery@host ready." (not ``db_ready``, which comes before the checks)."""
    return " ready." in worker.output()


@pytest.mark.timeout(240)
def test_a_worker_refuses_async_standbys_unless_accepted_or_made_synchronous(
    replicated: Replicated, tmp_path: Path
) -> None:
    """With only an asynchronous standby the worker exits at start-up with one line naming
    OUTBOX_ALLOW_ASYNC_REPLICAS; with that setting, or once the standby is synchronous, it
    starts."""
    env = clean_environment(OUTBOX_DATABASE_URL=replicated.url, OUTBOX_HOME=str(tmp_path / "h"))
    services = Services(env, tmp_path)
    try:
        refused = _worker(services, "refused")
        wait_until(lambda: not refused.alive(), timeout=60, what="the worker to refuse")
        assert refused.process.returncode != 0
        lines = [line for line in refused.output().splitlines() if REFUSAL in line]
        assert lines, refused.output()
        assert "OUTBOX_ALLOW_ASYNC_REPLICAS=true" in lines[-1]
        assert "Traceback" not in refused.output()

        accepted = _worker(services, "accepted", OUTBOX_ALLOW_ASYNC_REPLICAS="true")
        wait_until(lambda: _ready(accepted), timeout=60, what="the accepting worker")
        assert Action.ASYNC_REPLICAS_ALLOWED in accepted.output()
        assert accepted.stop() == 0

        replicated.make_synchronous()
        wait_until(
            lambda: replicated.sync_states() == ["sync"],
            timeout=60,
            what="the standby to be synchronous",
        )
        synchronous = _worker(services, "synchronous")
        wait_until(lambda: _ready(synchronous), timeout=60, what="the worker on a sync standby")
        time.sleep(0.5)
        assert synchronous.alive()
        assert REFUSAL not in synchronous.output()
    finally:
        services.stop_all()
