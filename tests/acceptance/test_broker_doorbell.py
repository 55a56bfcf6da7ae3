"""A worker on the database broker with a long poll interval still dispatches at once.

Real relay and worker processes. With ``OUTBOX_BROKER_POLL_INTERVAL=60`` the worker would
find a message only every minute by polling; each intent here must be confirmed within 20 s,
so only a NOTIFY can have woken it: enqueue's, while the worker takes due operations itself
(the default, change 38), or the relay's publish (``OUTBOX_BROKER_DIRECT_TAKE=false``).
And a worker taking directly needs no relay at all, while a relay beside it stands by.
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


def _messages_written(engine: Engine) -> int:
    """Messages in the database broker's table (the worker deletes what it takes; the
    sequence says how many were ever written)."""
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT last_value FROM message_id_sequence")).scalar_one())


@pytest.mark.parametrize("broker", ["database"], indirect=True)
@pytest.mark.parametrize("direct", ["true", "false"], ids=["direct-take", "relay-messages"])
def test_a_publish_wakes_a_worker_with_a_long_poll_interval(
    engine: Engine, broker: str | None, direct: str, stack_env: dict[str, str], services: Services
) -> None:
    """Three intents one after the other, each confirmed well before the next poll: after
    the first, the worker has polled its empty queues and would sleep for a minute."""
    assert broker is None
    env = {
        **stack_env,
        "OUTBOX_BROKER_POLL_INTERVAL": str(POLL_INTERVAL_S),
        "OUTBOX_BROKER_DIRECT_TAKE": direct,
    }
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


@pytest.mark.parametrize("broker", ["database"], indirect=True)
def test_a_worker_taking_directly_needs_no_relay_and_a_relay_beside_it_stands_by(
    engine: Engine, broker: str | None, stack_env: dict[str, str], services: Services
) -> None:
    """A worker alone confirms intents (no relay, no message written for them); a relay
    started beside it says it stands by, and still no intent goes through a message."""
    assert broker is None
    env = {**stack_env, "OUTBOX_BROKER_POLL_INTERVAL": str(POLL_INTERVAL_S)}
    worker = services.start("worker", "worker", "-c", "2", "-P", "threads", env=env)
    first = _enqueue(engine, "direct-0")
    wait_until(
        functools.partial(_confirmed, engine, first),
        timeout=120.0,
        interval=0.2,
        what="an intent confirmed by a worker with no relay",
    )
    assert "taking due operations directly" in worker.output()
    before = _messages_written(engine)
    relay = services.start("relay", "relay", env=env)
    wait_until(
        lambda: "relay standing by" in relay.output(),
        timeout=60.0,
        interval=0.2,
        what="the relay to stand by",
    )
    for i in range(1, 4):
        op_id = _enqueue(engine, f"direct-{i}")
        wait_until(
            functools.partial(_confirmed, engine, op_id),
            timeout=WAIT_S,
            interval=0.2,
            what=f"intent {i} confirmed beside a standing-by relay",
        )
    assert _messages_written(engine) == before
