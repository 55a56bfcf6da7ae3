"""A RabbitMQ worker killed while it waits for work is not waited for.

A worker taking due operations directly on RabbitMQ (``outbox.workers.listening``) keeps a
flag up while a thread is free, and a relay leaves fresh rows to it for 0.2 s. SIGKILLed
there, the worker leaves the flag up with a fresh heartbeat (30 s before it ages out); the
database session that wrote it ends with the process's socket, and the relay counts the
flag no more at once (migration 0028).
"""

from __future__ import annotations

from uuid import UUID

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import api, sql
from tests.processes import Services, wait_until
from tests.tool_configs import TOOL

pytestmark = pytest.mark.slow


def _waiting(engine: Engine) -> bool:
    """Whether a relay sees a worker waiting for work (a heartbeat within 30 s, as a relay
    with the default heartbeat asks)."""
    with engine.connect() as conn:
        return sql.relay.takers(conn, heartbeat_within_s=30.0).waiting


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_a_worker_killed_while_it_waits_for_work_is_not_waited_for(
    engine: Engine, broker: str | None, stack_env: dict[str, str], services: Services
) -> None:
    worker = services.start("worker", "worker", "-c", "1", "-P", "threads", env=stack_env)
    wait_until(
        lambda: _waiting(engine),
        timeout=120.0,  # the worker's start-up included
        interval=0.1,
        what="the worker waiting for work, its flag up",
    )
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
