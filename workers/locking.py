"""The per-operation advisory lock: whoever holds it owns the operation's next move.

A session-level lock on a connection used by nothing else while it is held, released with
``pg_advisory_unlock_all()`` before the connection returns to the pool (or the connection is
discarded if that fails), so no lock ever outlives its holder's work. A process that dies
drops its connection, and PostgreSQL frees the lock with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from uuid import UUID

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from outbox import statements
from outbox.locks import operation_lock_key


@contextmanager
def operation_lock(
    engine: Engine, operation_id: UUID, *, autocommit: bool = False
) -> Iterator[Connection | None]:
    """A connection holding ``operation_id``'s lock, or ``None`` if another holder has it.

    ``autocommit=True`` (the dispatcher's hot path) hands over a connection on which every
    statement is its own transaction, so a single-statement move costs one round trip
    instead of three (psycopg sends BEGIN and COMMIT as commands of their own); the
    session's ``synchronous_commit`` is checked to be ``on`` in the lock's own round trip,
    so each of those commits is durable before it returns. A pooled connection found dead
    at the lock (the server restarted) is replaced once: nothing was written yet.
    """
    key = operation_lock_key(operation_id)
    conn, taken = _locked_connection(engine, key, autocommit=autocommit)
    try:
        yield conn if taken else None
    finally:
        release(conn)
        conn.close()


def _locked_connection(engine: Engine, key: int, *, autocommit: bool) -> tuple[Connection, bool]:
    for retry in (False, True):
        conn = engine.connect()
        try:
            if autocommit:
                conn.execution_options(isolation_level="AUTOCOMMIT")
                taken, synchronous_commit = statements.try_lock_durable(conn, key)
                if taken and synchronous_commit != "on":
                    statements.set_synchronous_commit(conn)
            else:
                taken = statements.try_lock(conn, key)
            conn.commit()
        except DBAPIError as exc:
            conn.close()
            if retry or not exc.connection_invalidated:
                raise
            continue
        except BaseException:
            conn.close()
            raise
        return conn, taken
    raise AssertionError("unreachable")  # pragma: no cover


def release(conn: Connection) -> None:
    """Leave no lock behind on a pooled connection: unlock, or throw the connection away."""
    try:
        conn.rollback()
        statements.unlock_all(conn)
        conn.commit()
    except Exception:  # noqa: BLE001 -- whatever broke, the connection must not keep the lock
        conn.invalidate()
