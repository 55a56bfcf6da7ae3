"""Locked connections a worker's direct take hands to its own dispatch task (issue 35).

A worker taking due operations directly (:mod:`outbox.workers.direct`) claims one on a
connection of the process's engine, and in the same statement takes the operation's advisory
lock and reads the row after it (``sql.relay.take_due(lock=True)``). The connection, lock
held, waits here under the operation's id until the task for its message, run by a thread of
the same process, adopts it (:class:`outbox.workers.locking.DispatchLocks`): the attempt then
starts at its ``sent`` compare-and-set, one round trip (and a pool checkout) sooner than a
task that takes the lock itself. For a tool without guards the take has made that move too
(``transitions.take_and_mark_sent``, change 46): the row is ``sent``, committed durably, and
the task goes straight to the payload's check and the call.

The lock is the dispatcher's lock, taken earlier and in another thread; nothing else
changes. The attempt's compare-and-set still decides, the sweep still sees the operation
locked (it is, by this process), and a process that dies drops its connections: PostgreSQL
frees the locks with them, and the stamped row is claimed again ``OUTBOX_REPUBLISH_AFTER``
later, as a row whose message was lost; a row the take moved to ``sent`` is, like any
``sent`` row whose dispatcher died, the sweep's and then the reconciler's (a lookup, a
replay inside the dedup window, or a person).

A connection no task adopts (the task never ran, or ran for another message) is released:
by the task at its end for its own operations, by :meth:`Handoffs.reap` once it waited
:data:`MAX_WAIT_S`, and by :meth:`Handoffs.close` when the worker stops; a row its take moved
to ``sent`` goes back to ``planned`` first, under the lock still held (no task ran: nothing
was sent). A task that comes later finds nothing here and takes the lock itself, as before.
Only pools that run tasks in the worker's own process (threads, solo) hand connections: a
prefork child could never adopt one.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from time import monotonic
from uuid import UUID

from sqlalchemy import Connection

from outbox.logs import Action, describe_error
from outbox.workers import dispatch
from outbox.workers.locking import Found, Handed, SentAtLock, discard

log = logging.getLogger(__name__)

#: A handed connection no task adopted within this is released (its lock with it): a task
#: that starts later takes the lock itself. Longer than a message waits for a free thread
#: on a worker keeping up; far shorter than ``OUTBOX_REPUBLISH_AFTER``.
MAX_WAIT_S = 5.0
#: At most this many connections wait for their task at once; past it the take claims without
#: locking (a backlog: the tasks lock for themselves, and the pool keeps room for them).
MAX_WAITING = 4


class Handoffs:
    """The connections handed and not adopted yet, by operation id. Thread-safe."""

    def __init__(self, *, max_wait_s: float = MAX_WAIT_S, max_waiting: int = MAX_WAITING) -> None:
        self.max_wait_s = max_wait_s
        self.max_waiting = max_waiting
        self._waiting: dict[UUID, Handed] = {}
        self._mutex = threading.Lock()

    def has_room(self) -> bool:
        """Whether another connection may be handed now."""
        with self._mutex:
            return len(self._waiting) < self.max_waiting

    def give(self, operation_id: UUID, conn: Connection, found: Found) -> None:
        """Keep ``conn`` (holding ``operation_id``'s lock) for the task that will adopt it."""
        with self._mutex:
            stale = self._waiting.pop(operation_id, None)
            self._waiting[operation_id] = Handed(conn, found, monotonic())
        if stale is not None:  # a message for it that never ran: its lock is this one's now
            _release(stale)

    def adopt(self, operation_id: UUID) -> Handed | None:
        """The connection handed for ``operation_id``, now the caller's (None: none waits)."""
        with self._mutex:
            return self._waiting.pop(operation_id, None)

    def release(self, operation_ids: Iterable[UUID]) -> None:
        """Release the connections still waiting for these operations (their task is done)."""
        with self._mutex:
            gone = [self._waiting.pop(one, None) for one in operation_ids]
        for handed in gone:
            if handed is not None:
                _release(handed)

    def reap(self) -> int:
        """Release the connections that waited :attr:`max_wait_s` or longer; how many."""
        deadline = monotonic() - self.max_wait_s
        with self._mutex:
            if not self._waiting:
                return 0
            old = [one for one, handed in self._waiting.items() if handed.at <= deadline]
            gone = [self._waiting.pop(one) for one in old]
        for handed in gone:
            _release(handed)
        if gone:
            log.info("released %d operation locks no task adopted", len(gone))
        return len(gone)

    def close(self) -> None:
        """Release every connection still waiting (the worker stops)."""
        with self._mutex:
            gone, self._waiting = list(self._waiting.values()), {}
        for handed in gone:
            _release(handed)

    def __len__(self) -> int:
        with self._mutex:
            return len(self._waiting)


def _release(handed: Handed) -> None:
    """Release a handed connection no task adopted. A row its take moved to `sent` goes back
    to `planned` first, under the lock still held: no task ran, so nothing was sent (if that
    fails, the row stays `sent` for the sweep and the reconciler, as after a crash)."""
    if isinstance(handed.found, SentAtLock) and not handed.conn.invalidated:
        sent = handed.found.operation
        try:
            dispatch.return_unsent(
                handed.conn, sent, "not sent: no task took the operation its take handed over"
            )
        except Exception as exc:  # noqa: BLE001 -- the lock goes with the connection anyway
            log.warning(
                "a handed operation %s stays sent for the reconciler: %s",
                sent.id,
                describe_error(exc),
                extra={"action": Action.DISPATCH_ERROR, "operation_id": str(sent.id)},
            )
    discard(handed.conn)


#: This process's hand-offs (None: tasks run elsewhere, or no direct take).
_active: Handoffs | None = None


def active() -> Handoffs | None:
    """The hand-offs of this process, if its takes hand connections to its tasks."""
    return _active


def start(handoffs: Handoffs | None) -> None:
    """Make this process's takes hand connections through ``handoffs`` (None: stop; any
    connection still waiting is released)."""
    global _active  # one per process, set by the starting worker
    previous, _active = _active, handoffs
    if previous is not None and previous is not handoffs:
        previous.close()
