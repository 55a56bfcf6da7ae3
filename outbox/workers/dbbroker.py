"""The database-as-broker transport: kombu's SQLAlchemy transport, woken by NOTIFY.

kombu's virtual transports poll their queues every ``polling_interval``; polling briskly
(0.1 s) kept dispatch quick but cost an idle worker a tenth of a core or more (issue 33).
Here every publish NOTIFYs in its transaction and the consumer sleeps on a
:class:`~outbox.doorbell.Doorbell` between polls: it wakes when a message is committed, when
an ack frees a prefetch slot, or after ``OUTBOX_BROKER_POLL_INTERVAL`` (the
``polling_interval`` transport option, removed before kombu hands the options to
``create_engine``).

kombu creates its two tables the first time a process opens a channel, with nothing against
another process doing the same at the same instant: on a fresh database, processes started
together (``outbox up``, a deployment) crashed at start-up with a duplicate-sequence error.
Our channel creates them under a PostgreSQL advisory lock, and treats a queue row another
process inserted first as found, not as an error.

Publishing is kombu's ``_put`` made cheaper (issue 35: 5.8 ms per message on the relay's
path): kombu looks the queue up, INSERTs through the ORM and commits, four round trips per
message. Ours remembers each queue's id and INSERTs and NOTIFYs in one statement; inside
:meth:`Channel.batch` (the relay's publisher wraps a batch in it) the messages of the whole
batch are written by one statement per queue and one COMMIT: all of them stored, or none. The
relay goes further when the broker is its own database: the batch is written in the claim's
transaction (``batch(on=...)``), so the messages commit with the claim that stamps them
published, or not at all.

Taking a message is kombu's ``_get`` made cheaper too (issue 35: at 100 messages/s the
workers spent half a core on it): kombu looks the queue up, SELECTs ... FOR UPDATE, UPDATEs
and commits, for each queue a worker consumes in turn, and a second consumer blocked on the
first's row lock then found nothing. Ours takes the oldest message of all the consumed
queues in one autocommit statement (``DELETE ... RETURNING``, ``SKIP LOCKED``) on a
connection of its own.

On the database broker in the outbox's own database a worker goes further still (change 38):
the channel that consumes the dispatch queue takes due operations from ``outbox.operations``
itself, before the queues' messages (after them once in a few takes), through a
:class:`DirectSource`
(:mod:`outbox.workers.direct` sets one in a starting worker). Such a worker keeps an idle flag
in ``outbox.relays``, as a relay does, so that enqueue's bell wakes it, and the relay stands by.

A channel looks only where something may be waiting (its ``_due``): where the doorbell says a
commit rang (a publish's NOTIFY: the messages; enqueue's: the outbox), where its last look
found something and more may follow, and everywhere at each poll interval and after a ring of
no NOTIFY (a freed slot, a reconnect). On the steady path a worker woken by enqueue then makes
one statement, its take, not a take and a look at the messages and, after it found the
operation, both again to find nothing (issue 35).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from queue import Empty
from time import monotonic
from typing import Any, Protocol

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport.sqlalchemy import Channel as SQLAlchemyChannel
from kombu.transport.sqlalchemy import Transport as SQLAlchemyTransport
from kombu.transport.sqlalchemy import dumps, loads
from sqlalchemy import Connection, create_engine
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.pool import NullPool

from outbox import sql
from outbox.doorbell import EVERYTHING, MESSAGES, NOTHING_NEW, PLANNED, Doorbell
from outbox.locks import advisory_key

# kombu's models use lazy="noload", which SQLAlchemy 2.1 deprecates; nothing we can act on.
warnings.filterwarnings(
    "ignore", message="The ``noload`` loader strategy is deprecated", category=DeprecationWarning
)

#: Seconds between polls of empty queues when no NOTIFY wakes the consumer
#: (``OUTBOX_BROKER_POLL_INTERVAL``'s default).
POLLING_INTERVAL_S = 5.0


#: Serialises the creation of the broker's tables across processes.
TABLES_LOCK_KEY = advisory_key("outbox.broker", "tables")

#: Messages taken in a row, without a look that found nothing or a sleep between them, that
#: make this worker busy: its idle flag goes down (enqueue stops ringing: NOTIFY costs every
#: agent's commit a cluster-wide lock).
BUSY_AFTER_TAKES = 16
#: A worker taking directly looks at its queues' messages before the outbox once in this
#: many takes (otherwise after it): a backlog of operations never starves them.
MESSAGES_FIRST_EVERY = 4
#: Direct takes in a row that each left more due after which a take claims a message's worth
#: of operations (``OUTBOX_OPS_PER_MESSAGE``) instead of one (a backlog).
BATCH_AFTER_TAKES = 4
#: While its flag is down, a worker taking directly looks this often (nothing rings it)...
BUSY_POLL_S = 0.002
#: ...until its looks found nothing for this long: then its flag goes up.
BUSY_GRACE_S = 0.05
#: How often a worker taking directly refreshes its flag's heartbeat (a relay's, likewise).
TAKER_HEARTBEAT_S = 10.0


@dataclass(frozen=True, slots=True)
class DirectTake:
    """What a direct take found: its message (None: nothing due), and whether more was due."""

    message: Any | None
    more: bool = False


class DirectSource(Protocol):
    """Due operations taken straight from the outbox, as messages of one queue
    (:class:`outbox.workers.direct.DirectDispatch`)."""

    #: The broker queue whose messages these stand in for (this deployment's dispatch queue).
    queue: str

    def take(
        self, conn: Connection, channel: Channel, *, batch: bool, keeping_up: bool
    ) -> DirectTake:
        """Claim the next due operation on ``conn`` (autocommit; with ``batch``, up to a
        message's worth): its message as ``channel`` would deliver it, and whether more is
        due. ``keeping_up``: the worker's last take left nothing due and its idle flag is up
        (latency counts more than the consumer's own work per take)."""
        ...

    def announce(self, conn: Connection, *, idle: bool) -> None:
        """Write this worker's idle flag (and heartbeat) on ``conn``."""
        ...

    def forget(self, conn: Connection) -> None:
        """Remove this worker's flag (it stops taking)."""
        ...


#: This process's direct source (None: messages only); set by :func:`take_directly`.
_direct: DirectSource | None = None


def take_directly(source: DirectSource | None) -> None:
    """Make channels consuming ``source.queue`` take due operations from it too (None: stop)."""
    global _direct  # noqa: PLW0603 -- one per process, set by the starting worker
    _direct = source


class Channel(SQLAlchemyChannel):  # type: ignore[misc]
    """kombu's SQLAlchemy channel, safe for processes that start together."""

    def _open(self) -> Any:
        url = self.connection.client.hostname
        if url in self._engines:
            return super()._open()
        # The first open in this process creates the tables if missing: one process at a time.
        lock = create_engine(url, poolclass=NullPool, hide_parameters=True)
        try:
            with lock.connect() as conn:
                sql.locks.lock(conn, TABLES_LOCK_KEY)
                try:
                    return super()._open()
                finally:
                    sql.locks.unlock(conn, TABLES_LOCK_KEY)
        finally:
            lock.dispose()

    def _engine_from_config(self) -> Any:
        # kombu hands every transport option to create_engine: not the transport's own.
        options = self.connection.client.transport_options
        interval = options.pop("polling_interval", None)
        try:
            return super()._engine_from_config()
        finally:
            if interval is not None:
                options["polling_interval"] = interval

    #: Queue name -> its row's id, looked up (or created) once per channel.
    _queue_ids: dict[str, int]
    #: Inside :meth:`batch`: queue name -> the serialised messages not yet written.
    _pending: dict[str, list[str]] | None = None

    def _queue_id(self, queue: str) -> int:
        ids = self.__dict__.setdefault("_queue_ids", {})
        if queue not in ids:
            ids[queue] = int(self._get_or_create(queue).id)
            # kombu's look-up leaves its session in a transaction: end it, or the
            # connection stays idle in a transaction, holding back VACUUM for good.
            self.session.commit()
        return int(ids[queue])

    #: The autocommit connection messages are taken on, opened by the first take.
    _taker: Connection | None = None
    #: Takes so far (the messages go first on every MESSAGES_FIRST_EVERY-th).
    _takes = 0
    #: Inside :meth:`capture`: the messages published to the queue named, not stored.
    _captured: list[Any] | None = None
    _capturing: str | None = None
    #: This channel's idle flag in ``outbox.relays`` as last written (None: not written),
    #: and when.
    _idle: bool | None = None
    _announced_at = 0.0
    _flagged_by: DirectSource | None = None
    #: Where a look may find something (doorbell.MESSAGES, doorbell.PLANNED): what rang since
    #: this channel last looked there, and what its last look found (more may follow).
    _due: frozenset[str] = EVERYTHING

    def _taker_connection(self) -> Connection:
        if self._taker is None:
            engine, _ = self._open()
            taker = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            try:
                # A take is advice either way: a lost one (a database crash) delivers a message
                # again or leaves an operation's stamp unwritten, and the dispatcher's
                # compare-and-set makes a second message a no-op. So its commit need not
                # wait for the disk.
                sql.broker.take_without_flush(taker)
            except BaseException:
                taker.close()
                raise
            self._taker = taker
        return self._taker

    def takes_directly(self) -> DirectSource | None:
        """The direct source, if this channel consumes its queue."""
        direct = _direct
        if direct is None or direct.queue not in self._active_queues:
            return None
        return direct

    def mark_due(self, what: frozenset[str]) -> None:
        """Look at ``what`` (doorbell.MESSAGES, doorbell.PLANNED) at the next poll."""
        self._due = self._due | what

    def _take(self, queues: list[str], due: frozenset[str] = EVERYTHING) -> tuple[str, Any]:
        """Remove the oldest message of ``queues``: ``(queue, message)``; Empty if none.

        Only where ``due`` says something may be waiting is looked at (doorbell.MESSAGES:
        the queues' messages; doorbell.PLANNED: the outbox, when this channel consumes the
        direct source's queue); afterwards ``_due`` is what still may be: a source leaves it
        when a look there found nothing (the outbox: when its take said nothing more was due).

        Due operations are looked for first (the steady path's latency), except on every
        :data:`MESSAGES_FIRST_EVERY`-th take, so that a backlog of operations does not starve
        the messages (the other queues', a relay's)."""
        direct = _direct if _direct is not None and _direct.queue in queues else None
        self._takes += 1
        order = (PLANNED, MESSAGES) if self._takes % MESSAGES_FIRST_EVERY else (MESSAGES, PLANNED)
        remaining = set(due)
        try:
            taker = self._taker_connection()
            for source in order:
                if source not in due:
                    continue
                if source == MESSAGES:
                    taken = self._take_message(taker, queues)
                    if taken is not None:
                        return taken
                    remaining.discard(MESSAGES)
                elif direct is None:
                    remaining.discard(PLANNED)
                else:
                    direct_take = self._take_direct(direct, taker)
                    if not direct_take.more:
                        remaining.discard(PLANNED)
                    if direct_take.message is not None:
                        return direct.queue, direct_take.message
        except OperationalError:
            # kombu's connection error: Celery reconnects, and we open a new one.
            remaining = set(EVERYTHING)
            self._close_taker()
            raise
        finally:
            self._due = frozenset(remaining)
        raise Empty()

    def _take_message(self, taker: Connection, queues: list[str]) -> tuple[str, Any] | None:
        """The oldest message of ``queues``, removed, in one autocommit statement."""
        ids = {self._queue_id(queue): queue for queue in queues}
        taken = sql.broker.take_message(taker, list(ids))
        if taken is None:
            return None
        queue_id, payload = taken
        return ids[queue_id], loads(payload)

    #: Direct takes in a row that left more due: from :data:`BATCH_AFTER_TAKES` on, a backlog.
    _streak = 0

    def _take_direct(self, direct: DirectSource, taker: Connection) -> DirectTake:
        """One direct take: a single operation while each finds at most one (the steady
        path: one message per operation, each to a free thread), a message naming several
        once takes keep leaving more due (a backlog: fewer statements and messages for it)."""
        if self._idle is None:
            # Known as a taker from the first take on, busy until a look finds nothing:
            # relays stand by at once, also while a backlog keeps the flag from going up.
            self.announce(idle=False)
        taken = direct.take(
            taker,
            self,
            batch=self._streak >= BATCH_AFTER_TAKES,
            keeping_up=self._streak == 0 and self._idle is not False,
        )
        self._streak = self._streak + 1 if taken.more else 0
        return taken

    #: The producer direct takes build their messages with (:meth:`producer`).
    _producer: Any = None

    def producer(self, app: Any) -> Any:
        """A producer of ``app``'s on this channel, made once (a direct take's messages are
        published through it inside :meth:`capture`)."""
        if self._producer is None:
            self._producer = app.amqp.Producer(self, auto_declare=False)
        return self._producer

    @contextlib.contextmanager
    def capture(self, queue: str) -> Iterator[list[Any]]:
        """Messages published to ``queue`` on this channel inside are collected, not stored:
        each as a consumer would get it from the table (a direct take builds its message so).
        Any other message (a task-sent event for a queue bound in this process) is stored."""
        captured: list[Any] = []
        self._captured, self._capturing = captured, queue
        try:
            yield captured
        finally:
            self._captured = self._capturing = None

    def announce(self, *, idle: bool) -> bool:
        """Write the direct source's idle flag, if this channel takes directly and the flag
        changed; whether it was written. Its heartbeat is refreshed every
        :data:`TAKER_HEARTBEAT_S` besides (relays forget silent flags)."""
        direct = self.takes_directly()
        if direct is None:
            return False
        stale = monotonic() - self._announced_at >= TAKER_HEARTBEAT_S
        if self._idle is idle and not stale:
            return False
        try:
            direct.announce(self._taker_connection(), idle=idle)
        except OperationalError:
            self._close_taker()
            raise
        changed, self._idle, self._announced_at = self._idle is not idle, idle, monotonic()
        self._flagged_by = direct
        return changed

    def heartbeat(self) -> None:
        """Refresh the idle flag's heartbeat if it is due."""
        if self._idle is not None:
            self.announce(idle=self._idle)

    def _get(self, queue: str) -> Any:
        """One message of ``queue`` (``basic_get``); Empty if none."""
        return self._take([queue], EVERYTHING)[1]

    def _poll(self, cycle: Any, callback: Any, timeout: float | None = None) -> None:
        """Deliver the oldest message of every consumed queue, in one statement.

        kombu polls the queues one by one, round robin; one statement over them all costs an
        empty poll one round trip, not one per queue, and serves them in the order sent."""
        queue, message = self._take(list(self._active_queues), self._due)
        callback(message, queue)

    def _close_taker(self) -> None:
        taker, self._taker, self._idle = self._taker, None, None
        if taker is not None:
            with contextlib.suppress(Exception):  # already broken: nothing more to release
                taker.close()

    def close(self) -> None:
        """Close the channel and the connection it takes messages on (and remove its idle
        flag: a worker that stops taking must not keep the bell ringing)."""
        # The source the flag was written for (its consumer may be cancelled by now).
        direct = self._flagged_by
        if direct is not None and self._taker is not None and self._idle is not None:
            with contextlib.suppress(Exception):  # best effort: relays forget silent flags
                direct.forget(self._taker)
        self._close_taker()
        super().close()

    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        """Store one message: at once, or with the rest of the :meth:`batch` it is in."""
        if self._captured is not None and queue == self._capturing:
            # As the table would give it back: a copy, serialised and read again.
            self._captured.append(loads(dumps(payload)))
            return
        if self._pending is not None:
            self._pending.setdefault(queue, []).append(dumps(payload))
            return
        self._write({queue: [dumps(payload)]})

    @contextlib.contextmanager
    def batch(self, on: Connection | None = None) -> Iterator[None]:
        """Messages published inside are written together when it ends: one INSERT per
        queue, its NOTIFY and one COMMIT. If the block or the write fails, none is stored.

        ``on``: write them on that connection, in its transaction, and do not commit (the
        relay's claim: the messages then commit, or roll back, with it). It must be a
        connection to this broker's database."""
        if self._pending is not None:  # nested: the outer batch writes them
            yield
            return
        self._pending = {}
        try:
            yield
            pending = self._pending
        finally:
            self._pending = None
        if pending:
            self._write(pending, on=on)

    def _write(self, messages: dict[str, list[str]], on: Connection | None = None) -> None:
        # The queues' ids first: creating a queue commits kombu's session.
        ids = {queue: self._queue_id(queue) for queue in messages}
        if on is not None:
            for queue, payloads in messages.items():
                # The NOTIFY is delivered when the caller's transaction commits.
                sql.broker.insert_messages(on, ids[queue], queue, payloads)
            return
        try:
            for queue, payloads in messages.items():
                # In the messages' transaction: consumers are woken when they are committed.
                sql.broker.insert_messages(self.session, ids[queue], queue, payloads)
            self.session.commit()
        except OperationalError:
            # As kombu: the publish fails (and may be retried), never reported stored.
            self.session.rollback()
            raise
        except IntegrityError:
            # A queue row removed since we looked its id up: forget the ids, look again.
            self.session.rollback()
            self.__dict__.pop("_queue_ids", None)
            raise

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        """Acknowledge; at the prefetch limit, wake the consumer to take the next message
        (where it is due: what rang while the slots were full stayed due)."""
        full = not self.qos.can_consume()
        super().basic_ack(delivery_tag, multiple=multiple)
        if full:
            self.connection.doorbell.ring(NOTHING_NEW)

    def basic_reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        """Reject; at the prefetch limit, wake the consumer to take the next message."""
        full = not self.qos.can_consume()
        super().basic_reject(delivery_tag, requeue=requeue)
        if full:
            self.connection.doorbell.ring(NOTHING_NEW)

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        """Declare ``queue``: its row looked up or created, and kombu's session's transaction
        ended (kombu's own declare leaves it open: a relay that declared its queue and found
        no work held a transaction open, holding back VACUUM)."""
        self._queue_id(queue)

    def _size(self, queue: str) -> int:
        """The messages waiting on ``queue`` (a declare's count), kombu's session's
        transaction ended after the count (kombu leaves it open). A failed count is rolled
        back and raised as it came (a commit there would hide kombu's connection error)."""
        try:
            count = int(super()._size(queue))
        except BaseException:
            with contextlib.suppress(Exception):  # the connection may be gone already
                self.session.rollback()
            raise
        self.session.commit()
        return count

    def _get_or_create(self, queue: str) -> Any:
        try:
            return super()._get_or_create(queue)
        except IntegrityError:
            # Another process inserted this queue's row between our look and our insert.
            self.session.rollback()
            return super()._get_or_create(queue)


#: The channel class, by a name the transport's own ``Channel`` attribute does not shadow.
_OurChannel = Channel


class Transport(SQLAlchemyTransport):  # type: ignore[misc]
    """kombu's SQLAlchemy transport with :class:`Channel`, sleeping on a doorbell between polls."""

    Channel = Channel
    polling_interval = POLLING_INTERVAL_S

    def __init__(self, client: Any, **kwargs: Any) -> None:
        super().__init__(client, **kwargs)
        self.doorbell = self._new_doorbell()
        # When the queues are next polled unless the doorbell rings first: Celery's loop
        # calls drain_events every 2 s, and a poll per call would cut the interval to that.
        self._next_poll = 0.0
        # Messages taken since the last empty look or sleep (a direct taker's flag goes down
        # at BUSY_AFTER_TAKES), and when the last was taken.
        self._in_a_row = 0
        self._found_at = 0.0

    def _new_doorbell(self) -> Doorbell:
        # A worker taking directly is woken by enqueue's bell as well as by publishes (asked
        # when the doorbell's thread connects: by then the consumers are set up).
        return Doorbell(self.client.hostname, planned=self._takes_directly)

    def _takes_directly(self) -> bool:
        return any(channel.takes_directly() is not None for channel in self._consuming())

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:
        """kombu's loop, sleeping on the doorbell instead of ``time.sleep`` when all is empty.

        Each channel looks only where something may be waiting (``Channel._due``): what rang,
        what its last look found more of, everything once per poll interval.

        A channel taking directly also keeps its idle flag. It goes down (enqueue stops
        ringing) after :data:`BUSY_AFTER_TAKES` messages taken in a row without a look that
        found nothing or a sleep; while it is down nothing rings, so the worker looks every
        :data:`BUSY_POLL_S` itself. It goes up once looks found nothing for
        :data:`BUSY_GRACE_S` (then it looks once more: what was committed while the flag was
        down rang no bell), and stays up while the worker sleeps between rings."""
        start = monotonic()
        while True:
            now = monotonic()
            self._heartbeat()
            # Taken before the poll: a message committed during it still rings.
            rang = self.doorbell.take()
            busy = self._busy()
            if now >= self._next_poll or busy:
                rang = EVERYTHING
                if now >= self._next_poll:
                    self._next_poll = now + self.polling_interval
            self._mark_due(rang)
            until = self._next_poll
            if self._anything_due():
                try:
                    self.cycle.get(self._deliver, timeout=timeout)
                except Empty:
                    self._in_a_row = 0
                    if busy and now - self._found_at < BUSY_GRACE_S:
                        until = min(until, now + BUSY_POLL_S)  # nobody rings: look again soon
                    elif self._announce(idle=True):
                        self._next_poll = 0.0
                        continue
                else:
                    self._found_at = monotonic()
                    self._in_a_row += 1
                    if self._in_a_row >= BUSY_AFTER_TAKES:
                        self._announce(idle=False)
                    return
            elif not self._prefetch_full():
                self._in_a_row = 0  # it sleeps until rung: not busy
            if timeout is not None:
                until = min(until, start + timeout)
                if monotonic() >= start + timeout:
                    raise TimeoutError()
            self.doorbell.wait(max(until - monotonic(), 0.0))

    def _busy(self) -> bool:
        """Whether a channel's idle flag is down: enqueue does not ring it, it polls."""
        return any(c._idle is False for c in self._consuming())

    def _mark_due(self, what: frozenset[str]) -> None:
        if what:
            for channel in self.channels:
                channel.mark_due(what)

    def _anything_due(self) -> bool:
        """Whether a consuming channel has somewhere to look (and a free slot to fill:
        a full one waits for the ring of the ack that frees one)."""
        return any(c._due and c.qos.can_consume() for c in self._consuming())

    def _consuming(self) -> list[_OurChannel]:
        return [channel for channel in self.channels if channel._consumers]

    def _prefetch_full(self) -> bool:
        """Whether no consuming channel may take a message now (a look would find nothing
        whatever is waiting: that is no reason to raise the idle flag)."""
        consuming = self._consuming()
        return bool(consuming) and not any(c.qos.can_consume() for c in consuming)

    def _announce(self, *, idle: bool) -> bool:
        written = False
        for channel in self._consuming():  # every channel's flag, no short cut
            written = channel.announce(idle=idle) or written
        return written

    def _heartbeat(self) -> None:
        for channel in self._consuming():
            channel.heartbeat()

    def close_connection(self, connection: Any) -> None:
        """Close the channels; stop the doorbell's thread (a new one listens on reconnect)."""
        self.doorbell.close()
        self.doorbell = self._new_doorbell()
        super().close_connection(connection)


#: The URL scheme prefix selecting this transport: ``outboxdb+postgresql+psycopg://…``.
ALIAS = "outboxdb"
# kombu picks a transport by the URL's prefix; registering ours makes the URL self-contained.
TRANSPORT_ALIASES[ALIAS] = f"{__name__}:Transport"
