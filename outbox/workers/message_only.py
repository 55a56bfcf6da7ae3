"""Workers that take only the relay's messages say so, so that a relay never makes them wait.

A relay stands by while a worker takes due operations directly (:mod:`outbox.workers.direct`
on the database broker; :mod:`outbox.workers.listening` on RabbitMQ with its flag down): it
claims a row never published only once it has been due ``standby_hold_back_s`` (10 s), so as
not to race the takers for it. A worker that takes nothing directly
(``OUTBOX_BROKER_DIRECT_TAKE=false`` on its host, or a database broker in another database)
gets work only from the relay's messages: in a deployment that mixed both kinds, it waited
those 10 s for every row the takers had not reached.

Such a worker now keeps a row of its own in ``outbox.relays`` (``consumer:`` names, never
idle: enqueue's bell is not for it), written when its consumer starts on a connection kept for
the process's life and refreshed every :data:`HEARTBEAT_S` by a thread of its own. A relay
standing by while one lives claims rows left untaken for ``defer_to_takers_s`` (0.2 s)
instead. Writing the row (and removing it) rings the relays' channel (payload
``sql.relay.CONSUMER_RING``), so that a relay standing by sees the worker come and go within
its poll interval, not at its next look at the flags. As with the takers' flags, the row
counts only while its heartbeat is fresh and the session that wrote it is open: a worker
killed with SIGKILL stops counting when its socket closes. A worker that does not consume the
dispatch queue (``-Q lookup``, say) writes nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import psycopg
from celery import bootsteps
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from outbox import sql
from outbox.backoff import Backoff
from outbox.logs import describe_error
from outbox.workers import listening

log = logging.getLogger(__name__)

#: How often the row's heartbeat is refreshed (a relay counts it while within 30 s).
HEARTBEAT_S = 10.0
#: Between attempts to write the row again after a database error: doubling up to the last.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 10.0


@dataclass(frozen=True, slots=True)
class MessageOnly:
    """A worker that takes only messages: the dispatch queue it consumes and its row's name."""

    queue: str
    name: str


_worker: MessageOnly | None = None


def announce_as(worker: MessageOnly | None) -> None:
    """Make this worker's consumer write its ``consumer:`` row (None: don't)."""
    global _worker  # noqa: PLW0603 -- one per process, set by the starting worker
    _worker = worker


class Announcer:
    """The thread that keeps a message-only worker's row in ``outbox.relays``: written at
    once, refreshed every ``every_s``, written again after a database error (with backoff),
    removed when stopped."""

    def __init__(self, engine: Engine, name: str, *, every_s: float = HEARTBEAT_S) -> None:
        self.engine = engine
        self.name = name
        self.every_s = every_s
        self._stop = threading.Event()
        self._conn: Connection | None = None
        self._thread = threading.Thread(target=self._run, name="outbox-announce", daemon=True)

    def start(self) -> None:
        """Write the row now and keep it fresh until :meth:`stop`."""
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop refreshing and remove the row (best effort: a relay forgets a silent row)."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        backoff = Backoff(base_s=RETRY_FIRST_S, max_s=RETRY_MAX_S)
        wait_s = 0.0
        while not self._stop.wait(wait_s):
            try:
                arriving = self._conn is None  # first write, or again on a new session
                conn = self._connection()
                sql.relay.announce_relay(
                    conn, self.name, pid=os.getpid(), host=socket.gethostname(), idle=False
                )
                if arriving:
                    # A relay standing by looks at the flags only once a heartbeat interval:
                    # the ring makes it look again after its poll and see this worker.
                    sql.relay.ring_relays(conn, why=sql.relay.CONSUMER_RING)
            except (DBAPIError, psycopg.Error, OSError) as exc:
                self._close()
                wait_s = backoff.next_s()
                log.warning(
                    "could not record this worker as taking only messages, again in %.1fs: %s",
                    wait_s,
                    describe_error(exc),
                )
                continue
            backoff.reset()
            wait_s = self.every_s
        self._forget()

    def _connection(self) -> Connection:
        """The connection kept for the process's life (the row names its session)."""
        if self._conn is None:
            self._conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        return self._conn

    def _forget(self) -> None:
        try:
            if self._conn is not None:
                sql.relay.forget_relay(self._conn, self.name)
                sql.relay.ring_relays(self._conn, why=sql.relay.CONSUMER_RING)
        except (DBAPIError, psycopg.Error, OSError) as exc:
            log.warning("could not remove this worker's row: %s", describe_error(exc))
        finally:
            self._close()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except (DBAPIError, psycopg.Error, OSError):
                conn.invalidate()


class Announce(bootsteps.StartStopStep):  # type: ignore[misc]
    """The consumer's step that runs an :class:`Announcer` from the consumer's first start to
    the worker's shutdown (a broker reconnect restarts the consumer, not the row)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.announcer: Announcer | None = None
        super().__init__(c, **kwargs)

    def include_if(self, c: Any) -> bool:
        """Only in a worker that takes nothing directly."""
        return _worker is not None

    def start(self, c: Any) -> None:
        """Start announcing if this worker consumes the dispatch queue (once)."""
        worker = _worker
        if self.announcer is not None or worker is None:
            return
        if not listening.consumes(c, worker.queue):
            return
        self.announcer = Announcer(listening.flag_engine(), worker.name)
        self.announcer.start()

    def stop(self, c: Any) -> None:
        """Nothing: the consumer restarts after a broker reconnect and consumes again."""

    def shutdown(self, c: Any) -> None:
        """Stop announcing and remove the row (the worker stops)."""
        announcer, self.announcer = self.announcer, None
        if announcer is not None:
            announcer.stop()
