"""The long-running processes live through a PostgreSQL crash (on a cluster of the test's own).

Found by the chaos run: on the database broker, beat kept a broken broker session after
PostgreSQL came back and never published a sweep again, so `sent` and `unknown` rows waited
forever.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from outbox import migrate
from outbox.db import create_engine
from outbox.dev.clusters import LocalCluster
from outbox.dev.stack import Services
from outbox.workers.app import BROKER_MESSAGE_TABLE
from tests.processes import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A PostgreSQL cluster this test may crash."""
    own = LocalCluster(tmp_path / "postgres")
    own.start()
    try:
        yield own
    finally:
        own.stop()


def _published(engine: Engine) -> int:
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(text(f"SELECT count(*) FROM {BROKER_MESSAGE_TABLE}")).scalar_one()
            )
    except Exception:  # noqa: BLE001 -- down, or the table not made yet: nothing seen
        return 0


def test_beat_publishes_again_after_postgres_crashes(cluster: LocalCluster, tmp_path: Path) -> None:
    """Beat on the database broker resumes its sweeps once PostgreSQL is back."""
    url = cluster.create_database("outbox")
    engine = create_engine(url)
    migrate.upgrade(engine)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env |= {
        "OUTBOX_DATABASE_URL": url,
        "OUTBOX_HOME": str(tmp_path / "home"),
        "OUTBOX_SWEEP_INTERVAL": "0.5",
    }
    services = Services(env, tmp_path)
    try:
        beat = services.start("beat", "beat", "--log-level", "WARNING")
        wait_until(lambda: _published(engine) > 0, timeout=60, what="beat's first sweep")
        cluster.crash()
        time.sleep(2)  # beat's next runs fail while the server is down
        cluster.start()
        engine.dispose()
        after_restart = _published(engine)
        wait_until(
            lambda: _published(engine) > after_restart + 2,
            timeout=30,
            what="beat to publish sweeps again after the restart",
        )
        assert beat.alive()
    finally:
        services.stop_all()
        engine.dispose()
