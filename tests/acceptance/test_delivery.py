"""Delivery end to end: `outbox relay` and `outbox worker` as real processes, a real broker,
a TOML-declared HTTP tool, and the reference service's own ledger as the judge."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api
from outbox.dev.service import DeployService
from outbox.logs import Action
from tests.acceptance.conftest import run_outbox
from tests.processes import Services, wait_until
from tests.proxy import TcpProxy
from tests.tool_configs import TOOL

pytestmark = pytest.mark.slow


def _enqueue(engine: Engine, count: int, prefix: str) -> list[str]:
    ids: list[str] = []
    with Session(engine) as session:
        for start in range(0, count, 100):
            with session.begin():
                for i in range(start, min(start + 100, count)):
                    op = api.enqueue(
                        session,
                        tool=TOOL,
                        target=f"project-{i % 7}",
                        payload={"version": f"1.0.{i}"},
                        intent_key=f"{prefix}-{i}",
                    )
                    ids.append(str(op.id))
    return ids


def _states(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT state, count(*) FROM outbox.operations GROUP BY state"))
        return {str(state): int(count) for state, count in rows}


def _wait_all_confirmed(engine: Engine, total: int, timeout: float) -> None:
    wait_until(
        lambda: _states(engine).get("confirmed", 0) == total,
        timeout=timeout,
        interval=0.5,
        what=f"{total} confirmed operations",
    )


def _assert_one_effect_each(engine: Engine, service: DeployService, ids: list[str]) -> None:
    effects = service.effects_by_key()
    assert len(service.ledger()) == len(ids)
    assert all(effects.get(op_id) == 1 for op_id in ids)
    ledger_refs = {effect.key: effect.id for effect in service.ledger()}
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id::text, remote_ref FROM outbox.operations")).all()
    refs = {str(op_id): str(ref) for op_id, ref in rows}
    assert refs == ledger_refs


def test_every_intent_reaches_the_remote_exactly_once(
    engine: Engine, broker: str | None, service: DeployService, services: Services
) -> None:
    """Intents enqueued through the API and the CLI are all confirmed with one effect each."""
    count = 1000 if broker else 200
    ids = _enqueue(engine, count - 1, "bulk")
    made = run_outbox(
        "enqueue",
        "--tool",
        TOOL,
        "--target",
        "cli-project",
        "--payload",
        '{"version": "9.9.9"}',
        "--json",
        env=services.env,
    )
    assert made.code == 0, made.stderr
    ids.append(made.json()["id"])
    services.start("worker", "worker", "-c", "8", "-P", "threads")
    services.start("relay", "relay")
    _wait_all_confirmed(engine, count, timeout=240)
    _assert_one_effect_each(engine, service, ids)


def test_a_relay_killed_between_publish_and_commit_causes_no_duplicate(
    engine: Engine, service: DeployService, services: Services
) -> None:
    """A relay that dies after publishing, before recording it, republishes: still one effect."""
    ids = _enqueue(engine, 50, "crash")
    crashed = services.start(
        "relay-crashing", "relay", env={"OUTBOX_FAULTS": "relay_after_publish=exit@1"}
    )
    crashed.process.wait(60)
    assert crashed.process.returncode == 86  # the fault point's exit status
    with engine.connect() as conn:
        published = conn.execute(
            text("SELECT count(*) FROM outbox.operations WHERE published_at IS NOT NULL")
        ).scalar_one()
    assert published == 0
    services.start("worker", "worker", "-c", "4", "-P", "threads")
    services.start("relay", "relay")
    _wait_all_confirmed(engine, 50, timeout=120)
    _assert_one_effect_each(engine, service, ids)


def test_two_relays_lose_nothing(
    engine: Engine, service: DeployService, services: Services
) -> None:
    """Two relays and two workers deliver every intent once."""
    services.start("worker-1", "worker", "-c", "4", "-P", "threads", "-n", "w1@%h")
    services.start("worker-2", "worker", "-c", "4", "-P", "threads", "-n", "w2@%h")
    services.start("relay-1", "relay", "--batch-size", "20")
    services.start("relay-2", "relay", "--batch-size", "20")
    ids = _enqueue(engine, 300, "two")
    _wait_all_confirmed(engine, 300, timeout=180)
    _assert_one_effect_each(engine, service, ids)


@pytest.mark.parametrize("broker", ["database"], indirect=True)
def test_relay_stops_cleanly_on_sigterm(services: Services) -> None:
    """SIGTERM makes the relay finish its batch and exit 0."""
    # Ready first: a SIGTERM that lands while Python is still importing kills the process
    # before the relay has a handler (what is tested here is a running relay's stop).
    relay = services.start("relay", "relay", "--poll-interval", "30")
    wait_until(
        lambda: Action.RELAY_STARTED in relay.output() or not relay.alive(),
        timeout=60,
        what="the relay to start",
    )
    time.sleep(1)
    assert relay.alive(), relay.output()
    assert relay.stop() == 0, relay.output()
    assert "relay stopped" in relay.output() or Action.RELAY_STOPPED in relay.output()


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_broker_outage_while_the_relay_runs(
    engine: Engine,
    rabbitmq_url: str,
    service: DeployService,
    stack_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """With RabbitMQ unreachable no row is marked published; once it is back, all arrive once."""
    port = int(rabbitmq_url.split("@", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
    vhost = rabbitmq_url.rsplit("/", 1)[1]
    proxy = TcpProxy(port).start()
    env = {**stack_env, "OUTBOX_BROKER_URL": rabbitmq_url}
    group = Services(env, tmp_path)
    try:
        group.start("worker", "worker", "-c", "4", "-P", "threads")
        group.start(
            "relay",
            "relay",
            env={"OUTBOX_BROKER_URL": f"amqp://guest:guest@127.0.0.1:{proxy.port}/{vhost}"},
        )
        first = _enqueue(engine, 5, "before")
        _wait_all_confirmed(engine, 5, timeout=60)
        proxy.cut()
        during = _enqueue(engine, 20, "during")
        time.sleep(3)
        with engine.connect() as conn:
            published = conn.execute(
                text(
                    "SELECT count(*) FROM outbox.operations "
                    "WHERE state <> 'confirmed' AND published_at IS NOT NULL"
                )
            ).scalar_one()
        assert published == 0
        proxy.restore()
        _wait_all_confirmed(engine, 25, timeout=120)
        _assert_one_effect_each(engine, service, first + during)
    finally:
        group.stop_all()
        proxy.stop()
