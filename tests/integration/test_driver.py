"""Hot statements on psycopg directly: in the caller's transaction, with SQLAlchemy's errors."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import Engine, event, text
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from outbox import api
from outbox.db import create_async_engine
from outbox.driver import DriverStatement, ListenerContext
from tests.factories import operation_count

_DIVIDE = DriverStatement.of(text("SELECT 1 / :divisor AS quotient"), ["quotient"])
_INSERT_EVENT = DriverStatement.of(
    text(
        "INSERT INTO outbox.events (operation_id, from_state, to_state, attempt, actor, reason) "
        "VALUES (:operation_id, NULL, 'planned', 0, 'agent', 'test') RETURNING id"
    ),
    ["id"],
)
_CURRENT_QUERY = DriverStatement.of(text("SELECT current_query() AS query"), ["query"])
_ECHO_JSON = DriverStatement.of(
    sa.select(sa.bindparam("doc", type_=sa.dialects.postgresql.JSONB).label("doc")), ["doc"]
)


def _enqueue(executor: Session | sa.Connection, key: str) -> None:
    api.enqueue(executor, tool="t.one", target="web", payload={"k": key}, intent_key=key)


def test_a_statement_begins_the_connections_transaction_as_execute_would(engine: Engine) -> None:
    """On a Connection with no transaction yet, the statement begins one, kept by commit()."""
    with engine.connect() as conn:
        _enqueue(conn, "kept")
        assert conn.in_transaction()
        conn.commit()
    assert operation_count(engine) == 1


def test_a_statement_rolls_back_with_the_callers_transaction(engine: Engine) -> None:
    """What a driver statement wrote goes with the caller's rollback, on a Session or not."""
    with Session(engine) as session, session.begin():
        _enqueue(session, "session")
        session.rollback()
    with engine.connect() as conn, conn.begin() as txn:
        _enqueue(conn, "connection")
        txn.rollback()
    assert operation_count(engine) == 0


def test_the_row_comes_back_by_column_name_with_json_parameters(engine: Engine) -> None:
    """Columns are named as declared; a JSON parameter reaches psycopg as JSON."""
    with engine.connect() as conn:
        assert _DIVIDE.fetch_one(conn, {"divisor": 1}) == {"quotient": 1}
        assert _ECHO_JSON.fetch_one(conn, {"doc": {"a": [1, "b"]}}) == {"doc": {"a": [1, "b"]}}


def test_cursor_execute_listeners_see_the_statement(engine: Engine) -> None:
    """An engine's before/after_cursor_execute listeners see a driver statement and its values,
    and what a listener sets on the execution context (a tracer's span) reaches the after one."""
    seen: list[tuple[str, object, object]] = []

    def before(
        _conn: object, _cursor: object, sql: str, params: object, context: Any, *_: object
    ) -> None:
        context.span = "span-1"
        seen.append(("before", sql, params))

    def after(
        _conn: object, _cursor: object, sql: str, params: object, context: Any, *_: object
    ) -> None:
        seen.append(("after", sql, getattr(context, "span", None)))

    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "after_cursor_execute", after)
    try:
        with engine.connect() as conn:
            _DIVIDE.fetch_one(conn, {"divisor": 3})
    finally:
        event.remove(engine, "before_cursor_execute", before)
        event.remove(engine, "after_cursor_execute", after)
    driver = [(when, value) for when, sql, value in seen if sql == _DIVIDE.sql]
    assert driver == [("before", {"divisor": 3}), ("after", "span-1")]


def test_a_listener_may_change_the_statement_as_sqlalchemy_allows(engine: Engine) -> None:
    """A retval=True before_cursor_execute listener (a tracer adding a comment) changes what
    is sent, as it would through SQLAlchemy."""

    def comment(
        _conn: object, _cursor: object, sql: str, params: Any, *_: object
    ) -> tuple[str, Any]:
        return sql + " /* traced */", params

    event.listen(engine, "before_cursor_execute", comment, retval=True)
    try:
        with engine.connect() as conn:
            row = _CURRENT_QUERY.fetch_one(conn, {})
    finally:
        event.remove(engine, "before_cursor_execute", comment)
    assert row is not None
    sent = row["query"]
    assert sent.endswith("/* traced */")


def test_a_driver_error_comes_out_as_sqlalchemys_error(engine: Engine) -> None:
    """A failing statement raises the DBAPIError subclass SQLAlchemy itself would raise."""
    with engine.connect() as conn:
        with pytest.raises(DataError, match="division by zero"):
            _DIVIDE.fetch_one(conn, {"divisor": 0})
        conn.rollback()
        with pytest.raises(IntegrityError, match="operation_id"):
            _INSERT_EVENT.fetch_one(conn, {"operation_id": "00000000-0000-0000-0000-000000000000"})
        assert not conn.invalidated


def test_a_lost_connection_is_invalidated(engine: Engine) -> None:
    """A statement on a connection the server dropped raises with connection_invalidated set,
    and SQLAlchemy knows the connection is gone (the pool will not hand it out again)."""
    with engine.connect() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        conn.commit()
        with engine.connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(DBAPIError) as raised:
            _DIVIDE.fetch_one(conn, {"divisor": 1})
        assert raised.value.connection_invalidated
        assert conn.invalidated


def test_an_engine_on_another_driver_runs_the_statement_through_sqlalchemy(
    engine: Engine,
) -> None:
    """An agent's own psycopg2 engine enqueues as well (SQLAlchemy runs the statement)."""
    pytest.importorskip("psycopg2", reason="psycopg2 is in the dev extras")
    other = sa.create_engine(engine.url.set(drivername="postgresql+psycopg2"))
    try:
        with Session(other) as session, session.begin():
            _enqueue(session, "psycopg2")
        with other.connect() as conn:
            assert _DIVIDE.fetch_one(conn, {"divisor": 2}) == {"quotient": 0}
            with pytest.raises(DataError):
                _DIVIDE.fetch_one(conn, {"divisor": 0})
    finally:
        other.dispose()
    assert operation_count(engine) == 1


_SECRET = "sk-live-4f1c9e0d7a"  # noqa: S105 -- a fake secret the errors must not show
_INSERT_SECRET_EVENT = DriverStatement.of(
    text(
        "INSERT INTO outbox.events (operation_id, from_state, to_state, attempt, actor, reason) "
        "VALUES (:operation_id, NULL, 'planned', 0, 'agent', :reason) RETURNING id"
    ),
    ["id"],
)


def test_a_logged_database_error_shows_no_bound_values(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A DBAPIError from our engines, through the driver or SQLAlchemy, carries and logs the
    statement but none of its bound values (payloads, keys, secrets)."""
    values = {"operation_id": "00000000-0000-0000-0000-000000000000", "reason": _SECRET}
    log = logging.getLogger("tests.hidden")
    with engine.connect() as conn:
        for run in (
            lambda: _INSERT_SECRET_EVENT.fetch_one(conn, values),
            lambda: conn.execute(_INSERT_SECRET_EVENT.clause, values),
        ):
            with pytest.raises(IntegrityError) as raised:
                run()
            conn.rollback()
            log.error("task failed", exc_info=raised.value)
            assert "outbox.events" in str(raised.value)
            assert _SECRET not in str(raised.value)
            assert _SECRET not in repr(raised.value)
    assert "INSERT INTO outbox.events" in caplog.text
    assert _SECRET not in caplog.text


def test_an_async_engine_runs_the_statement_on_psycopgs_async_connection(
    database_url: str, engine: Engine
) -> None:
    """Under an async engine (outbox.aio, in run_sync's greenlet) the statement runs on
    psycopg's AsyncConnection directly: listeners see it with the driver's context, its row
    comes back by name, and a failure raises SQLAlchemy's error."""
    contexts: list[object] = []

    def before(
        _conn: object, _cursor: object, sql: str, _p: object, context: Any, *_: object
    ) -> None:
        if sql == _DIVIDE.sql:
            contexts.append(context)

    async def body() -> None:
        async_engine = create_async_engine(database_url)
        event.listen(async_engine.sync_engine, "before_cursor_execute", before)
        try:
            async with async_engine.connect() as conn:
                assert await conn.run_sync(_DIVIDE.fetch_one, {"divisor": 1}) == {"quotient": 1}
                doc = await conn.run_sync(_ECHO_JSON.fetch_one, {"doc": {"a": [1]}})
                assert doc == {"doc": {"a": [1]}}
                with pytest.raises(DataError, match="division by zero"):
                    await conn.run_sync(_DIVIDE.fetch_one, {"divisor": 0})
                await conn.rollback()
                await conn.run_sync(_enqueue, "async")
                await conn.commit()
        finally:
            await async_engine.dispose()

    asyncio.run(body())
    assert [type(context) for context in contexts] == [ListenerContext, ListenerContext]
    assert operation_count(engine) == 1
