"""The hot statements, run on psycopg directly inside the caller's SQLAlchemy transaction.

An attempt runs three statements (lock and read, `sent`, outcome) and an enqueue one; for
each, SQLAlchemy's own work (the compiled-cache lookup, parameter processing, and above
all result metadata built from psycopg's cursor description, one object per column of a
27-column row) cost twice what psycopg spends sending it and reading the row. A
:class:`DriverStatement` is compiled once by SQLAlchemy, for the psycopg dialect, then
handed to the psycopg connection under the caller's :class:`~sqlalchemy.Connection` or
:class:`~sqlalchemy.orm.Session`; its columns are named once, when it is built.

What stays as SQLAlchemy does it: the statement joins the caller's transaction (begun if
it was not, as ``execute`` would have); a driver error comes out as SQLAlchemy's
``DBAPIError`` subclass, the connection invalidated if it was lost; listeners of the
``before_cursor_execute`` and ``after_cursor_execute`` events see the statement, and may
change it as SQLAlchemy lets them (their execution context is a :class:`ListenerContext`,
which keeps what they set on it, so a tracer's span is ended). What does not: SQLAlchemy's
``echo`` logging, and the ``handle_error`` event (a failed statement raises without it).
A connection whose driver is not psycopg 3 (an agent's own psycopg2 engine) runs the
statement through SQLAlchemy as before.

This is the one way a statement runs other than SQLAlchemy's ``execute``, kept for the
measured hot path only: which statements use it is said in :mod:`outbox.sql`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import psycopg
from psycopg.types.json import Jsonb
from sqlalchemy import Connection
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.sql import Select, TextClause
from sqlalchemy.types import JSON
from sqlalchemy.util import await_only

from outbox.models import Executor

_DIALECT = PGDialect_psycopg()  # type: ignore[no-untyped-call]  # untyped in SQLAlchemy


@dataclass(frozen=True)
class DriverStatement:
    """One statement compiled for psycopg, the names of its result columns in order, and
    which of its parameters are JSON (wrapped for psycopg, as SQLAlchemy's dialect does)."""

    clause: TextClause | Select[Any]
    sql: str
    columns: tuple[str, ...]
    defaults: Mapping[str, Any]
    json_params: frozenset[str]

    @classmethod
    def of(cls, clause: TextClause | Select[Any], columns: Sequence[str]) -> DriverStatement:
        """Compile ``clause`` (whose result columns are ``columns``, in order) once."""
        compiled = clause.compile(dialect=_DIALECT)
        json_params = frozenset(
            name for name, bind in compiled.binds.items() if isinstance(bind.type, JSON)
        )
        # Bound literals (literal(...)) carry their values in the compiled statement.
        defaults = {name: value for name, value in compiled.params.items() if value is not None}
        return cls(clause, compiled.string, tuple(columns), defaults, json_params)

    def fetch_one(self, executor: Executor, params: Mapping[str, Any]) -> dict[str, Any] | None:
        """Run the statement in ``executor``'s transaction; its first row by column name."""
        rows = self.fetch_all(executor, params)
        return rows[0] if rows else None

    def fetch_all(self, executor: Executor, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Run the statement in ``executor``'s transaction; its rows by column name."""
        conn = _connection(executor)
        dbapi = conn.connection.driver_connection
        if not isinstance(dbapi, psycopg.Connection | psycopg.AsyncConnection):
            return [dict(row) for row in conn.execute(self.clause, dict(params)).mappings()]
        values = {**self.defaults, **params}
        for name in self.json_params & values.keys():
            if values[name] is not None:
                values[name] = Jsonb(values[name])
        try:
            if isinstance(dbapi, psycopg.Connection):
                rows = _run_sync(conn, dbapi, self.sql, values)
            else:  # an async engine's: we are in the greenlet of its run_sync
                rows = _run_async(conn, dbapi, self.sql, values)
        except _Failed as failed:
            raise _as_sqlalchemy_error(conn, failed.sql, failed.values, failed.error) from (
                failed.error
            )
        return [dict(zip(self.columns, row, strict=True)) for row in rows]


class _Failed(Exception):
    """A driver error, with the statement and values as the listeners left them."""

    def __init__(self, sql: str, values: dict[str, Any], error: psycopg.Error) -> None:
        super().__init__(sql)
        self.sql, self.values, self.error = sql, values, error


def _run_sync(
    conn: Connection, dbapi: psycopg.Connection[Any], sql: str, values: dict[str, Any]
) -> list[tuple[Any, ...]]:
    events = conn.dispatch
    execution = ListenerContext()
    try:
        with dbapi.cursor() as cursor:
            if events.before_cursor_execute:
                # As SQLAlchemy does: every listener hands back the statement and values,
                # possibly changed (a tracer appending a comment).
                for listener in events.before_cursor_execute:
                    sql, values = listener(conn, cursor, sql, values, execution, False)
            cursor.execute(sql, values)
            if events.after_cursor_execute:
                for listener in events.after_cursor_execute:
                    listener(conn, cursor, sql, values, execution, False)
            return cursor.fetchall()
    except psycopg.Error as exc:
        raise _Failed(sql, values, exc) from exc


def _run_async(
    conn: Connection, dbapi: psycopg.AsyncConnection[Any], sql: str, values: dict[str, Any]
) -> list[tuple[Any, ...]]:
    """:func:`_run_sync` on psycopg's async connection, from SQLAlchemy's greenlet: each
    coroutine is awaited on the event loop as SQLAlchemy's own async adaption does."""
    events = conn.dispatch
    execution = ListenerContext()
    cursor = dbapi.cursor()
    try:
        if events.before_cursor_execute:
            for listener in events.before_cursor_execute:
                sql, values = listener(conn, cursor, sql, values, execution, False)
        await_only(cursor.execute(sql, values))
        if events.after_cursor_execute:
            for listener in events.after_cursor_execute:
                listener(conn, cursor, sql, values, execution, False)
        return await_only(cursor.fetchall())
    except psycopg.Error as exc:
        raise _Failed(sql, values, exc) from exc
    finally:
        await_only(cursor.close())


class ListenerContext:
    """What cursor-execute listeners get as the execution context of a driver statement.

    SQLAlchemy's own context does not exist here. This object takes the attributes a
    listener sets on it in ``before_cursor_execute`` (a tracer's span) and gives them back
    in ``after_cursor_execute``; it has nothing else.
    """


def _connection(executor: Executor) -> Connection:
    """The Connection whose transaction the statement joins, begun as ``execute`` would."""
    if isinstance(executor, Session):
        return executor.connection()
    if not executor.in_transaction():
        executor.begin()
    return executor


def _as_sqlalchemy_error(
    conn: Connection, sql: str, params: Mapping[str, Any], exc: psycopg.Error
) -> DBAPIError:
    """The ``DBAPIError`` SQLAlchemy would have raised; a lost connection is invalidated."""
    lost = conn.dialect.is_disconnect(exc, conn.connection.dbapi_connection, None)  # type: ignore[arg-type]  # psycopg is the DBAPI module
    if lost:
        conn.invalidate(exc)
    error = DBAPIError.instance(
        sql,
        dict(params),
        exc,
        psycopg.Error,
        # As the engine says (ours hide them): bound values are payloads and keys.
        hide_parameters=conn.engine.hide_parameters,
        connection_invalidated=lost,
        dialect=conn.dialect,
    )
    # instance() returns the DBAPIError subclass for a DBAPI error, as it is given here.
    return cast(DBAPIError, error)
