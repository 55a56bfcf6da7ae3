"""A worker on the database broker with a long poll interval still dispatches at once.

Real relay and worker processes. With ``OUTBOX_BROKER_POLL_INTERVAL=60`` the worker would
find a message only every minute by polling; each intent here must be confirmed within 20 s,
so only the publish's NOTIFY (the doorbell) can have woken it.
"""

from __future__ import annotations

import functools

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api
from tests.processes import Services, wait_until
from tests.tool_configs import TOOL

pytestmark = pytest.mark.slow

POLL_INTERVAL_S = 60
#: Generous on a loaded machine, and a third of the poll interval.
WAIT_S = 20.0


def _enqueue(engine: Engine, key: str) -> str:
    with Session(engine) as session, session.begin():
        op = api.enqueue(
            session, tool=TOOL, target="project-1", payload={"version": "1.0.0"}, intent_key=key
        )
        return str(op.id)


def _confirmed(engine: Engine, op_id: str) -> bool:
    with engine.connect() as conn:
        state = conn.execute(
            text("SELECT state FROM outbox.operations WHERE id = :id"), {"id": op_id}
        ).scalar_one()
    return str(state) == "confirmed"


@pytest.mark.parametrize("broker", ["database"], indirect=True)
def test_a_publish_wakes_a_worker_with_a_long_poll_interval(
    engine: Engine, broker: str | None, stack_env: dict[str, str], services: Services
) -> None:
    """Three intents one after the other, each confirmed well before the next poll: after
    the first, the worker has polled its empty queues and would sleep for a minute."""
    assert broker is None
    env = {**stack_env, "OUTBOX_BROKER_POLL_INTERVAL": str(POLL_INTERVAL_S)}
    services.start("worker", "worker", "-c", "2", "-P", "threads", env=env)
    services.start("relay", "relay", env=env)
    for i in range(3):
        op_id = _enqueue(engine, f"doorbell-{i}")
        wait_until(
            functools.partial(_confirmed, engine, op_id),
            timeout=WAIT_S if i else 120.0,  # the first also waits for the processes to start
            interval=0.2,
            what=f"intent {i} confirmed",
        )
