"""RabbitMQ workers that take due operations from the outbox themselves (issue 35).

On RabbitMQ an operation's steady path is the relay's hop: the agent's commit wakes the relay,
which claims the row, publishes its message and waits for the broker's confirm, and the broker
delivers it to a worker: four processes wake per operation. A worker with a free thread can
skip the hop, as workers on the database broker do (:mod:`outbox.workers.direct`): it LISTENs
on enqueue's bell beside its AMQP connection (a reader on Celery's event loop, the consumer's
thread), claims the due row with the relay's own statement (``sql.relay.take_due``:
``published_at`` stamped, ``SKIP LOCKED``), and hands the dispatch message the relay would have
published, built by the same ``app.send_task`` but never sent, to Celery's own task handler.
The task runs as any: its lock, its ``sent`` compare-and-set, Flower's events. On a pool that
runs tasks in the worker's process (threads, solo) the take also takes the operation's lock
and reads its row in the same statement, and hands that connection to the task
(:mod:`outbox.workers.handoff`).

A RabbitMQ worker keeps an idle flag (``listening-taker:`` rows in ``outbox.relays``) up
while it waits for work (a pool slot free, no backlog): enqueue rings it, and a relay claims a
row never published only once it has been due ``defer_to_takers_s`` (0.2 s, decided inside its
claim statement), so a waiting worker takes it first; the relay does not hear enqueue's bell
meanwhile (the workers do), it looks for what they left every 0.2 s. The flag goes down when
the last slot fills, through a backlog (takes that keep leaving more due) and through a stream
(many takes within a short window: enqueue's bell then costs the agents more than the take
saves), and the worker rings the relays' own channel (``outbox_relay``).

While the flag is down the worker carries the backlog as the database broker's workers do
(issue 35: flat out, the relay's hop and the broker's cost a third of the machine): it takes
whenever a slot is free, up to ``ops_per_message`` operations in one message, woken by its own
tasks settling (their ack reaches :class:`NoBroker`, which tells the loop) and looking every
:data:`BUSY_CHECK_S` for slots that messages from the broker held; a relay that sees a flag
down stands by as for a database broker's taker (it claims only rows left untaken
``standby_hold_back_s``, 10 s; 0.2 s while a worker that takes only messages lives,
:mod:`outbox.workers.message_only`). The flag
goes up again once a take finds nothing and none found any for :data:`BUSY_GRACE_S`.

Crash safety is the database broker's: a row stamped by a worker that died before its task ran
is claimed again ``OUTBOX_REPUBLISH_AFTER`` later, like a row whose message was lost; a task's
ack and reject reach a channel of nothing (no broker holds the message). A lost database
connection is opened again with backoff while the worker goes on with RabbitMQ's messages.

``OUTBOX_BROKER_DIRECT_TAKE=false`` turns it off, as on the database broker.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from time import monotonic
from typing import Any, Protocol

import psycopg
from celery import bootsteps
from celery.worker import state
from kombu.message import Message
from kombu.serialization import dumps
from sqlalchemy import Connection, Engine, create_engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from outbox import sql
from outbox.backoff import Backoff
from outbox.logs import describe_error

log = logging.getLogger(__name__)

#: How often an idle worker's flag heartbeat is refreshed (relays forget silent flags).
HEARTBEAT_S = 10.0
#: How often an idle worker looks for due operations no commit rang for (and at the heartbeat).
TICK_S = 1.0
#: While its flag is down (every slot busy, a stream or a backlog), a worker looks this often
#: whether a slot is free (its own tasks' settling wakes it at once; a message from the broker
#: does not): then it takes, and raises the flag once the backlog is gone.
BUSY_CHECK_S = 0.05
#: Takes in a row that each left more due that make a backlog: the flag goes down and the
#: worker takes as its slots free, several operations per message.
BACKLOG_AFTER_TAKES = 4
#: This many takes within BUSY_WINDOW_S (160 a second, one worker) make a stream (flat out:
#: enqueue's ring, a NOTIFY that serialises every agent's commit, costs more than the take
#: saves): the flag goes down as for a backlog...
BUSY_AFTER_TAKES = 16
BUSY_WINDOW_S = 0.1
#: ...and up again only once looks found nothing for this long.
BUSY_GRACE_S = 0.05
#: Between attempts to open a lost database connection again: doubling up to the last.
RECONNECT_FIRST_S = 0.1
RECONNECT_MAX_S = 5.0


class Source(Protocol):
    """Due operations taken as dispatch messages (:class:`outbox.workers.direct.DirectDispatch`)."""

    #: This deployment's dispatch queue (the worker takes only if it consumes it).
    queue: str
    #: The worker's name in ``outbox.relays`` (``listening-taker:host:pid:random``).
    name: str

    def take(self, conn: Connection, channel: Any, *, batch: bool, keeping_up: bool) -> Any:
        """Claim the next due operation on ``conn``: a ``DirectTake`` (message, more)."""
        ...

    def announce(self, conn: Connection, *, idle: bool) -> None:
        """Write this worker's idle flag and heartbeat."""
        ...

    def forget(self, conn: Connection) -> None:
        """Remove this worker's flag."""
        ...


class NoBroker:
    """The channel of a message no broker holds: a task's ack or reject is a no-op (an ack of
    an unknown delivery tag on the AMQP channel would close it), but says the task settled
    (its pool slot is free: :meth:`Loop.settled`), if told whom to tell."""

    no_ack_consumers = None

    def __init__(self, settled: Callable[[], None] | None = None) -> None:
        self._settled = settled

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        """Nothing to acknowledge; the task's slot is free."""
        if self._settled is not None:
            self._settled()

    def basic_reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        """Nothing to give back (the row is claimed again after ``OUTBOX_REPUBLISH_AFTER``);
        the task's slot is free."""
        if self._settled is not None:
            self._settled()


NO_BROKER = NoBroker()


class Capture:
    """A producer for ``app.send_task`` that keeps the message it would publish to one queue,
    as a kombu :class:`~kombu.message.Message` a consumer would receive (the take's message);
    any other publish (Celery's ``task-sent`` event) goes to ``forward``, if given."""

    def __init__(
        self, forward: Callable[..., Any] | None = None, *, channel: NoBroker = NO_BROKER
    ) -> None:
        self._forward = forward
        #: What the captured messages' tasks acknowledge to.
        self._channel = channel
        self._queue: str | None = None
        self._captured: list[Message] | None = None
        self._tags = itertools.count(1)

    @property
    def connection(self) -> Capture:
        """What ``send_task`` reraises library errors through: nothing is sent."""
        return self

    @contextlib.contextmanager
    def _reraise_as_library_errors(self) -> Iterator[None]:
        yield

    def producer(self, app: Any) -> Capture:
        """This object, the producer :class:`outbox.workers.direct.DirectDispatch` sends with."""
        return self

    @contextlib.contextmanager
    def capture(self, queue: str) -> Iterator[list[Message]]:
        """Messages published to ``queue`` inside are collected, not sent."""
        captured: list[Message] = []
        self._queue, self._captured = queue, captured
        try:
            yield captured
        finally:
            self._queue = self._captured = None

    def publish(
        self,
        body: Any,
        *,
        routing_key: str | None = None,
        exchange: Any = None,
        serializer: str | None = None,
        headers: dict[str, Any] | None = None,
        **options: Any,
    ) -> None:
        """Keep a message to the captured queue; pass anything else on."""
        if self._captured is None or routing_key != self._queue:
            if self._forward is not None:
                self._forward(body, routing_key=routing_key, exchange=exchange, **options)
            return
        content_type, content_encoding, data = dumps(body, serializer=serializer)
        # What a publish would make message properties of (correlation_id, reply_to, ...);
        # kombu's publish options are not.
        properties = {k: v for k, v in options.items() if k not in _PUBLISH_OPTIONS}
        self._captured.append(
            Message(
                body=data,
                delivery_tag=next(self._tags),
                content_type=content_type,
                content_encoding=content_encoding,
                delivery_info={
                    "exchange": getattr(exchange, "name", exchange) or "",
                    "routing_key": routing_key,
                    "redelivered": False,
                },
                properties=properties,
                headers=headers,
                channel=self._channel,
            )
        )


#: ``send_task_message``'s keyword arguments to ``publish`` that are not message properties.
_PUBLISH_OPTIONS = frozenset(
    {
        "retry",
        "retry_policy",
        "declare",
        "compression",
        "timeout",
        "confirm_timeout",
        "mandatory",
        "immediate",
    }
)


@dataclass
class ListeningTaker:
    """One worker's takes: the LISTEN connection, the idle flag, the take loop.

    Every method runs on Celery's event loop (the consumer's thread): :meth:`open` gives the
    socket to watch, :meth:`on_readable` takes while a bell rang and a slot is free,
    :meth:`tick` refreshes the heartbeat and raises the flag when a slot frees."""

    direct: Source
    #: Celery's task handler: a message given to it runs as one RabbitMQ delivered.
    deliver: Callable[[Message], None]
    #: Whether the pool has a free slot now.
    has_free_slot: Callable[[], bool]
    #: Where the LISTEN connection comes from (its own: held for the worker's life).
    engine: Engine
    capture: Capture = field(default_factory=Capture)
    _conn: Connection | None = field(default=None, repr=False)
    #: The flag as last written (None: not written on this connection).
    _idle: bool | None = None
    _announced_at: float = 0.0
    #: When the last takes that found an operation were made (the stream's measure).
    _recent: deque[float] = field(
        default_factory=lambda: deque([0.0], maxlen=BUSY_AFTER_TAKES), repr=False
    )

    @property
    def listening(self) -> bool:
        """Whether the connection is open (and LISTENs)."""
        return self._conn is not None

    @property
    def idle(self) -> bool | None:
        """The flag as last written (None: not yet)."""
        return self._idle

    def open(self) -> int:
        """Connect and LISTEN on enqueue's bell; the socket to watch. Takes what is due."""
        conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            # The flag and the takes' stamps are advice: their commits need not wait for disk.
            sql.notify.listen_planned(conn)
        except BaseException:
            conn.invalidate()
            conn.close()
            raise
        self._conn, self._idle = conn, None
        fd = self._listener().fileno()
        # What was committed before this LISTEN rang nobody: look now.
        self._take_while_free(rang=True)
        return fd

    def on_readable(self) -> None:
        """The socket has something: drain the bells, take while they rang and a slot is free
        (flag down: the bells are not needed, the takes go on through :meth:`drain`)."""
        if self._conn is None:
            return
        rang = self._drained()
        if self._idle is not False:
            self._take_while_free(rang=rang)
        self.drain()

    def tick(self) -> None:
        """Look for due operations if a slot is free: no commit rings for a row whose backoff
        ended or whose message was lost (a stamped row whose worker died,
        ``OUTBOX_REPUBLISH_AFTER`` later), nor while the flag is down. Then refresh the flag's
        heartbeat if due."""
        if self._conn is None:
            return
        if self._idle is False:
            self.drain()
        elif self.has_free_slot():
            self._take_while_free(rang=True)
        if self._idle is not None and monotonic() - self._announced_at >= HEARTBEAT_S:
            self._announce(idle=self._idle)

    def drain(self) -> None:
        """While the flag is down (a backlog, a stream, every slot was full), take while a slot
        is free, up to ``ops_per_message`` operations per message: the relay stands by, and the
        workers carry the backlog as the database broker's do, without the relay's hop and
        the broker's. The flag goes up again once a take finds nothing and none found any
        within :data:`BUSY_GRACE_S` (then what was committed meanwhile is taken at once)."""
        if self._conn is None or self._idle is not False:
            return
        while self.has_free_slot():
            found, more = self._take_one(batch=True)
            if found and more:
                continue
            if not found and monotonic() - self._recent[-1] >= BUSY_GRACE_S:
                # Up first, then look: a row committed after the last take rang nobody.
                self._announce(idle=True)
                self._take_while_free(rang=True)
            return

    def close(self) -> None:
        """Remove the flag (best effort: relays forget silent ones) and the connection."""
        conn, self._conn, self._idle = self._conn, None, None
        if conn is None:
            return
        with contextlib.suppress(Exception):
            self.direct.forget(conn)
        with contextlib.suppress(Exception):
            conn.close()

    def discard(self) -> None:
        """Drop a broken connection (its flag is left to go silent)."""
        conn, self._conn, self._idle = self._conn, None, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.invalidate()
                conn.close()

    def _take_while_free(self, *, rang: bool) -> None:
        """Take while a bell rang, a slot is free and no backlog or stream shows; the flag
        goes up once a take left nothing due with a slot free (the worker waits for work),
        after a stream only once :data:`BUSY_GRACE_S` passed without finding any."""
        while rang:
            streak = 0
            while True:
                if not self.has_free_slot():
                    self._go_busy()
                    return
                found, more = self._take_one()
                if not found:
                    break
                streak = streak + 1 if more else 0
                if self._idle is False or self._streaming() or streak >= BACKLOG_AFTER_TAKES:
                    # A stream or a backlog: the relay's batches and the broker spread it
                    # over every worker, and enqueue stops ringing (a NOTIFY serialises
                    # every agent's commit).
                    self._go_busy()
                    return
                if not more:
                    break
            if self._idle is not True and (
                self._idle is None or monotonic() - self._recent[-1] >= BUSY_GRACE_S
            ):
                self._announce(idle=True)
            # Bells heard while the takes ran wait in psycopg's backlog, not on the socket.
            rang = self._drained()

    def _streaming(self) -> bool:
        """Whether the last :data:`BUSY_AFTER_TAKES` takes came within :data:`BUSY_WINDOW_S`."""
        recent = self._recent
        window = BUSY_WINDOW_S
        return len(recent) == recent.maxlen and recent[-1] - recent[0] <= window

    def _take_one(self, *, batch: bool = False) -> tuple[bool, bool]:
        """Take one due operation (``batch``: up to ``ops_per_message``, one message) and
        deliver its message: whether one was found, and whether more is due."""
        taken = self.direct.take(
            self._connection(), self.capture, batch=batch, keeping_up=not batch
        )
        if taken.message is None:
            return False, False
        self._recent.append(monotonic())
        self.deliver(taken.message)
        return True, bool(taken.more)

    def _go_busy(self) -> None:
        """A backlog, a stream, or every slot taken: lower the flag (enqueue stops ringing)
        and ring the relays' own bell (one that left fresh rows to waiting workers looks
        again at once, sees a worker that carries the backlog and stands by); the takes go on
        through :meth:`drain` as slots free."""
        if self._idle is not False:
            self._announce(idle=False)
            sql.relay.ring_relays(self._connection())

    def _announce(self, *, idle: bool) -> None:
        self.direct.announce(self._connection(), idle=idle)
        self._idle, self._announced_at = idle, monotonic()

    def _connection(self) -> Connection:
        if self._conn is None:
            raise RuntimeError("the direct take's connection is closed")
        return self._conn

    def _listener(self) -> psycopg.Connection[Any]:
        driver = self._connection().connection.driver_connection
        if not isinstance(driver, psycopg.Connection):
            raise TypeError(f"the direct take needs psycopg, not {type(driver).__name__}")
        return driver

    def _drained(self) -> bool:
        rang = False
        for _ in self._listener().notifies(timeout=0.0):
            rang = True
        return rang


@dataclass
class Loop:
    """A :class:`ListeningTaker` on Celery's event loop (a kombu ``Hub``): its socket watched,
    its ticks on the hub's timer, its connection opened again with backoff when lost, and a
    word from the pool's threads when a taken message's task settled (:meth:`settled`)."""

    taker: ListeningTaker
    hub: Any
    _fd: int | None = None
    _timers: list[Any] = field(default_factory=list)
    #: The pending look for a freed slot while the flag is down (None: none pending).
    _busy_check: Any = None
    _backoff: Backoff = field(
        default_factory=lambda: Backoff(base_s=RECONNECT_FIRST_S, max_s=RECONNECT_MAX_S)
    )
    _stopped: bool = False
    #: The socket pair a pool thread writes to when a taken message's task settled: a
    #: byte on a socket the loop watches, so that nothing depends on whether the installed
    #: kombu's ``call_soon`` may be called from another thread.
    _waker: tuple[socket.socket, socket.socket] | None = None

    def start(self) -> None:
        """Open the connection (or schedule it), the ticks and the settled tasks' word."""
        self._timers.append(self.hub.call_repeatedly(TICK_S, self._guarded(self.tick)))
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        self._waker = (reader, writer)
        self.hub.add_reader(reader.fileno(), self._on_settled)
        self._connect()

    def settled(self) -> None:
        """A taken message's task settled, its slot free (called on the pool's thread): while
        the flag is down, wake the loop to take for that slot at once (while it is up, a
        free slot waits for a bell)."""
        waker = self._waker
        if waker is not None and self.taker.idle is False:
            with contextlib.suppress(OSError):  # the buffer full: a word already waits
                waker[1].send(b"\0")

    def _on_settled(self) -> None:
        waker = self._waker
        if waker is not None:
            with contextlib.suppress(OSError):
                waker[0].recv(4096)
        self._guarded(self._drain)()

    def _drain(self) -> None:
        if self.taker.listening:
            self.taker.drain()
        self._watch_busy()

    def tick(self) -> None:
        """The taker's tick (nothing while the connection is lost: its reconnect is on the
        timer); then, while every slot is busy, a look for a freed one soon."""
        if self.taker.listening:
            self.taker.tick()
        self._watch_busy()

    def _watch_busy(self) -> None:
        """While the flag is down, tick again in :data:`BUSY_CHECK_S` (an idle worker's loop
        wakes only for its socket and the heartbeat)."""
        if self._busy_check is None and self.taker.idle is False and not self._stopped:

            def check() -> None:
                self._busy_check = None
                self.tick()

            self._busy_check = self.hub.call_later(BUSY_CHECK_S, self._guarded(check))

    def _connect(self) -> None:
        if self._stopped:
            return
        try:
            fd = self.taker.open()
        except (DBAPIError, psycopg.Error, OSError) as exc:
            self.taker.discard()
            self._retry_later(exc)
            return
        self._backoff.reset()
        self._fd = fd
        self.hub.add_reader(fd, self._guarded(self._on_readable))
        self._watch_busy()
        log.info("taking due operations directly from the outbox while threads are free")

    def _on_readable(self) -> None:
        self.taker.on_readable()
        self._watch_busy()

    def _retry_later(self, exc: BaseException) -> None:
        wait_s = self._backoff.next_s()
        log.warning(
            "direct take stopped, starting again in %.1fs: %s",
            wait_s,
            describe_error(exc),
        )
        self._timers.append(self.hub.call_later(wait_s, self._connect))

    def _guarded(self, step: Callable[[], None]) -> Callable[[], None]:
        """``step``, a database failure turning into a reconnect instead of stopping the loop."""

        def guarded() -> None:
            try:
                step()
            except Exception as exc:  # nothing may stop the consumer's loop
                if not isinstance(exc, DBAPIError | psycopg.Error | OSError):
                    log.exception("direct take failed, starting it again")
                self._drop_reader()
                self.taker.discard()
                self._retry_later(exc)

        return guarded

    def _drop_reader(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(Exception):
                self.hub.remove_reader(fd)

    def stop(self) -> None:
        """Stop watching, cancel the ticks, remove the flag and the connection."""
        self._stopped = True
        self._drop_reader()
        timers, self._timers = self._timers, []
        if self._busy_check is not None:
            timers.append(self._busy_check)
            self._busy_check = None
        for timer in timers:
            with contextlib.suppress(Exception):
                timer.cancel()
        waker, self._waker = self._waker, None
        if waker is not None:
            with contextlib.suppress(Exception):
                self.hub.remove_reader(waker[0].fileno())
            for end in waker:
                end.close()
        self.taker.close()


#: This process's source of takes (None: no RabbitMQ worker takes directly); set by
#: :mod:`outbox.workers.direct`'s start-up handler.
_source: Source | None = None


def take_directly(source: Source | None) -> None:
    """Make this worker's consumer take due operations through ``source`` (None: don't)."""
    global _source  # noqa: PLW0603 -- one per process, set by the starting worker
    _source = source


def free_slot(pool: Any) -> Callable[[], bool]:
    """Whether ``pool`` has a slot no request holds (received and not finished)."""
    limit = int(pool.num_processes)
    return lambda: len(state.reserved_requests) < limit


class TakeDirectly(bootsteps.StartStopStep):  # type: ignore[misc]
    """The consumer's step that runs a :class:`Loop` while the consumer's event loop runs
    (started again after a broker reconnect, with the task handler of the new loop)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.loop: Loop | None = None
        super().__init__(c, **kwargs)

    def include_if(self, c: Any) -> bool:
        """Only in a worker that takes directly, with an event loop (any AMQP worker)."""
        return _source is not None and getattr(c, "hub", None) is not None

    def register_with_event_loop(self, c: Any, hub: Any) -> None:
        """Start taking on ``hub`` (the consumer's loop just started)."""
        source = _source
        self.stop(c)
        if source is None or not consumes(c, source.queue):
            return
        events = getattr(c, "event_dispatcher", None)
        taker = ListeningTaker(
            source,
            deliver=c.create_task_handler(),
            has_free_slot=free_slot(c.pool),
            engine=flag_engine(),
            capture=Capture(forward=task_sent_forwarder(events), channel=NoBroker(self._settled)),
        )
        self.loop = Loop(taker, hub)
        self.loop.start()

    def _settled(self) -> None:
        """A taken message's ack or reject (a pool thread): the word to the running loop."""
        loop = self.loop
        if loop is not None:
            loop.settled()

    def stop(self, c: Any) -> None:
        """Stop taking (the consumer stops, or restarts after a broker reconnect)."""
        loop, self.loop = self.loop, None
        if loop is not None:
            loop.stop()

    def shutdown(self, c: Any) -> None:
        """Stop taking (the worker stops)."""
        self.stop(c)


def consumes(c: Any, queue: str) -> bool:
    """Whether consumer ``c`` consumes ``queue`` (a worker of other queues takes nothing)."""
    consumer = getattr(c, "task_consumer", None)
    return consumer is not None and any(q.name == queue for q in consumer.queues)


#: What Celery's event dispatcher adds to every event it builds (not the task's own fields).
_SENDER_FIELDS = frozenset({"type", "timestamp", "hostname", "utcoffset", "pid", "clock"})


def task_sent_forwarder(events: Any) -> Callable[..., Any] | None:
    """Celery's ``task-sent`` event of a taken message, sent as the relay's publish would."""
    if events is None or not getattr(events, "enabled", False):
        return None

    def forward(body: Any, **_: Any) -> None:
        if isinstance(body, dict) and body.get("type") == "task-sent":
            # The event as built for the producer; the worker's dispatcher adds its own
            # sender fields and clock.
            fields = {k: v for k, v in body.items() if k not in _SENDER_FIELDS}
            try:
                events.send("task-sent", **fields)
            except Exception as exc:  # noqa: BLE001 -- an event is never worth a take
                log.warning("task-sent event not sent: %s", describe_error(exc))

    return forward


_engines: dict[str, Engine] = {}


def flag_engine() -> Engine:
    """The engine of a worker's LISTEN and flag connections: its own (no pool, nothing a fork
    could share)."""
    from outbox.config import get_settings  # noqa: PLC0415 -- read when the worker starts
    from outbox.db import database_url  # noqa: PLC0415

    url = database_url(get_settings())
    if url not in _engines:
        _engines[url] = create_engine(url, poolclass=NullPool, hide_parameters=True)
    return _engines[url]
