"""The operation lock never outlives its checkout: a failed lock step and the pool's reset."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from outbox import faults, sql
from outbox.db import create_engine
from outbox.locks import operation_lock_key
from outbox.workers.locking import DispatchLocks, operation_lock
from tests.factories import make_operation


@pytest.fixture
def one_connection(database_url: str, engine: Engine) -> Iterator[Engine]:
    """An engine with a single pooled connection (every checkout draws the one a failed lock
    step returned), sessions starting with synchronous_commit=off so the lock step also sets
    it, and no pre-ping (as the worker's dispatch engine). ``engine`` empties the tables."""
    del engine
    pooled = create_engine(
        database_url,
        pool_size=1,
        max_overflow=0,
        pool_pre_ping=False,
        connect_args={"options": "-c synchronous_commit=off"},
    )
    yield pooled
    pooled.dispose()


def _advisory_locks(engine: Engine) -> list[int]:
    """The pids holding an advisory lock in the test database."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND database = "
                    "(SELECT oid FROM pg_database WHERE datname = current_database())"
                )
            ).scalars()
        )


def _free(engine: Engine, operation_id: uuid.UUID) -> bool:
    """Whether another connection can take the operation's lock (and gives it back)."""
    with engine.connect() as probe:
        taken = sql.locks.try_lock(probe, operation_lock_key(operation_id))
        sql.locks.unlock_all(probe)
        return taken


def _operation_lock(engine: Engine, operation_id: uuid.UUID) -> None:
    with operation_lock(engine, operation_id, autocommit=True) as conn:
        assert conn is not None


def _dispatch_lock(engine: Engine, operation_id: uuid.UUID) -> None:
    with DispatchLocks(engine) as locks, locks.lock(operation_id) as locked:
        assert locked is not None


def _failing_set(conn: Connection) -> None:
    # A real server error at the step after the grant (an invalid value for the setting).
    conn.execute(text("SET synchronous_commit = 'sometimes'"))


@pytest.mark.parametrize("lock", [_operation_lock, _dispatch_lock])
@pytest.mark.parametrize("failure", ["fault", "server_error"])
def test_a_lock_step_failing_after_the_grant_leaves_no_lock_behind(
    one_connection: Engine,
    engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
    lock: Callable[[Engine, uuid.UUID], None],
    failure: str,
) -> None:
    """A lock step that fails after PostgreSQL granted the lock returns its connection to the
    pool without the lock: no advisory lock remains, and another connection takes it at once."""
    op = make_operation(engine)
    if failure == "fault":
        with faults.armed("lock_granted", "raise"), pytest.raises(faults.InjectedFault):
            lock(one_connection, op.id)
    else:
        monkeypatch.setattr(sql.locks, "set_synchronous_commit", _failing_set)
        with pytest.raises(DBAPIError, match="synchronous_commit"):
            lock(one_connection, op.id)
        monkeypatch.undo()
    assert _advisory_locks(engine) == []
    assert _free(engine, op.id)
    lock(one_connection, op.id)  # and through the pool's connection again
    assert _advisory_locks(engine) == []


def test_the_pool_releases_a_session_lock_left_on_a_returned_connection(
    one_connection: Engine, engine: Engine
) -> None:
    """A connection returned to the pool still holding a session advisory lock (a rollback
    does not release one) is unlocked by the pool's reset before anyone draws it again."""
    op = make_operation(engine)
    key = operation_lock_key(op.id)
    with one_connection.connect() as conn:
        assert sql.locks.try_lock(conn, key)
        conn.commit()
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    assert _advisory_locks(engine) == []
    assert _free(engine, op.id)
    with one_connection.connect() as conn:
        assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() == pid  # pooled
