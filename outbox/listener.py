"""The shared LISTEN behind :func:`outbox.aio.wait`: one per event loop and database.

A waiter costs no thread and no connection. Each event loop holds, per database, one
:class:`SettledListener` with two autocommit connections: one sleeps on ``LISTEN
outbox_settled`` and does nothing else (psycopg holds a connection's lock while it waits for
notifications), the other runs everything the waiters ask for, one statement at a time: it
registers each watched operation in ``outbox.waiters`` (under its backend pid: a settled move
NOTIFYs only operations someone waits for), forgets it when its last waiter leaves, and reads
the rows back. What is asked for while a statement runs is batched into the next, one
statement per kind (up to 50 rows per read): 200 waiters registering, re-reading or leaving
at once cost a few round trips, not 200 each. Waiters polling at one interval re-read on one
grid of the loop's clock (:func:`outbox.aio.wait`), so their polls batch as well.

A lost connection is opened again: the control connection re-registers every watched
operation before its next statement, and after the listening one is back every waiter
re-reads (a notification may have gone with it). The listener stops when :func:`close` is
awaited, or when its event loop cancels its tasks at the end of ``asyncio.run``; it never
outlives its loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast
from uuid import UUID

import psycopg
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.pool import NullPool

from outbox import sql
from outbox.db import create_async_engine, database_url, normalize_url
from outbox.models import Operation

log = logging.getLogger(__name__)

T = TypeVar("T")

# What the waiters ask the control connection for, in the order a batch runs them.
_FORGET, _REGISTER, _READ = "forget", "register", "read"
_KINDS = (_FORGET, _REGISTER, _READ)

# Operations read back per statement (the rest wait for the next one).
_READ_BATCH = 50

# Between attempts to open a lost connection again: doubling from the first to the last.
_RECONNECT_FIRST_S = 0.05
_RECONNECT_MAX_S = 2.0


class ListenerClosed(Exception):
    """The listener was closed (:func:`close`) while a waiter was using it."""


@dataclass
class _Watch:
    """The waiters of one operation: their wake-up events, and its registration."""

    events: set[asyncio.Event] = field(default_factory=set)
    registered: asyncio.Future[None] | None = None


class SettledListener:
    """One event loop's LISTEN on ``outbox_settled`` for one database, shared by its waiters."""

    def __init__(self, engine: AsyncEngine, *, owns_engine: bool) -> None:
        self._engine = engine
        self._owns_engine = owns_engine
        self._listening: AsyncConnection | None = None
        self._control: AsyncConnection | None = None
        self._lock = asyncio.Lock()  # the control connection runs one statement at a time
        self._watches: dict[UUID, _Watch] = {}
        # What the waiters asked the control connection for, by kind, batched by _flush.
        self._pending: dict[str, dict[UUID, list[asyncio.Future[Any]]]] = {
            kind: {} for kind in _KINDS
        }
        self._flusher: asyncio.Task[None] | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._starting: asyncio.Future[None] | None = None
        self.closed = False
        #: Statements run for the waiters, by kind (each for every operation asked meanwhile).
        self.statements = dict.fromkeys(_KINDS, 0)

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Open both connections and LISTEN; concurrent callers share one start."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)

    async def _start(self) -> None:
        self._control = await self._connect()
        try:
            self._listening = await self._connect_listening()
        except BaseException:
            await _discard(self._control)
            raise
        self._receiver = asyncio.get_running_loop().create_task(
            self._receive(), name="outbox.aio settled listener"
        )

    async def close(self) -> None:
        """Stop listening, forget the registrations and close both connections; waiters
        still waiting move to the loop's next listener."""
        if self._receiver is not None and not self._receiver.done():
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
        elif not self.closed:  # never started: nothing but its engine to release
            self.closed = True
            await self._release()

    async def _release(self) -> None:
        # Invalidated, not pooled: a connection that LISTENs or holds registrations must not
        # go back to a pool of the agent's engine.
        async with self._lock:
            leaving = [*self._watches, *self._pending[_FORGET]]
            if self._control is not None and leaving:
                # Waiters still waiting register again on the loop's next listener.
                with contextlib.suppress(Exception):
                    await self._control.run_sync(sql.intents.forget_waiters, leaving)
            for conn in (self._listening, self._control):
                await _discard(conn)
            self._listening = self._control = None
        if self._owns_engine:
            await self._engine.dispose()

    # --- what the waiters use -------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def watching(self, operation_id: UUID) -> AsyncIterator[asyncio.Event]:
        """Register ``operation_id`` (once for all its waiters) while the block runs; the
        event yielded is set when its settled move's NOTIFY arrives."""
        event = asyncio.Event()
        watch = self._watches.setdefault(operation_id, _Watch())
        watch.events.add(event)
        try:
            failed = (
                watch.registered is not None
                and watch.registered.done()
                and (watch.registered.cancelled() or watch.registered.exception() is not None)
            )
            if watch.registered is None or failed:
                watch.registered = asyncio.ensure_future(self._register(operation_id))
            # Shielded: one waiter's cancellation must not cancel the others' registration.
            await asyncio.shield(watch.registered)
            yield event
        finally:
            watch.events.discard(event)
            if not watch.events and self._watches.get(operation_id) is watch:
                del self._watches[operation_id]
                await self._forget(operation_id, watch)

    async def read(self, operation_id: UUID) -> Operation | None:
        """The operation's row as committed now, read with whatever else is being asked for."""
        if self.closed:
            raise ListenerClosed
        found: Operation | None = await self._ask(_READ, operation_id)
        return found

    async def _register(self, operation_id: UUID) -> None:
        await self._ask(_REGISTER, operation_id)

    async def _forget(self, operation_id: UUID, watch: _Watch) -> None:
        registered = watch.registered
        if registered is None:
            return
        if not registered.done():
            # Its waiters all left (cancelled) before it was written: forget it after.
            await asyncio.wait([registered])
        if registered.cancelled() or registered.exception() is not None:
            return
        await self._ask(_FORGET, operation_id)

    def _ask(self, kind: str, operation_id: UUID) -> asyncio.Future[Any]:
        """Queue one operation's statement of ``kind``; its result, once a batch ran it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending[kind].setdefault(operation_id, []).append(future)
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush())
        return future

    async def _flush(self) -> None:
        """Run what the waiters asked for, one statement per kind for all asked meanwhile:
        forgets, then registrations (so an operation watched again stays registered), then
        reads (a waiter reads only once registered)."""
        while any(self._pending.values()):
            async with self._lock:
                for kind in _KINDS:
                    pending = self._pending[kind]
                    # At most _READ_BATCH rows per read: building each row's Operation runs
                    # on the loop, and 200 at once held it for 10-16 ms (bench/aio.py).
                    limit = _READ_BATCH if kind == _READ else None
                    batch = dict(itertools.islice(pending.items(), limit))
                    for operation_id in batch:
                        del pending[operation_id]
                    if batch:
                        await self._run_batch(kind, batch)

    async def _run_batch(self, kind: str, batch: dict[UUID, list[asyncio.Future[Any]]]) -> None:
        """Run one statement for ``batch`` and hand its result (or error) to each waiter."""
        try:
            found = await self._statement(kind, list(batch))
        except BaseException as exc:
            error = exc if isinstance(exc, Exception) else ListenerClosed()
            for futures in batch.values():
                for future in futures:
                    if not future.done():
                        future.set_exception(error)
            if error is not exc:
                raise
            return
        for operation_id, futures in batch.items():
            for future in futures:
                if not future.done():
                    future.set_result(found.get(operation_id))

    async def _statement(self, kind: str, ids: list[UUID]) -> dict[UUID, Operation]:
        if kind == _FORGET:
            # Not one watched again meanwhile (its new waiter relies on the row), and nothing
            # once closed (_release forgot them). Best effort: a row left by a lost connection
            # names a dead backend, which the next registration anywhere deletes; it costs at
            # most one needless NOTIFY.
            ids = [operation_id for operation_id in ids if operation_id not in self._watches]
            if ids and not self.closed:
                self.statements[kind] += 1
                with contextlib.suppress(DBAPIError, psycopg.Error):
                    await self._on_control(lambda c: sql.intents.forget_waiters(c, ids))
            return {}
        if self.closed:
            raise ListenerClosed
        self.statements[kind] += 1
        if kind == _REGISTER:
            await self._on_control(lambda c: sql.intents.register_waiters(c, ids))
            return {}
        rows = await self._on_control(lambda c: sql.intents.get_operations(c, ids))
        return {op.id: op for op in rows}

    # --- connections ----------------------------------------------------------------------

    async def _connect(self) -> AsyncConnection:
        conn = await self._engine.connect()
        try:
            return await conn.execution_options(isolation_level="AUTOCOMMIT")
        except BaseException:
            await _discard(conn)
            raise

    async def _connect_listening(self) -> AsyncConnection:
        conn = await self._connect()
        try:
            await conn.run_sync(sql.notify.listen_settled)
        except BaseException:
            await _discard(conn)
            raise
        return conn

    async def _on_control(self, statement: Callable[[Connection], T]) -> T:
        """Run ``statement`` on the control connection (the lock held); a lost connection is
        opened again, every watched operation registered again, and the statement retried."""
        retried = False
        while True:
            try:
                if self._control is None:
                    self._control = await self._connect()
                    if self._watches:
                        await self._control.run_sync(
                            sql.intents.register_waiters, list(self._watches)
                        )
                return await self._control.run_sync(statement)
            except (DBAPIError, psycopg.OperationalError) as exc:
                if retried or not _lost(exc):
                    raise
                retried = True
                log.warning("outbox.aio: the waiters' connection was lost; opening it again")
                await _discard(self._control)
                self._control = None

    async def _receive(self) -> None:
        """Wake the waiters of each notified operation; reopen a lost connection."""
        try:
            delay = _RECONNECT_FIRST_S
            while True:
                try:
                    if self._listening is None:
                        self._listening = await self._connect_listening()
                        self._wake_all()  # a notification may have been lost with the old one
                    delay = _RECONNECT_FIRST_S
                    raw = await self._listening.get_raw_connection()
                    listener = cast(psycopg.AsyncConnection[Any], raw.driver_connection)
                    async for notification in listener.notifies():
                        self._wake(notification.payload)
                except (DBAPIError, psycopg.Error, OSError) as exc:
                    log.warning(
                        "outbox.aio: the listening connection was lost (%s); opening it again",
                        type(exc).__name__,
                    )
                    await _discard(self._listening)
                    self._listening = None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _RECONNECT_MAX_S)
        finally:
            # Cancelled (close(), the loop's end) or failed: its waiters move to a new one.
            self.closed = True
            self._wake_all()
            await self._release()

    def _wake(self, payload: str) -> None:
        try:
            operation_id = UUID(payload)
        except ValueError:
            return
        watch = self._watches.get(operation_id)
        for event in watch.events if watch is not None else ():
            event.set()

    def _wake_all(self) -> None:
        for watch in self._watches.values():
            for event in watch.events:
                event.set()


def _lost(exc: BaseException) -> bool:
    if isinstance(exc, DBAPIError):
        return bool(exc.connection_invalidated) or isinstance(exc.orig, psycopg.OperationalError)
    return isinstance(exc, psycopg.OperationalError)


async def _discard(conn: AsyncConnection | None) -> None:
    """Close ``conn`` for good (not back to a pool), whatever state it is in."""
    if conn is None:
        return
    with contextlib.suppress(Exception):
        await conn.invalidate()
    with contextlib.suppress(Exception):
        await conn.close()


# --- one per event loop and database -------------------------------------------------------

_LISTENERS: dict[asyncio.AbstractEventLoop, dict[object, SettledListener]] = {}


async def listener_for(engine: AsyncEngine | str | None) -> SettledListener:
    """The running loop's listener on ``engine`` (an engine, a URL, or ``None``: the
    configured database), started on first use."""
    loop = asyncio.get_running_loop()
    for other in [other for other in _LISTENERS if other.is_closed()]:
        del _LISTENERS[other]  # ended without close(): its connections went with its tasks
    listeners = _LISTENERS.setdefault(loop, {})
    key: object = engine if isinstance(engine, AsyncEngine) else engine or None
    listener = listeners.get(key)
    if listener is None or listener.closed:
        if isinstance(engine, AsyncEngine):
            listener = SettledListener(engine, owns_engine=False)
        else:
            # The configured database may be the embedded one, which may have to start.
            url = normalize_url(engine) if engine else await asyncio.to_thread(database_url)
            listener = SettledListener(
                create_async_engine(url, poolclass=NullPool), owns_engine=True
            )
        listeners[key] = listener
    try:
        await listener.start()
    except BaseException:
        if listeners.get(key) is listener:
            del listeners[key]
            await listener.close()
        raise
    return listener


async def close() -> None:
    """Close the running event loop's listeners (each database's), and their connections."""
    for listener in _LISTENERS.pop(asyncio.get_running_loop(), {}).values():
        await listener.close()


def listeners_of_this_loop() -> list[SettledListener]:
    """The running loop's listeners (tests count their statements)."""
    return list(_LISTENERS.get(asyncio.get_running_loop(), {}).values())
