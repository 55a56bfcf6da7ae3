"""The guard rails survive a PostgreSQL crash (on a cluster of the test's own).

Their state is in ordinary tables, written by committed transactions: an immediate stop (no
checkpoint, every backend killed) and crash recovery from the WAL must give back an open
breaker, a spent rate bucket and a budget's use, exactly as they were.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from outbox import api, migrate
from outbox.budgets import Budget, publish_budgets_committed
from outbox.contracts import ContractTable
from outbox.db import create_engine
from outbox.dev.clusters import LocalCluster
from outbox.errors import BudgetExceeded
from outbox.guards import Breaker, Concurrency, Rate
from outbox.states import State
from outbox.tools import Applied, NotDelivered, ToolCall, ToolRegistry, tool
from outbox.workers.dispatch import Outcome, dispatch
from tests.factories import make_operation, reload

pytestmark = pytest.mark.slow

FLAKY = "deploy.create_release"
SLOW = "mail.send"
CHARGE = "billing.charge"
CAPPED = "ticket.open"


@pytest.fixture
def engine_on_own_cluster(tmp_path: Path) -> Iterator[tuple[LocalCluster, Engine]]:
    """A migrated database on a PostgreSQL cluster this test may crash."""
    cluster = LocalCluster(tmp_path / "postgres")
    cluster.start()
    engine = create_engine(cluster.create_database("outbox"))
    try:
        migrate.upgrade(engine)
        yield cluster, engine
    finally:
        engine.dispose()
        cluster.stop()


def _registry() -> ToolRegistry:
    registry = ToolRegistry(ContractTable())

    def refused(call: ToolCall) -> NotDelivered:
        return NotDelivered("connection refused")

    def applied(call: ToolCall) -> Applied:
        return Applied(f"ref-{call.operation_id}")

    tool(FLAKY, breaker=Breaker(failures=2, open_s=3600), timeout=2, registry=registry)(refused)
    tool(SLOW, rate=Rate(per_second=0.001, burst=1), timeout=2, registry=registry)(applied)
    return registry


def _charge(engine: Engine, n: int) -> None:
    with Session(engine) as session, session.begin():
        api.enqueue(session, tool=CHARGE, target="acct", payload={"n": n}, requested_by="agent")


def test_an_open_breaker_a_spent_bucket_and_a_budgets_use_survive_a_crash(
    engine_on_own_cluster: tuple[LocalCluster, Engine],
) -> None:
    """After an immediate stop and crash recovery the breaker is still open, the bucket still
    spent and the budget still used up: nothing is sent or enqueued that they hold back."""
    cluster, engine = engine_on_own_cluster
    registry = _registry()
    for _ in range(2):
        failing = make_operation(engine, tool=FLAKY)
        assert dispatch(failing.id, engine=engine, registry=registry).outcome is not Outcome.HELD
    first = make_operation(engine, tool=SLOW)
    assert dispatch(first.id, engine=engine, registry=registry).outcome is Outcome.CONFIRMED
    publish_budgets_committed(
        engine, [Budget(name="spend", tools=(CHARGE,), window_s=3600.0, max_operations=1)]
    )
    _charge(engine, 0)

    cluster.crash()
    engine.dispose()
    cluster.start()

    held = make_operation(engine, tool=FLAKY)
    assert dispatch(held.id, engine=engine, registry=registry).outcome is Outcome.HELD
    second = make_operation(engine, tool=SLOW)
    assert dispatch(second.id, engine=engine, registry=registry).outcome is Outcome.HELD
    with pytest.raises(BudgetExceeded):
        _charge(engine, 1)


def test_a_sent_move_admitted_under_a_cap_is_on_disk_before_the_call(
    engine_on_own_cluster: tuple[LocalCluster, Engine],
) -> None:
    """Under a cap the `sent` move (its admission in the same statement) is on disk before
    the call: PostgreSQL crashed during the call gives the row back in `sent`, even with the
    WAL writer's own flush 10 s away."""
    cluster, engine = engine_on_own_cluster
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ALTER SYSTEM SET wal_writer_delay = '10s'"))
        conn.execute(text("SELECT pg_reload_conf()"))
    registry = ToolRegistry(ContractTable())
    calls: list[str] = []

    def crash_during_the_call(call: ToolCall) -> Applied:
        calls.append(call.operation_id)
        cluster.crash()
        return Applied(f"ref-{call.operation_id}")

    tool(CAPPED, concurrency=Concurrency(max_in_flight=2), timeout=2, registry=registry)(
        crash_during_the_call
    )
    op = make_operation(engine, tool=CAPPED)
    with pytest.raises(DBAPIError):
        dispatch(op.id, engine=engine, registry=registry)
    engine.dispose()
    cluster.start()

    row = reload(engine, op.id)
    assert (calls, row.state, row.attempts) == ([str(op.id)], State.SENT, 1)
