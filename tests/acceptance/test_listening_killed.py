"""A RabbitMQ worker killed while it waits for work, or while it carries a backlog, is not
waited for.

A worker taking due operations directly on RabbitMQ (``outbox.workers.listening``) keeps a
flag up while a thread is free, and a relay leaves fresh rows to it for 0.2 s; with the flag
down (every slot busy, a backlog) it takes as its slots free and a relay stands by, claiming
only rows left 10 s. SIGKILLed, the worker leaves its flag with a fresh heartbeat (30 s before
it ages out); the database session that wrote it ends with the process's socket, and the
relay counts the flag no more at once (migration 0028).
"""

from __future__ import annotations

from uuid import UUID

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api, sql
from outbox.dev.service import DeployService
from tests.processes import Services, wait_until
from tests.tool_configs import TOOL

pytestmark = pytest.mark.slow


def _carrying(engine: Engine) -> bool:
    """Whether a relay sees a worker it stands by for (a heartbeat within 30 s)."""
    with engine.connect() as conn:
        return sql.relay.takers(conn, heartbeat_within_s=30.0).live


def _states(engine: Engine, ids: list[UUID]) -> dict[UUID, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, state FROM outbox.operations WHERE id = ANY(:ids)"), {"ids": ids}
        )
        return {op_id: str(state) for op_id, state in rows}


def _enqueue(engine: Engine, count: int) -> list[UUID]:
    with Session(engine) as session, session.begin():
        return [
            api.enqueue(session, tool=TOOL, target="project-1", payload={"v": i}).id
            for i in range(count)
        ]


def _waiting(engine: Engine) -> bool:
    """Whether a relay sees a worker waiting for work (a heartbeat within 30 s, as a relay
    with the default heartbeat asks)."""
    with engine.connect() as conn:
        return sql.relay.takers(conn, heartbeat_within_s=30.0).waiting


def _wait_for_waiting_worker(engine: Engine) -> None:
    """Until a starting worker waits for work, its flag up."""
    wait_until(
        lambda: _waiting(engine),
        timeout=120.0,  # the worker's start-up included
        interval=0.1,
        what="the worker waiting for work, its flag up",
    )


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_a_worker_killed_while_it_waits_for_work_is_not_waited_for(
    engine: Engine, broker: str | None, stack_env: dict[str, str], services: Services
) -> None:
    worker = services.start("worker", "worker", "-c", "1", "-P", "threads", env=stack_env)
    _wait_for_waiting_worker(engine)
    worker.kill()
    wait_until(
        lambda: not _waiting(engine),
        timeout=10.0,  # its heartbeat stays fresh for 30 s
        interval=0.1,
        what="the killed worker's flag no longer counted",
    )
    with Session(engine) as session, session.begin():
        op_id: UUID = api.enqueue(session, tool=TOOL, target="project-1", payload={"v": 1}).id
    # A relay's claim leaving fresh rows to waiting workers for 30 s claims it at once.
    with engine.begin() as conn:
        claimed = sql.relay.claim_and_mark_due(
            conn,
            limit=10,
            republish_after_s=30.0,
            defer_to_takers_s=30.0,
            takers_heartbeat_within_s=30.0,
        )
    assert [c.id for c in claimed] == [op_id]


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_a_worker_killed_while_it_carries_a_backlog_is_not_stood_by_for(
    engine: Engine,
    broker: str | None,
    stack_env: dict[str, str],
    services: Services,
    service: DeployService,
) -> None:
    """Its one thread busy (hung right after an operation's lock), the worker's flag goes
    down as more comes and a relay would stand by for it. SIGKILLed, it counts no more: a
    relay started then claims the rest at once, and a worker that takes nothing directly
    sends each once."""
    armed = {**stack_env, "OUTBOX_FAULTS": "after_lock=hang@1"}
    worker = services.start("worker-armed", "worker", "-c", "1", "-P", "threads", env=armed)
    _wait_for_waiting_worker(engine)
    [hung] = _enqueue(engine, 1)
    wait_until(
        lambda: "fault point after_lock: hanging" in worker.output(),
        timeout=30.0,
        interval=0.1,
        what="the worker's one thread stopped right after the operation's lock",
    )
    rest = _enqueue(engine, 5)
    wait_until(
        lambda: _carrying(engine),
        timeout=10.0,
        interval=0.1,
        what="the busy worker's flag down, a relay standing by for it",
    )
    assert set(_states(engine, rest).values()) == {"planned"}
    worker.kill()
    wait_until(
        lambda: not _carrying(engine),
        timeout=10.0,  # its heartbeat stays fresh for 30 s
        interval=0.1,
        what="the killed worker no longer stood by for",
    )
    services.start("relay", "relay")
    services.start(
        "worker",
        "worker",
        "-c",
        "2",
        "-P",
        "threads",
        env={**stack_env, "OUTBOX_BROKER_DIRECT_TAKE": "false"},
    )
    wait_until(
        lambda: set(_states(engine, rest).values()) == {"confirmed"},
        timeout=60.0,
        interval=0.2,
        what="the rest confirmed through the relay and the broker",
    )
    effects = service.effects_by_key()
    assert {op_id: effects.get(str(op_id)) for op_id in rest} == dict.fromkeys(rest, 1)
    assert str(hung) not in effects
