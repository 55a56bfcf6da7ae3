"""The plans of the workers' moves: by primary key, whatever PostgreSQL knows of the table.

A move is a compare-and-set on one row by id (``outbox.sql.moves``). On a table never
analysed (a new deployment, a benchmark's new database) and planned with its values (a
prepared statement's first runs), PostgreSQL took the partial index of the move's from-state
instead (``ix_operations_sent_since`` for an outcome, ``ix_operations_planned_due`` for the
`sent` move) and read every entry that index ever held (change 44).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text

from outbox import migrate
from outbox.driver import DriverStatement
from outbox.sql.guards import _HOLD
from outbox.sql.moves import MoveShape, _move_statement, move
from outbox.sql.reconcile import _SCHEDULE_CHECK_AT_HORIZON, _SCHEDULE_CHECK_IN
from outbox.states import Actor, State
from tests.conftest import Databases
from tests.factories import make_operation
from tests.plans import operations_scans, prepared_plan

#: The moves a dispatch worker makes, and the reconciler's from `unknown`.
SHAPES = {
    "sent": MoveShape(State.PLANNED, State.SENT, Actor.DISPATCHER, fenced=True),
    "confirmed": MoveShape(
        State.SENT, State.CONFIRMED, Actor.DISPATCHER, fenced=True, remote_ref=True, result=True
    ),
    "failed": MoveShape(
        State.SENT,
        State.FAILED,
        Actor.DISPATCHER,
        fenced=True,
        last_error=True,
        result=True,
        not_applied=True,
    ),
    "unknown": MoveShape(State.SENT, State.UNKNOWN, Actor.DISPATCHER, fenced=True, last_error=True),
    "not sent": MoveShape(
        State.SENT, State.PLANNED, Actor.DISPATCHER, fenced=True, last_error=True, not_applied=True
    ),
    "looked up": MoveShape(
        State.UNKNOWN, State.CONFIRMED, Actor.RECONCILER, fenced=True, remote_ref=True
    ),
    # The lock step's own `sent` move (change 45): the row's checks in its conditions.
    "sent at the lock": MoveShape(
        State.PLANNED, State.SENT, Actor.DISPATCHER, fenced=False, at_lock=True
    ),
}

#: The other statements that change one row by key, on the state it must be in.
BY_KEY = {
    "hold": DriverStatement.of(_HOLD, ["available_at"]),
    "check in": DriverStatement.of(_SCHEDULE_CHECK_IN, []),
    "check at horizon": DriverStatement.of(_SCHEDULE_CHECK_AT_HORIZON, []),
}

#: Values for the moves' parameters, by name (SQL literals; the statement casts them).
_VALUES = {
    "operation_id": "'01a2473b-d096-718b-ae72-9d505b3f3bbc'",
    "attempt": "1",
    "reason": "'a reason'",
    "remote_ref": "'ref-1'",
    "result": "'{}'",
    "last_error": "'an error'",
    "detail": "'{}'",
    "available_in": "'1 second'",
    "check_in": "'1 second'",
    "id": "'01a2473b-d096-718b-ae72-9d505b3f3bbc'",
    "delay_s": "1",
    "delay": "1",
    "horizon": "60",
    "add": "1",
    "error": "NULL",
    "key": "1",
    "unlock_first": "false",
    "send_tools": "'{deploy.create_release}'",
    "send_max_attempts": "'{3}'",
    "send_approval": "'{f}'",
}


def _plan(engine: Engine, statement: DriverStatement, mode: str) -> dict[str, Any]:
    values = {**{k: f"'{v}'" for k, v in statement.defaults.items()}, **_VALUES}
    return prepared_plan(engine, statement.sql, values, mode)


@pytest.fixture(scope="module")
def new_table(databases: Databases) -> Iterator[Engine]:
    """An engine on a new migrated database whose operations table was never analysed."""
    engine = create_engine(databases.create())
    try:
        migrate.upgrade(engine)
        with engine.connect() as conn:
            never_analysed = conn.execute(
                text(
                    "SELECT reltuples = -1 FROM pg_class WHERE oid = 'outbox.operations'::regclass"
                )
            ).scalar_one()
        assert never_analysed
        yield engine
    finally:
        engine.dispose()


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_move_reads_its_row_by_primary_key_on_a_new_table(
    new_table: Engine, name: str, mode: str
) -> None:
    scans = operations_scans(_plan(new_table, _move_statement(SHAPES[name]), mode))
    assert scans, "the plan reads no operations row"
    assert set(scans) == {("Index Scan", "pk_operations")}, scans


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize("name", sorted(BY_KEY))
def test_the_other_updates_by_key_read_by_primary_key_on_a_new_table(
    new_table: Engine, name: str, mode: str
) -> None:
    scans = operations_scans(_plan(new_table, BY_KEY[name], mode))
    assert scans, "the plan reads no operations row"
    assert set(scans) == {("Index Scan", "pk_operations")}, scans


def test_the_move_still_compares_the_state_exactly(engine: Engine) -> None:
    """COLLATE "C" changes no answer: a move from the wrong state misses, from the right
    one moves (the state's text compared byte for byte either way)."""
    op = make_operation(engine)
    params = {"operation_id": op.id, "attempt": 0, "reason": "test"}
    with engine.begin() as conn:
        wrong = MoveShape(State.SENT, State.UNKNOWN, Actor.DISPATCHER, fenced=True)
        assert move(conn, wrong, {**params, "check_in": timedelta(0)}) is None
        moved = move(conn, SHAPES["sent"], params)
    assert moved is not None
    assert moved.id == op.id
    assert moved.state is State.SENT
