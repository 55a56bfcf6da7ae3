"""The database enforces what the code promises (migration 0010): an operation's identity never
changes, its events go only with it, and only a finished operation can be deleted."""

from __future__ import annotations

import importlib
from typing import Any

import psycopg
import pytest
from alembic import command
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from outbox import api, migrate
from outbox.canonical import intent_hash
from outbox.db import create_engine
from outbox.states import LIVE_STATES, TERMINAL_STATES, State
from tests.conftest import Databases
from tests.factories import events_of, make_operation, reload

#: The immutable columns as the latest revision touching them (0026) left them.
IDENTITY = importlib.import_module("outbox.migrations.versions.0026_trace_context")

#: A different value for each immutable column.
NEW_VALUES = {
    "id": "gen_random_uuid()",
    "intent_key": "'another-key'",
    "tool": "'deploy.delete_release'",
    "target": "'project-z'",
    "payload": """'{"n": "changed"}'""",
    "payload_hash": "repeat('f', 64)",
    "intent_hash": "repeat('e', 64)",
    "requested_by": "'mallory'",
    "metadata": """'{"who": "mallory"}'""",
    "agent": "'mallory'",
    "traceparent": "'00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01'",
    "tracestate": "'vendor=x'",
}


def _error(caught: pytest.ExceptionInfo[DBAPIError]) -> psycopg.Error:
    error = caught.value.orig
    assert isinstance(error, psycopg.Error)
    return error


def test_every_immutable_column_has_a_changed_value_here() -> None:
    """The test below covers exactly the migration's immutable columns."""
    assert set(NEW_VALUES) == set(IDENTITY.IMMUTABLE_COLUMNS)


@pytest.mark.parametrize("column", sorted(NEW_VALUES))
@pytest.mark.parametrize("state", [State.PLANNED, State.CONFIRMED])
def test_an_update_of_an_immutable_column_is_refused_naming_it(
    engine: Engine, column: str, state: State
) -> None:
    """An UPDATE changing any identity column is refused with SQLSTATE 23000 naming the column,
    and the row stays as it was."""
    op = make_operation(engine, state)
    with pytest.raises(DBAPIError) as caught, engine.begin() as conn:
        conn.execute(
            text(f"UPDATE outbox.operations SET {column} = {NEW_VALUES[column]} WHERE id = :id"),
            {"id": op.id},
        )
    error = _error(caught)
    if column == "id":
        # The events' foreign key (its AFTER trigger fires first: every operation has its
        # `enqueued` event) refuses a new id before the immutability trigger does.
        assert error.sqlstate == "23503"  # foreign_key_violation
        assert error.diag.constraint_name == "fk_events_operation_id_operations"
    else:
        assert error.sqlstate == "23000"  # integrity_constraint_violation
        assert error.diag.column_name == column
        assert (error.diag.schema_name, error.diag.table_name) == ("outbox", "operations")
        assert f"outbox.operations.{column} is immutable" in str(error)
    assert reload(engine, op.id) == op


def test_the_payload_is_compared_exactly(engine: Engine) -> None:
    """A payload equal as jsonb but written differently (1 into 1.0) is refused too."""
    op = make_operation(engine, payload={"amount": 1})
    with pytest.raises(DBAPIError) as caught, engine.begin() as conn:
        conn.execute(
            text("""UPDATE outbox.operations SET payload = '{"amount": 1.0}' WHERE id = :id"""),
            {"id": op.id},
        )
    assert _error(caught).diag.column_name == "payload"


def test_setting_an_identity_column_to_its_own_value_is_allowed(engine: Engine) -> None:
    """A statement that names the columns but changes nothing (an ORM writing whole rows)."""
    op = make_operation(engine)
    assignments = ", ".join(f"{column} = {column}" for column in IDENTITY.IMMUTABLE_COLUMNS)
    with engine.begin() as conn:
        conn.execute(
            text(f"UPDATE outbox.operations SET {assignments} WHERE id = :id"), {"id": op.id}
        )
    assert reload(engine, op.id) == op


@pytest.mark.parametrize("state", sorted(LIVE_STATES | TERMINAL_STATES))
def test_events_of_an_existing_operation_cannot_be_deleted(engine: Engine, state: State) -> None:
    """A DELETE of an event whose operation still exists is refused: the trail stays whole."""
    op = make_operation(engine, state)
    before = events_of(engine, op.id)
    with pytest.raises(DBAPIError) as caught, engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox.events WHERE operation_id = :id"), {"id": op.id})
    error = _error(caught)
    assert error.sqlstate == "23000"
    assert "outbox.events is append-only" in str(error)
    assert events_of(engine, op.id) == before


@pytest.mark.parametrize("state", sorted(LIVE_STATES))
def test_a_live_operation_cannot_be_deleted(engine: Engine, state: State) -> None:
    """Deleting an operation that is not finished is refused, so its events stay too."""
    op = make_operation(engine, state)
    with pytest.raises(DBAPIError) as caught, engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox.operations WHERE id = :id"), {"id": op.id})
    error = _error(caught)
    assert error.sqlstate == "23000"
    assert f"is {state.value}; only a finished" in str(error)
    assert reload(engine, op.id) == op


def test_a_finished_operation_is_deleted_with_its_events(engine: Engine) -> None:
    """The one way events go: with their finished operation, through the cascade."""
    op = make_operation(engine, State.CONFIRMED)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM outbox.operations WHERE id = :id"), {"id": op.id})
    with engine.connect() as conn:
        assert api.get(conn, op.id) is None
    assert events_of(engine, op.id) == []


def test_enqueue_writes_the_intent_hash_the_sql_function_computes(engine: Engine) -> None:
    """Python's intent_hash and outbox.intent_hash agree, non-ASCII text included."""
    with Session(engine) as session, session.begin():
        op = api.enqueue(session, tool="t.x", target="prôjet-ü/ß", payload={"k": "é"})
    assert op.intent_hash == intent_hash(op.tool, op.target, op.payload_hash)
    with engine.connect() as conn:
        computed = conn.execute(
            text("SELECT outbox.intent_hash(tool, target, payload_hash) FROM outbox.operations")
        ).scalar_one()
    assert computed == op.intent_hash == reload(engine, op.id).intent_hash


def test_the_upgrade_fills_the_intent_hash_of_existing_rows(databases: Databases) -> None:
    """Rows made before 0010 get the intent hash that enqueue would have written; 0010 goes down."""
    engine = create_engine(databases.create())
    try:
        migrate.upgrade(engine, "0009")
        with engine.begin() as conn:
            row: Any = conn.execute(
                text(
                    "INSERT INTO outbox.operations (intent_key, tool, target, payload,"
                    " payload_hash) VALUES ('k', 't.x', 'ünïcode', '{}', repeat('a', 64))"
                    " RETURNING id"
                )
            ).one()
        migrate.upgrade(engine)
        stored = reload(engine, row.id)
        assert stored.intent_hash == intent_hash("t.x", "ünïcode", "a" * 64)
        config = migrate.alembic_config()
        with engine.connect() as conn:
            config.attributes["connection"] = conn
            command.downgrade(config, "0009")
        assert migrate.current(engine) == "0009"
    finally:
        engine.dispose()
