"""Recovery with real processes: a worker SIGKILLed mid-call is found, looked up, confirmed."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api
from outbox.dev.service import DeployService
from tests.processes import Services, wait_until
from tests.tool_configs import TOOL

pytestmark = pytest.mark.slow


def _state(engine: Engine, op_id: str) -> str:
    with engine.connect() as conn:
        return str(
            conn.execute(
                text("SELECT state FROM outbox.operations WHERE id = :id"), {"id": op_id}
            ).scalar_one()
        )


def test_a_worker_killed_mid_call_is_recovered_by_lookup(
    engine: Engine, service: DeployService, services: Services
) -> None:
    """SIGKILL a worker while its call is in flight: the sweep and a lookup confirm it, once."""
    env = {"OUTBOX_SENT_TIMEOUT": "6", "OUTBOX_SWEEP_INTERVAL": "1"}
    with Session(engine) as session, session.begin():
        op_id = str(api.enqueue(session, tool=TOOL, target="web", payload={"version": "2.0.0"}).id)
    # The remote takes 3 s to commit and answer: time enough to kill the caller mid-call.
    service.faults.arm_key(op_id, "slow", 1)
    worker = services.start("worker", "worker", "-c", "1", "-P", "prefork", env=env)
    services.start("relay", "relay", env=env)
    wait_until(lambda: _state(engine, op_id) == "sent", timeout=60, what="the sent commit")
    time.sleep(0.5)  # the request is on the wire
    worker.kill()
    wait_until(
        lambda: service.effects_by_key().get(op_id) == 1,
        timeout=20,
        what="the remote to commit the killed worker's request",
    )
    assert _state(engine, op_id) == "sent"  # nobody recorded an outcome
    services.start("worker-2", "worker", "-c", "2", "-P", "threads", env=env)
    services.start("beat", "beat", env=env)
    wait_until(
        lambda: _state(engine, op_id) == "confirmed", timeout=90, what="recovery to confirmed"
    )
    assert service.effects_by_key() == {op_id: 1}
    with engine.connect() as conn:
        reasons = [
            row.reason
            for row in conn.execute(
                text("SELECT reason FROM outbox.events WHERE operation_id = :id ORDER BY id"),
                {"id": op_id},
            )
        ]
    assert any("dispatcher lost" in reason for reason in reasons), reasons
    assert reasons[-1].startswith("lookup: applied at the remote"), reasons
