"""Wake-ups for the database broker: a publish NOTIFYs, a waiting consumer LISTENs.

kombu's SQLAlchemy transport finds messages only by polling its queues; polled every 0.1 s,
an idle worker cost a tenth of a core and more (issue 33). Instead, every publish to the
database broker runs ``pg_notify(BROKER_CHANNEL, queue)`` in the statement that writes its
messages (``outbox.sql.broker.insert_messages``: PostgreSQL delivers the notification at
commit, so a woken consumer finds the row), and each consuming process holds one
:class:`Doorbell`: a thread sleeping on ``LISTEN`` that rings a :class:`threading.Event` the
consumer waits on between polls. The consumer still polls, every
``OUTBOX_BROKER_POLL_INTERVAL``, for what a notification cannot carry: a message published
while the listening connection was being opened again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable

import psycopg
from sqlalchemy.engine import make_url

from outbox.sql import notify as notify_sql

log = logging.getLogger(__name__)

#: The NOTIFY channel of the database broker's publishes; the payload is the queue's name.
BROKER_CHANNEL = notify_sql.BROKER_CHANNEL

# Between attempts to open a lost listening connection again: doubling from the first.
_RECONNECT_FIRST_S = 0.05
_RECONNECT_MAX_S = 2.0

#: What a ring says may be waiting: a message (a publish's NOTIFY) or a due operation
#: (enqueue's). A ring of no NOTIFY (a slot freed, a connection (re)opened) says both.
MESSAGES = "messages"
PLANNED = "planned"
EVERYTHING: frozenset[str] = frozenset({MESSAGES, PLANNED})
#: A ring that only wakes the waiter (a prefetch slot freed: look where it was already due).
NOTHING_NEW: frozenset[str] = frozenset()

# How long the listening thread blocks on its connection before it looks whether it was
# closed: a wake-up of a thread, not a statement.
_LISTEN_TICK_S = 5.0


def libpq_url(url: str) -> str:
    """A SQLAlchemy PostgreSQL URL (``postgresql+psycopg://…``) as psycopg connects to it."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


_WHAT_RANG = {
    notify_sql.BROKER_CHANNEL: frozenset({MESSAGES}),
    notify_sql.PLANNED_CHANNEL: frozenset({PLANNED}),
}


class Doorbell:
    """An event rung by every NOTIFY on :data:`BROKER_CHANNEL` (and by :meth:`ring`; while
    ``planned()``, on enqueue's :data:`~outbox.sql.notify.PLANNED_CHANNEL` too).

    The listening thread starts with the first :meth:`wait`; it is a daemon, so a process
    that never calls :meth:`close` still exits. While its connection is lost it rings the
    bell (waiters poll instead) and opens it again with backoff.
    """

    def __init__(self, url: str, *, planned: Callable[[], bool] = lambda: False) -> None:
        self._url = libpq_url(url)
        # Also rung by enqueue's bell (PLANNED_CHANNEL) if ``planned()`` says so when the
        # thread (re)connects: a worker that takes due operations itself
        # (outbox.workers.direct), known once its consumers are set up.
        self._planned = planned
        self._event = threading.Event()
        # What rang since the last take(): the consumer looks only there (a worker woken by
        # enqueue's bell need not look at the message table too).
        self._rang: set[str] = set()
        self._rang_lock = threading.Lock()
        self._closed = threading.Event()
        self._listening = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def ring(self, what: Iterable[str] = EVERYTHING) -> None:
        """Wake the waiter now (a slot freed, a notification came), saying ``what`` may be
        waiting (:data:`MESSAGES`, :data:`PLANNED`; by default both)."""
        with self._rang_lock:
            self._rang.update(what)
            self._event.set()

    def rung(self) -> bool:
        """Whether it was rung since the last :meth:`clear` or :meth:`take`."""
        return self._event.is_set()

    def clear(self) -> None:
        """Forget earlier rings: call before polling, so a ring during the poll still wakes."""
        self.take()

    def take(self) -> frozenset[str]:
        """What rang since the last take (empty if nothing), forgotten: call before polling,
        so a ring during the poll still wakes."""
        with self._rang_lock:
            self._event.clear()
            rang, self._rang = frozenset(self._rang), set()
        return rang

    def wait(self, timeout: float) -> bool:
        """Sleep until rung or ``timeout`` seconds passed; whether it was rung."""
        self.start()
        return self._event.wait(timeout)

    def start(self) -> None:
        """Start the listening thread, once."""
        with self._start_lock:
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(
                    target=self._run, name="outbox-doorbell", daemon=True
                )
                self._thread.start()

    def wait_listening(self, timeout: float) -> bool:
        """Wait until the thread LISTENs (tests: a NOTIFY before that is not heard)."""
        self.start()
        return self._listening.wait(timeout)

    def close(self) -> None:
        """Stop the listening thread (within a few seconds; it is a daemon regardless)."""
        self._closed.set()
        self.ring()

    def _run(self) -> None:
        delay = _RECONNECT_FIRST_S
        while not self._closed.is_set():
            try:
                with psycopg.connect(self._url, autocommit=True) as conn:
                    conn.execute(
                        notify_sql.LISTEN_BROKER_AND_PLANNED
                        if self._planned()
                        else notify_sql.LISTEN_BROKER
                    )
                    self._listening.set()
                    # A message may have come while no connection listened: poll now.
                    self.ring()
                    delay = _RECONNECT_FIRST_S
                    while not self._closed.is_set():
                        for notify in conn.notifies(timeout=_LISTEN_TICK_S, stop_after=1):
                            self.ring(_WHAT_RANG.get(notify.channel, EVERYTHING))
            except psycopg.Error as exc:
                self._listening.clear()
                self.ring()  # until it listens again, the waiter polls
                log.debug("broker doorbell lost its connection: %s", type(exc).__name__)
                self._closed.wait(delay)
                delay = min(delay * 2, _RECONNECT_MAX_S)
