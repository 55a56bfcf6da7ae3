"""A deployment that mixes workers taking directly with workers taking only messages.

A relay stands by while a worker takes due operations directly: it claims a row never
published only once it has been due ``standby_hold_back_s`` (10 s). A worker started with
``OUTBOX_BROKER_DIRECT_TAKE=false`` gets work only from the relay's messages, so beside a
busy taker it used to wait those 10 s for every row. It now keeps a ``consumer:`` row in
``outbox.relays`` (:mod:`outbox.workers.message_only`), and a relay that sees one publishes what
the takers left for ``defer_to_takers_s`` (0.2 s). Real relay and worker processes, RabbitMQ and
the database broker; the taker's one thread hung right after an operation's lock, so that it
takes nothing more.
"""

from __future__ import annotations

from uuid import UUID

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api, sql
from outbox.dev.service import DeployService
from outbox.relay import RelayConfig
from tests.processes import Services, wait_until
from tests.tool_configs import TOOL

pytestmark = pytest.mark.slow

#: What a row waited before this change, at the least: the relay's hold-back while standing by.
STANDBY_HOLD_BACK_S = RelayConfig().standby_hold_back_s


def _takers(engine: Engine) -> sql.relay.Takers:
    with engine.connect() as conn:
        return sql.relay.takers(conn, heartbeat_within_s=30.0)


def _enqueue(engine: Engine, count: int) -> list[UUID]:
    with Session(engine) as session, session.begin():
        return [
            api.enqueue(session, tool=TOOL, target="project-1", payload={"v": i}).id
            for i in range(count)
        ]


def _waits(engine: Engine, ids: list[UUID]) -> dict[UUID, tuple[str, float | None]]:
    """Each operation's state and how long it waited, by the database's clock, between
    becoming due and its first ``sent`` (None: never sent)."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT id, state, extract(epoch FROM first_sent_at - available_at) "
                "FROM outbox.operations WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        )
        return {
            op_id: (str(state), None if waited is None else float(waited))
            for op_id, state, waited in rows
        }


@pytest.mark.parametrize("broker", ["rabbitmq", "database"], indirect=True)
def test_a_worker_taking_only_messages_is_not_made_to_wait_beside_a_busy_taker(
    engine: Engine,
    broker: str | None,
    stack_env: dict[str, str],
    services: Services,
    service: DeployService,
) -> None:
    """The taker busy, the relay standing by for it: the message-only worker sends the
    rest, each once, long before the standby hold-back; SIGKILLed, it counts no more."""
    armed = {**stack_env, "OUTBOX_FAULTS": "after_lock=hang@1"}
    taker = services.start(
        "worker-taking", "worker", "-c", "1", "-P", "threads", "-n", "taking@%h", env=armed
    )
    wait_until(
        lambda: "taking due operations directly" in taker.output() or _takers(engine).waiting,
        timeout=120.0,  # the worker's start-up included
        interval=0.1,
        what="the worker taking due operations directly",
    )
    messages_only = services.start(
        "worker-messages",
        "worker",
        "-c",
        "2",
        "-P",
        "threads",
        "-n",
        "messages@%h",
        env={**stack_env, "OUTBOX_BROKER_DIRECT_TAKE": "false"},
    )
    wait_until(
        lambda: _takers(engine).consumers,
        timeout=120.0,
        interval=0.1,
        what="the message-only worker's row",
    )
    [hung] = _enqueue(engine, 1)
    wait_until(
        lambda: "fault point after_lock: hanging" in taker.output(),
        timeout=30.0,
        interval=0.1,
        what="the taker's one thread stopped right after the operation's lock",
    )
    relay = services.start("relay", "relay")
    wait_until(
        lambda: "relay sees a worker that takes only messages" in relay.output(),
        timeout=60.0,
        interval=0.1,
        what="the relay to see the message-only worker",
    )
    rest = _enqueue(engine, 5)
    wait_until(
        lambda: {state for state, _ in _waits(engine, rest).values()} == {"confirmed"},
        timeout=60.0,
        interval=0.2,
        what="the rest confirmed by the message-only worker",
    )
    waited = {op_id: w for op_id, (_, w) in _waits(engine, rest).items()}
    assert all(w is not None and w < STANDBY_HOLD_BACK_S for w in waited.values()), waited
    effects = service.effects_by_key()
    assert {op_id: effects.get(str(op_id)) for op_id in rest} == dict.fromkeys(rest, 1)
    assert str(hung) not in effects
    if broker is not None:  # on RabbitMQ the busy taker's flag is down: the relay stood by
        assert "relay standing by" in relay.output()

    messages_only.kill()
    wait_until(
        lambda: not _takers(engine).consumers,
        timeout=10.0,  # its heartbeat stays fresh for 30 s: its closed session says it
        interval=0.1,
        what="the killed worker's row no longer counted",
    )
