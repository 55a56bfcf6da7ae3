"""Workers that take due operations from the outbox themselves (change 38, issue 35).

On the database broker in the outbox's own database, a message is a row the relay writes in
its claim's transaction and a worker deletes again: two hops, each a wake-up and a commit,
between the agent's commit and the dispatch. Here the worker skips them: the channel that
consumes this deployment's dispatch queue claims a due ``planned`` operation with the relay's
own statement (``sql.relay.take_due``: ``claim_and_mark_due`` for one row, ``SKIP LOCKED``,
``published_at`` stamped in the same autocommit statement, looking one row further to know
whether more is due) and delivers the dispatch message the relay would
have published for it, built by the same code (``publish.send_dispatch``) but never stored.

Nothing else changes. The dispatch task takes the operation's lock and makes its
compare-and-set as for any message (or adopts the lock the take handed it, the row already moved to
``sent`` for a tool without guards: :mod:`outbox.workers.handoff`); a stamped row whose
worker died before dispatching it is claimed again ``OUTBOX_REPUBLISH_AFTER`` later, by a
worker or a relay, exactly like a row whose message was lost (the database broker never
redelivers either). Such a worker keeps an idle flag in ``outbox.relays`` (``taker:``
rows), so that enqueue rings its bell while it waits, and a relay that sees a live one
stands by (:class:`outbox.relay.Relay`): it claims only rows left untaken for a while.

``OUTBOX_BROKER_DIRECT_TAKE=false`` turns it off (every operation through the relay's
message, as before).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from celery import Celery, concurrency
from celery.concurrency import solo, thread
from celery.signals import worker_init, worker_shutdown
from sqlalchemy import Connection, Engine, make_url

from outbox import faults, sql, tracing, transitions
from outbox.config import Settings, get_settings
from outbox.db import database_url
from outbox.relay import OutboundMessage
from outbox.tools import REGISTRY
from outbox.tools.registry import ToolRegistry
from outbox.workers import dbbroker, dispatch, handoff, listening, message_only, runtime
from outbox.workers.app import broker_url, uses_database_broker
from outbox.workers.dbbroker import DirectTake
from outbox.workers.locking import Found, SentAtLock, discard
from outbox.workers.publish import same_database, send_dispatch

log = logging.getLogger(__name__)

#: Set in a pooled connection's ``info`` once its session's ``synchronous_commit`` was set on
#: (the set stays with the session; the pool's reset does not undo it).
_DURABLE_INFO = "outbox.synchronous_commit_on"


def taker_name(prefix: str = sql.relay.TAKER_PREFIX) -> str:
    """A worker's name in ``outbox.relays``: ``prefix`` then ``host:pid:random``
    (``taker:`` on the database broker, ``listening-taker:`` on another broker)."""
    return f"{prefix}{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Capturing(Protocol):
    """Where a take's message is built: a producer whose publishes to the queue named in
    :meth:`capture` are collected as a consumer would receive them, not sent
    (:class:`outbox.workers.dbbroker.Channel`, :class:`outbox.workers.listening.Capture`)."""

    def producer(self, app: Celery) -> Any:
        """The producer ``app.send_task`` publishes the take's message with."""
        ...

    def capture(self, queue: str) -> AbstractContextManager[list[Any]]:
        """Inside: messages published to ``queue`` are collected in the list, not sent."""
        ...


@dataclass
class DirectDispatch:
    """A :class:`outbox.workers.dbbroker.DirectSource`: due operations as dispatch messages."""

    app: Celery
    #: This deployment's dispatch queue (its name on the broker).
    queue: str
    #: A stamped row still ``planned`` after this is claimed again (its worker died).
    republish_after_s: float
    #: Operations one message may name, taken at once through a backlog.
    ops_per_message: int = 1
    name: str = field(default_factory=taker_name)
    #: The engine whose connections are handed to this process's tasks (theirs).
    engine: Callable[[], Engine] = field(default=runtime.engine, repr=False)
    #: The tools this process's tasks send (for the take that moves to `sent` itself).
    registry: ToolRegistry = field(default=REGISTRY, repr=False)
    #: A take that locks also moves the operation to `sent` when every check the database
    #: can hold passes (as ``DispatchConfig.send_at_lock`` for a task's own lock step).
    send_at_take: bool = True

    def take(
        self, conn: Connection, channel: Capturing, *, batch: bool, keeping_up: bool
    ) -> DirectTake:
        """Claim the next due operation on ``conn`` (autocommit: the stamps commit here; with
        ``batch``, up to :attr:`ops_per_message` of them): their dispatch message as
        ``channel`` would deliver it (None if none is due), and whether more is due.

        When this process runs its tasks itself (:mod:`outbox.workers.handoff`) and the
        worker is ``keeping_up``, the operation is claimed on a connection of the workers'
        engine instead, its lock taken and its row read in the same statement, and that
        connection is left for the task: the attempt starts sooner. Through a backlog the
        take stays the consumer's cheapest (its thread takes every message of the worker)."""
        handoffs = handoff.active()
        if handoffs is not None:
            handoffs.reap()
        if handoffs is not None and keeping_up and not batch and handoffs.has_room():
            taken = self._take_and_lock(handoffs)
        else:
            taken = sql.relay.take_due(
                conn,
                limit=self.ops_per_message if batch else 1,
                republish_after_s=self.republish_after_s,
            )
        claimed = taken.claimed
        if not claimed:
            return DirectTake(None)
        try:
            faults.point("direct_after_take")
            messages = [OutboundMessage(c.id, c.tool, c.target) for c in claimed]
            # The PRODUCER span the relay would have started, in the agent's trace.
            with tracing.publish_spans(claimed) as spans, channel.capture(self.queue) as captured:
                send_dispatch(self.app, channel.producer(self.app), messages)
                spans.confirmed({c.id for c in claimed})
        except BaseException:
            if handoffs is not None:  # no message: no task will adopt its lock
                handoffs.release([c.id for c in claimed])
            raise
        [message] = captured
        return DirectTake(message, more=taken.more)

    def _take_and_lock(self, handoffs: handoff.Handoffs) -> sql.relay.DueTake:
        """One due operation claimed, locked and read in one statement on a connection of
        the workers' engine, that connection handed over if the lock was taken.

        For a tool this worker may send without guards (:func:`dispatch.send_terms`), the
        same statement moves it to `sent` once the lock is held, committed durably: the task
        that adopts the connection goes straight to the call. The send deadline runs from
        that statement's start."""
        conn = self.engine().connect()
        terms = dispatch.send_terms(self.registry) if self.send_at_take else None
        try:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            if not conn.info.get(_DURABLE_INFO):
                # The attempt's commits on it must wait for the disk, whatever the server's
                # or role's default; a take's own does not when it moves nothing (flush=False).
                sql.locks.set_synchronous_commit(conn)
                conn.info[_DURABLE_INFO] = True
            started = time.monotonic()
            if terms is not None:
                taken = transitions.take_and_mark_sent(
                    conn, republish_after_s=self.republish_after_s, terms=terms
                )
            else:
                taken = sql.relay.take_due(
                    conn, limit=1, republish_after_s=self.republish_after_s, flush=False, lock=True
                )
            conn.commit()  # SQLAlchemy's own marker (autocommit: nothing is sent)
            if taken.locked:
                faults.point("lock_granted")
            if taken.sent and not taken.locked and taken.found is not None:
                # Moved under a lock key that is not the operation's: no other dispatcher
                # would see it held. Nothing was sent; a person looks at the row.
                dispatch.escalate_never_sent(
                    conn, taken.found.operation, "the row's stored lock key is not its own"
                )
        except BaseException:
            discard(conn)  # the lock may have been granted before the failure
            raise
        if taken.locked:
            found: Found = taken.found
            if taken.sent and taken.found is not None:
                found = SentAtLock(taken.found.operation, started)
            handoffs.give(taken.claimed[0].id, conn, found)
        else:
            conn.close()  # no lock held: back to the pool as it came
        return taken

    def announce(self, conn: Connection, *, idle: bool) -> None:
        """Write this worker's idle flag and heartbeat (``outbox.relays``); release the
        handed locks no task adopted in time (an idle worker takes nothing that would)."""
        handoffs = handoff.active()
        if handoffs is not None:
            handoffs.reap()
        host = socket.gethostname()
        sql.relay.announce_relay(conn, self.name, pid=os.getpid(), host=host, idle=idle)

    def forget(self, conn: Connection) -> None:
        """Remove this worker's row (it stops taking)."""
        sql.relay.forget_relay(conn, self.name)


def applies(settings: Settings) -> bool:
    """Whether workers take directly with ``settings``: the database broker, in the outbox's
    own database, and ``OUTBOX_BROKER_DIRECT_TAKE`` on."""
    if not settings.broker_direct_take:
        return False
    url = broker_url(settings)
    return uses_database_broker(url) and same_database(make_url(database_url(settings)), url)


def applies_listening(settings: Settings) -> bool:
    """Whether workers on a broker other than the database (RabbitMQ) take directly while
    they wait for work (:mod:`outbox.workers.listening`): ``OUTBOX_BROKER_DIRECT_TAKE`` on."""
    return settings.broker_direct_take and not uses_database_broker(broker_url(settings))


def dispatch_queue(app: Celery) -> str:
    """The broker name of ``app``'s dispatch queue (``outbox.<deployment>.dispatch``)."""
    for queue in app.conf.task_queues:
        if queue.alias == "dispatch":
            return str(queue.name)
    raise LookupError("the app has no dispatch queue")


def runs_tasks_in_process(pool: Any) -> bool:
    """Whether Celery's ``pool`` (a class or its name) runs tasks in the worker's own
    process (threads, solo), where a task can adopt a connection its take handed over."""
    implementation = concurrency.get_implementation(pool)
    return isinstance(implementation, type) and issubclass(
        implementation, solo.TaskPool | thread.TaskPool
    )


@worker_init.connect  # type: ignore[untyped-decorator]
def _take_directly(sender: Any = None, **_: object) -> None:
    if sender is None or not hasattr(sender, "app"):
        return  # the signal sent by hand (tests), not by a starting worker
    settings = get_settings()
    app = sender.app
    database_broker, other_broker = applies(settings), applies_listening(settings)
    dbbroker.take_directly(None)
    listening.take_directly(None)
    message_only.announce_as(None)
    in_process = runs_tasks_in_process(sender.pool_cls)
    handoff.start(handoff.Handoffs() if in_process and (database_broker or other_broker) else None)
    if database_broker:
        dbbroker.take_directly(
            DirectDispatch(
                app,
                dispatch_queue(app),
                settings.republish_after,
                ops_per_message=settings.ops_per_message,
            )
        )
        log.info(
            "taking due operations directly from the outbox (database broker)%s",
            ", their locks handed to this process's tasks" if in_process else "",
        )
    elif other_broker:
        listening.take_directly(
            DirectDispatch(
                app,
                dispatch_queue(app),
                settings.republish_after,
                ops_per_message=settings.ops_per_message,
                name=taker_name(sql.relay.LISTENING_TAKER_PREFIX),
            )
        )
        # Run by the worker's consumer on its event loop (added before the consumer is built).
        app.steps["consumer"].add(listening.TakeDirectly)
    else:
        # It takes only the relay's messages: a relay standing by for takers must not make
        # it wait (outbox.workers.message_only).
        message_only.announce_as(
            message_only.MessageOnly(dispatch_queue(app), taker_name(sql.relay.CONSUMER_PREFIX))
        )
        app.steps["consumer"].add(message_only.Announce)


@worker_shutdown.connect  # type: ignore[untyped-decorator]
def _stop_handing(**_: object) -> None:
    handoff.start(None)  # release the locks no task adopted
