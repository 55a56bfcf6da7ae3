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

from outbox import statements
from outbox.locks import operation_lock_key


@contextmanager
def operation_lock(engine: Engine, operation_id: UUID) -> Iterator[Connection | None]:
    """A connection holding ``operation_id``'s lock, or ``None`` if another holder has it."""
    with engine.connect() as conn:
        try:
            taken = statements.try_lock(conn, operation_lock_key(operation_id))
            conn.commit()
            yield conn if taken else None
        finally:
            release(conn)


def release(conn: Connection) -> None:
    """Leave no lock behind on a pooled connection: unlock, or throw the connection away."""
    try:
        conn.rollback()
        statements.unlock_all(conn)
        conn.commit()
    except Exception:  # noqa: BLE001 -- whatever broke, the connection must not keep the lock
        conn.invalidate()
