"""A dispatch message's hard time limit bounds each attempt, not the message: a real prefork
worker given one message naming several slow operations runs every attempt to its end."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from uuid import UUID

import pytest
from celery import Celery
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api
from outbox.config import load_settings
from outbox.deployment import deployment_name
from outbox.dev.service import DeployService
from outbox.relay import OutboundMessage
from outbox.workers.app import celery_settings
from outbox.workers.publish import CeleryPublisher
from tests.acceptance.conftest import clean_environment
from tests.processes import Services, wait_until
from tests.tool_configs import TOOL, http_tool_toml

pytestmark = pytest.mark.slow

#: Each request takes this long at the service (its ``slow`` fault).
SLOW_S = 1.0
#: Operations in the one message: together far longer than the message's hard limit.
OPERATIONS = 6


@pytest.fixture
def slow_service() -> Iterator[DeployService]:
    """The reference service, whose `slow` fault answers after SLOW_S."""
    with DeployService(port=0, fault_delay_s=SLOW_S) as running:
        yield running


def _enqueue_slow(engine: Engine) -> list[str]:
    with Session(engine) as session, session.begin():
        return [
            str(
                api.enqueue(
                    session,
                    tool=TOOL,
                    target="project-a",
                    payload={"version": f"2.0.{i}", "_fault": "slow"},
                    intent_key=f"slow-{i}",
                ).id
            )
            for i in range(OPERATIONS)
        ]


def _publish_as_one_message(database_url: str, broker: str | None, ids: list[str]) -> None:
    settings = load_settings(database_url=database_url, broker_url=broker)
    app = Celery("outbox-test")
    app.conf.update(celery_settings(settings, deployment=deployment_name(settings)))
    publisher = CeleryPublisher(app, ops_per_message=OPERATIONS, spread=1)
    try:
        messages = [OutboundMessage(UUID(one), TOOL, "project-a") for one in ids]
        assert len(publisher.publish(messages)) == OPERATIONS
    finally:
        publisher.close()


def _states(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id::text, state FROM outbox.operations")).all()
    return {str(op_id): str(state) for op_id, state in rows}


def test_a_message_of_slow_operations_confirms_each_one(
    engine: Engine,
    broker: str | None,
    database_url: str,
    slow_service: DeployService,
    tmp_path: Path,
) -> None:
    """Six 1 s operations in one message whose hard limit is 3.5 s (send deadline 0.5 s +
    timeout 2 s + slack 1 s) are each confirmed once; none is killed into unknown."""
    config = tmp_path / "tools.toml"
    config.write_text(
        http_tool_toml(slow_service.url, timeout_s=2.0, send_deadline_s=0.5, inflight_horizon_s=60),
        encoding="utf-8",
    )
    env = clean_environment(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_CONFIG=str(config),
        OUTBOX_HOME=str(tmp_path / "home"),
        OUTBOX_TASK_TIME_LIMIT_SLACK="1",
    )
    if broker is not None:
        env["OUTBOX_BROKER_URL"] = broker
    ids = _enqueue_slow(engine)
    _publish_as_one_message(database_url, broker, ids)
    group = Services(env, tmp_path)
    try:
        # prefork: the pool that enforces Celery's hard time limit (by killing the child).
        group.start("worker", "worker", "-c", "1", "-P", "prefork")
        wait_until(
            lambda: set(_states(engine).values()) == {"confirmed"},
            timeout=60,
            interval=0.5,
            what=f"{OPERATIONS} confirmed operations",
        )
    except AssertionError:
        for name, output in group.logs():
            print(f"----- {name} -----\n{output[-6000:]}")  # noqa: T201
        raise
    finally:
        group.stop_all()
    assert slow_service.effects_by_key() == dict.fromkeys(ids, 1)
    with engine.connect() as conn:
        doubted = conn.execute(
            text("SELECT count(*) FROM outbox.events WHERE to_state IN ('unknown', 'needs_human')")
        ).scalar_one()
    assert doubted == 0
