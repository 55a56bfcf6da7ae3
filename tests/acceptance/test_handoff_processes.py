"""A real worker attempts with the lock its take took, when its tasks run in its own process.

On either broker a worker with the threads (or solo) pool claims a due operation, takes its
lock and reads it in one statement, and its task adopts that connection
(``outbox.workers.handoff``; on RabbitMQ the take runs on Celery's event loop while a thread
is free, ``outbox.workers.listening``); a prefork worker's child cannot, and takes the lock
itself.
Seen from outside: the worker stops right after the lock (``OUTBOX_FAULTS=after_lock=hang``),
and PostgreSQL says which statement the lock holder's session ran last. Then the worker is
SIGKILLed there, and a fresh stack confirms the operation once. A take that handed its lock
also moved the row to ``sent`` (change 46): the killed worker leaves a ``sent`` row, which
the sweep hands to the reconciler (a lookup finds nothing, the in-flight horizon passes, it
is sent again); a prefork child's own lock step was the move, so the same holds there.
"""

from __future__ import annotations

from pathlib import Path
from uuid import UUID

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api, sql
from outbox.dev.service import DeployService
from outbox.dev.tool_config import http_tool_toml
from outbox.locks import operation_lock_key
from tests.processes import Services, wait_until
from tests.tool_configs import TOOL

pytestmark = pytest.mark.slow

#: How the take's statement begins (PostgreSQL shows a statement's first kilobyte only).
TAKE_STATEMENT = "WITH cfg AS MATERIALIZED ("


def _enqueue(engine: Engine) -> UUID:
    with Session(engine) as session, session.begin():
        return api.enqueue(
            session, tool=TOOL, target="project-1", payload={"version": "1.0.0"}, intent_key="h"
        ).id


def _holder_query(engine: Engine, op_id: UUID) -> str | None:
    """The last statement of the session holding ``op_id``'s lock (None: nobody holds it)."""
    with engine.connect() as conn:
        pid = sql.locks.lock_holder_pid(conn, operation_lock_key(op_id))
        if pid is None:
            return None
        query = conn.execute(
            text("SELECT query FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
        ).scalar_one_or_none()
        return None if query is None else str(query)


def _idle_takers(engine: Engine) -> int:
    """Workers taking directly whose idle flag is up (enqueue rings them)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM outbox.relays WHERE idle"
                    " AND (name LIKE 'taker:%' OR name LIKE 'listening-taker:%')"
                )
            ).scalar_one()
        )


def _state(engine: Engine, op_id: UUID) -> str:
    with engine.connect() as conn:
        return str(
            conn.execute(
                text("SELECT state FROM outbox.operations WHERE id = :id"), {"id": op_id}
            ).scalar_one()
        )


@pytest.mark.parametrize("broker", ["database", "rabbitmq"], indirect=True)
@pytest.mark.parametrize(
    ("pool", "handed"), [("threads", True), ("solo", True), ("prefork", False)]
)
def test_the_attempt_holds_the_lock_its_take_took_unless_its_task_runs_elsewhere(
    engine: Engine,
    broker: str | None,
    stack_env: dict[str, str],
    services: Services,
    service: DeployService,
    pool: str,
    handed: bool,
    tmp_path: Path,
) -> None:
    armed = {**stack_env, "OUTBOX_FAULTS": "after_lock=hang@1"}
    worker = services.start("worker-armed", "worker", "-c", "1", "-P", pool, env=armed)
    # A starting worker takes with its flag down (busy until a look finds nothing): the
    # operation comes once it waits for work, as at a steady rate.
    wait_until(
        lambda: _idle_takers(engine) == 1,
        timeout=120.0,  # the worker's start-up included
        interval=0.1,
        what="the worker waiting for work, its idle flag up",
    )
    op_id = _enqueue(engine)
    wait_until(
        lambda: "fault point after_lock: hanging" in worker.output(),
        timeout=30.0,
        interval=0.1,
        what="the worker stopped right after the operation's lock",
    )
    query = _holder_query(engine, op_id)
    assert query is not None
    # The child's own lock-and-read (then, on a test database that does not flush by
    # default, its `SET synchronous_commit`) was the prefork worker's last statement.
    assert " ".join(query.split()).startswith(TAKE_STATEMENT) is handed, query[:200]
    worker.kill()
    # Killed after the `sent` commit and before the call: a `sent` row with no dispatcher.
    assert _state(engine, op_id) == "sent"
    # The sweep finds its lock free (OUTBOX_SENT_TIMEOUT), the reconciler looks it up (not
    # there) and, once the in-flight horizon passed (the attempt's send deadline and
    # timeout, 7 s, and the margin), replays it: one effect.
    recovering = {
        **stack_env,
        "OUTBOX_CONFIG": _short_horizon_config(tmp_path, service.url),
        "OUTBOX_SENT_TIMEOUT": "6",  # above the tool's 5 s timeout, as required
        "OUTBOX_SWEEP_INTERVAL": "1",
    }
    services.start("worker", "worker", "-c", "1", "-P", pool, env=recovering)
    services.start("beat", "beat", env=recovering)
    wait_until(
        lambda: _state(engine, op_id) == "confirmed",
        timeout=120.0,
        interval=0.2,
        what="the operation confirmed by a fresh worker",
    )
    assert service.effects_by_key() == {str(op_id): 1}


def _short_horizon_config(tmp_path: Path, service_url: str) -> str:
    """The stack's tool with the shortest in-flight horizon its contract allows (send
    deadline 2 s + timeout 5 s + 5 s margin), so the reconciler decides in seconds."""
    path = tmp_path / "recovering.toml"
    path.write_text(
        http_tool_toml(service_url, timeout_s=5.0, send_deadline_s=2.0, inflight_horizon_s=12),
        encoding="utf-8",
    )
    return str(path)
