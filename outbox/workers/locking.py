"""The per-operation advisory lock: whoever holds it owns the operation's next move.

A session-level lock on a connection used by nothing else while it is held, released with
``pg_advisory_unlock_all()`` before the connection returns to the pool (or the connection is
discarded if that fails), also when the lock step itself fails after the lock was granted, so
no lock ever outlives its holder's work; the pool's reset unlocks any connection that may
still hold one (``outbox.db``), whoever forgot. A process that dies
drops its connection, and PostgreSQL frees the lock with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from uuid import UUID

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from outbox import faults, sql, transitions
from outbox.locks import operation_lock_key
from outbox.models import Operation
from outbox.sql.locks import DispatchView
from outbox.transitions import SendTerms


@dataclass(frozen=True, slots=True)
class SentAtLock:
    """An operation the lock step itself moved to `sent` (:meth:`DispatchLocks.lock` with
    ``send``), committed durably in the statement that took the lock."""

    #: The operation as moved (``attempts`` already counts this attempt).
    operation: Operation
    #: When that statement started (``time.monotonic()``): the send deadline runs from it.
    started: float


#: What a lock step found: the row read after the lock, the row it moved to `sent`, or
#: ``None`` (no such operation).
Found = DispatchView | SentAtLock | None


@dataclass(frozen=True, slots=True)
class Handed:
    """A connection holding one operation's lock, and the operation as read after it was
    granted: what a worker's direct take hands to its task (:mod:`outbox.workers.handoff`)."""

    conn: Connection
    #: The row read after the lock was granted (None: no such operation), or moved to `sent`
    #: by the take itself.
    found: Found
    #: When it was handed (``time.monotonic()``).
    at: float


#: Takes the lock on a fresh connection: (taken, the session's ``synchronous_commit`` if read).
_Take = Callable[[Connection], tuple[bool, str | None]]


@contextmanager
def operation_lock(
    engine: Engine, operation_id: UUID, *, autocommit: bool = False
) -> Iterator[Connection | None]:
    """A connection holding ``operation_id``'s lock, or ``None`` if another holder has it.

    ``autocommit=True`` hands over a connection on which every statement is its own
    transaction, so a single-statement move costs one round trip instead of three (psycopg
    sends BEGIN and COMMIT as commands of their own); the session's ``synchronous_commit`` is
    checked to be ``on`` in the lock's own round trip, so each of those commits is durable
    before it returns. A pooled connection found dead at the lock (the server restarted) is
    replaced once: nothing was written yet.
    """
    key = operation_lock_key(operation_id)

    def take(conn: Connection) -> tuple[bool, str | None]:
        if autocommit:
            durable = sql.locks.try_lock_durable(conn, key)
            return durable.taken, durable.synchronous_commit
        return sql.locks.try_lock(conn, key), None

    conn, taken = _locked_connection(engine, take, autocommit=autocommit)
    try:
        yield conn if taken else None
    finally:
        release(conn)
        conn.close()


class DispatchLocks:
    """The dispatcher's locks for the operations of one message, taken one after the other
    on one connection: each is :func:`operation_lock` (``autocommit=True``) that also reads
    the operation in the lock's own round trip, and a lock is released in the statement that
    takes the next one (the connection is never used by two attempts at once). :meth:`close`
    releases the last. Use as a context manager.

    ``adopt``: the connection already holding an operation's lock that this process's
    direct take left for it, if any (:meth:`outbox.workers.handoff.Handoffs.adopt`): such a
    lock is adopted, not taken again.
    """

    def __init__(
        self, engine: Engine, *, adopt: Callable[[UUID], Handed | None] | None = None
    ) -> None:
        self.engine = engine
        self._adopt = adopt
        self._conn: Connection | None = None

    def __enter__(self) -> DispatchLocks:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @contextmanager
    def lock(
        self, operation_id: UUID, *, send: SendTerms | None = None
    ) -> Iterator[tuple[Connection, Found] | None]:
        """``(connection, found)`` holding ``operation_id``'s lock, ``found`` being ``None``
        if the operation does not exist; ``None`` if another holder has the lock.

        The row is read after the lock was granted (``sql.locks.try_lock_and_read``), so it
        shows every move the lock's previous holder committed. A block that raises, or leaves
        the connection broken or inside a transaction, gets its lock released and its
        connection returned at once; the next lock takes a fresh one.

        ``send``: the statement that takes the lock also moves the operation to `sent` if
        every check these terms hold passes, committed durably
        (:func:`outbox.transitions.lock_and_mark_sent_and_commit`): ``found`` is then a
        :class:`SentAtLock`. When it did not move (a check said no, or another transaction
        holds the row) the row is read as without ``send``, the lock kept, and the caller
        decides.

        A connection the direct take handed over for ``operation_id`` holds its lock and the
        row read after it already: it replaces this object's connection, no round trip.
        """
        key = operation_lock_key(operation_id)
        read: list[Found] = []
        unlock_first = self._conn is not None

        def take(conn: Connection) -> tuple[bool, str | None]:
            unlock = unlock_first
            if send is not None:
                sent = _lock_and_send(conn, operation_id, key, unlock_first, send)
                if sent is not None:
                    taken, moved = sent
                    if not taken or moved is not None:
                        read[:] = [moved]
                        return taken, "on"
                    unlock = False  # held, nothing moved: read the row, the lock kept
            locked = sql.locks.try_lock_and_read(conn, key, operation_id, unlock_first=unlock)
            read[:] = [locked.found]
            return locked.taken, locked.synchronous_commit

        handed = self._adopt(operation_id) if self._adopt is not None else None
        if handed is not None:
            self.close()  # the previous operation's lock, if any
            self._conn = conn = handed.conn
            read[:], taken = [handed.found], True
        else:
            conn, taken = self._next_connection(take)
        kept = False
        try:
            yield (conn, read[0]) if taken else None
            kept = not conn.invalidated and not conn.in_transaction()
        finally:
            if not kept:
                self.close()

    def _next_connection(self, take: _Take) -> tuple[Connection, bool]:
        conn = self._conn
        if conn is not None:
            try:
                taken = _take_durably(conn, take)
            except DBAPIError:
                self.close()  # the previous lock goes with the connection; start afresh
            except BaseException:
                self.close()  # this lock may have been granted: released with the previous
                raise
            else:
                return conn, taken
        conn, taken = _locked_connection(self.engine, take, autocommit=True)
        self._conn = conn
        return conn, taken

    def close(self) -> None:
        """Release the lock held (or discard the connection) and return the connection."""
        conn, self._conn = self._conn, None
        if conn is not None:
            release(conn)
            conn.close()


def _lock_and_send(
    conn: Connection, operation_id: UUID, key: int, unlock_first: bool, terms: SendTerms
) -> tuple[bool, SentAtLock | None] | None:
    """The lock and the `sent` move in one statement: (taken, what it moved), or ``None``
    when the row was held by another transaction (nothing moved; the lock, granted before
    the row was asked for, is held)."""
    started = time.monotonic()
    try:
        locked = transitions.lock_and_mark_sent_and_commit(
            conn, operation_id, lock_key=key, unlock_first=unlock_first, terms=terms
        )
    except DBAPIError as exc:
        if not sql.locks.is_row_lock_busy(exc):
            raise
        conn.rollback()  # SQLAlchemy's own marker: the statement failed by itself
        return None
    if locked.moved is None:
        return locked.taken, None
    return True, SentAtLock(locked.moved.operation, started)


def _locked_connection(engine: Engine, take: _Take, *, autocommit: bool) -> tuple[Connection, bool]:
    for retry in (False, True):
        conn = engine.connect()
        try:
            if autocommit:
                conn.execution_options(isolation_level="AUTOCOMMIT")
            taken = _take_durably(conn, take)
        except DBAPIError as exc:
            discard(conn)
            if retry or not exc.connection_invalidated:
                raise
            continue
        except BaseException:
            discard(conn)
            raise
        return conn, taken
    raise AssertionError("unreachable")  # pragma: no cover


def discard(conn: Connection) -> None:
    """Return a connection that may hold a session lock (a lock step that failed after the
    lock may have been granted, a handed lock no task adopted): a rollback does not release
    one. Unlocked here unless the connection is already invalidated (the server then frees
    its locks); the pool's reset (``outbox.db``) would unlock too."""
    if not conn.invalidated:
        release(conn)
    conn.close()


def _take_durably(conn: Connection, take: _Take) -> bool:
    """``take`` the lock; if taken and the session's ``synchronous_commit`` was read and is
    not ``on``, set it (every later commit on the connection then waits for the WAL flush)."""
    taken, synchronous_commit = take(conn)
    if taken:
        faults.point("lock_granted")
    if taken and synchronous_commit not in (None, "on"):
        sql.locks.set_synchronous_commit(conn)
    conn.commit()
    return taken


def release(conn: Connection) -> None:
    """Leave no lock behind on a pooled connection: unlock, or throw the connection away."""
    try:
        conn.rollback()
        sql.locks.unlock_all(conn)
        conn.commit()
    except Exception:  # noqa: BLE001 -- whatever broke, the connection must not keep the lock
        conn.invalidate()
