"""The relay: publishes a wake-up message for every due ``planned`` operation.

The database decides; a message is only a doorbell. The relay claims due rows in batches
(``FOR UPDATE SKIP LOCKED``, so several relays share the work), hands them to a
:class:`Publisher` and records ``published_at`` only for the messages the broker confirmed,
in the same transaction as the claim. A crash anywhere leaves rows unpublished (published
again) or published twice (harmless: the dispatcher's compare-and-set makes duplicates
no-ops). Rows whose message went missing are published again after ``republish_after_s``.

The relay sleeps on ``LISTEN outbox_planned`` with a polling fallback. ``enqueue`` rings that
bell only while a relay says it is idle (``outbox.relays``): NOTIFY takes a cluster-wide lock
at commit, which a loaded system must not pay on every agent commit (docs/relay.md).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable
from uuid import UUID

import psycopg
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from outbox import faults, sql, tracing
from outbox.backoff import Backoff
from outbox.errors import BrokerUnavailable
from outbox.logs import Action, describe_error

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: How often a sleeping relay checks whether it was asked to stop.
_STOP_CHECK_S = 0.25


@dataclass(frozen=True)
class OutboundMessage:
    """What a dispatch message carries: the id (the truth is the row) and, for people
    watching Flower, the tool and target."""

    operation_id: UUID
    tool: str
    target: str


class Publisher(Protocol):
    """Sends dispatch messages to the broker (implemented in ``outbox.workers.publish``)."""

    def publish(self, messages: Sequence[OutboundMessage]) -> set[UUID]:
        """Publish ``messages``; return the ids the broker confirmed (may be a subset).

        Raises :class:`BrokerUnavailable` on a broker failure; the relay then records
        nothing for the batch.
        """
        ...

    def close(self) -> None:
        """Release the broker connection."""
        ...


@runtime_checkable
class TransactionalPublisher(Publisher, Protocol):
    """A publisher that may write a batch in the relay's own transaction (the database
    broker, when it is the relay's database): the messages then commit with the claim that
    stamps them published, or roll back with it."""

    def publish_in(self, conn: Connection, messages: Sequence[OutboundMessage]) -> set[UUID] | None:
        """Write ``messages`` in ``conn``'s open transaction, not committing; the ids
        written, or None if this broker cannot (then the relay calls :meth:`publish`)."""
        ...


@dataclass(frozen=True, kw_only=True)
class RelayConfig:
    """Relay knobs, each with the reason for its default."""

    #: Rows per claim: large enough to amortise the round trips, small enough that a
    #: batch's row locks are short.
    batch_size: int = 200
    #: A published `planned` row is published again after this (its message was lost).
    republish_after_s: float = 30.0
    #: Poll at least this often while idle, in case a NOTIFY was missed or a backoff ended.
    poll_interval_s: float = 1.0
    #: Backoff bounds after a broker or database failure.
    min_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    #: Relay rows without a heartbeat for this long belong to dead relays and are removed.
    silent_after_s: float = 120.0
    #: A running relay refreshes its heartbeat this often (well inside ``silent_after_s``).
    heartbeat_s: float = 10.0
    #: Batches found in a row without waiting for the bell that make a backlog: the relay
    #: then stops the bell (enqueue's NOTIFY costs every agent's commit a cluster-wide lock)
    #: and claims back to back until a batch comes back empty.
    busy_after_batches: int = 4
    #: While a worker takes due operations directly (database broker, :mod:`outbox.workers.direct`;
    #: a RabbitMQ worker whose flag is down, carrying a backlog, :mod:`outbox.workers.listening`),
    #: the relay stands by: it claims a row never published only once it has been due this
    #: long (nobody took it). While a worker that takes only messages lives
    #: (:mod:`outbox.workers.message_only`), ``defer_to_takers_s`` instead: it would wait.
    standby_hold_back_s: float = 10.0
    #: While a RabbitMQ worker that takes due operations directly waits for work
    #: (:mod:`outbox.workers.listening`), a row never published is left to it this long after
    #: it became due: the worker takes it in about a millisecond; past this, it was busy or
    #: died, and the relay publishes the row.
    defer_to_takers_s: float = 0.2


@dataclass(frozen=True)
class RelayResult:
    """What one :meth:`Relay.run_once` did."""

    claimed: int
    published: int

    @property
    def unconfirmed(self) -> int:
        """Claimed rows whose message the broker did not confirm (left unpublished)."""
        return self.claimed - self.published


class Relay:
    """Claims due rows and publishes them; :meth:`run_once` is one batch."""

    def __init__(
        self,
        engine: Engine,
        publisher: Publisher,
        config: RelayConfig | None = None,
        *,
        name: str | None = None,
    ) -> None:
        self.engine = engine
        self.publisher = publisher
        self.config = config or RelayConfig()
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()

        #: Whether a worker takes due operations directly (:meth:`_check_takers`).
        self.standing_by = False
        #: Whether a RabbitMQ worker waits for work, taking fresh rows itself.
        self.deferring = False
        #: Whether a worker that takes only messages lives (then standing by is brief).
        self.consumers = False
        self._takers_checked_at: float | None = None

    def run_once(self) -> RelayResult:
        """Claim one batch of due rows, publish them, record the confirmed ones."""
        with self.engine.connect() as conn:
            return self._run_once(conn)

    def _run_once(self, conn: Connection) -> RelayResult:
        with conn.begin():
            # Claimed and stamped published in one statement; the stamp commits only once
            # the broker confirmed (any failure below rolls it back with the row locks).
            claimed = sql.relay.claim_and_mark_due(
                conn,
                limit=self.config.batch_size,
                republish_after_s=self.config.republish_after_s,
                hold_back_s=self._hold_back_s(),
                defer_to_takers_s=self.config.defer_to_takers_s,
                takers_heartbeat_within_s=3 * self.config.heartbeat_s,
            )
            if not claimed:
                return RelayResult(0, 0)
            faults.point("relay_before_publish")
            messages = [OutboundMessage(c.id, c.tool, c.target) for c in claimed]
            # One PRODUCER span per operation, in its agent's trace (none without an SDK).
            with tracing.publish_spans(claimed) as published_spans:
                confirmed = self._publish(conn, messages)
                published_spans.confirmed(confirmed)
            faults.point("relay_after_publish")
            sql.relay.unmark_published(conn, [c for c in claimed if c.id not in confirmed])
        faults.point("relay_after_commit")
        return RelayResult(len(claimed), sum(1 for c in claimed if c.id in confirmed))

    def _hold_back_s(self) -> float:
        """How long a row never published is left to the workers that take directly: not at
        all while none lives; ``standby_hold_back_s`` while one does, unless a worker that
        takes only messages lives too (it would wait that long for every row the takers did
        not reach): then ``defer_to_takers_s``."""
        if not self.standing_by:
            return 0.0
        if self.consumers:
            return self.config.defer_to_takers_s
        return self.config.standby_hold_back_s

    def _publish(self, conn: Connection, messages: Sequence[OutboundMessage]) -> set[UUID]:
        """In the claim's transaction if the publisher can (one commit fewer, and a message
        exists exactly when its claim committed), else through the broker."""
        if isinstance(self.publisher, TransactionalPublisher):
            written = self.publisher.publish_in(conn, messages)
            if written is not None:
                return written
        return self.publisher.publish(messages)

    def stop(self) -> None:
        """Ask :meth:`run_forever` to finish its batch and return."""
        self._stop.set()

    def run_forever(self) -> None:
        """Publish until :meth:`stop`; survive broker and database outages with backoff.

        Between batches the relay waits on its bell (``LISTEN``, one connection kept for
        its life), so a new intent is claimed as soon as its commit rings. It clears its
        idle flag only while it works through a backlog (a full batch, or several batches
        in a row found without waiting), when the bell would be pointless: enqueue then
        stops ringing, and the relay claims batch after batch until one comes back empty.
        """
        backoff = Backoff(base_s=self.config.min_backoff_s, max_s=self.config.max_backoff_s)
        self._register()
        bell = _Bell(self.engine, self.name, self._stop)
        in_a_row = 0
        try:
            while not self._stop.is_set():
                try:
                    bell.heartbeat(self.config.heartbeat_s)
                    self._check_takers(bell)
                    result = bell.in_transaction(self._run_once)
                    backoff.reset()
                    self._log(result)
                    if result.unconfirmed:
                        # Broker trouble: retry after the poll interval, not on every bell.
                        in_a_row = 0
                        self._stop.wait(self.config.poll_interval_s)
                        continue
                    if result.claimed < self.config.batch_size and self._leave_to_workers(bell):
                        in_a_row = 0
                        continue
                    in_a_row = in_a_row + 1 if result.claimed else 0
                    backlog = (
                        result.claimed >= self.config.batch_size
                        or in_a_row >= self.config.busy_after_batches
                    )
                    if backlog:
                        bell.announce(idle=False)
                        continue
                    if not bell.idle:
                        bell.announce(idle=True)
                        # Rows committed while the flag was down rang no bell: look again.
                        if bell.any_due_unpublished():
                            continue
                    if bell.wait(self.config.poll_interval_s):
                        in_a_row = 0  # it slept: whatever comes next is not a backlog
                except (DBAPIError, psycopg.Error, BrokerUnavailable, OSError) as exc:
                    # psycopg.Error: the bell's wait reads the driver connection directly.
                    bell.close()
                    in_a_row = 0
                    wait_s = backoff.next_s()
                    log.warning(
                        "relay batch failed, retrying in %.1fs: %s",
                        wait_s,
                        describe_error(exc),
                        extra={"action": Action.RELAY_ERROR, "error": describe_error(exc)},
                    )
                    self._stop.wait(wait_s)
        finally:
            bell.close()
            self._unregister()
            self.publisher.close()

    def _leave_to_workers(self, bell: _Bell) -> bool:
        """Between batches, while workers take due rows themselves, wait as they need: True
        if it waited so (then the next batch), False if the relay waits on its bell."""
        if self.deferring:
            # RabbitMQ workers wait for work and take fresh rows themselves
            # (outbox.workers.listening): enqueue rings them, not the relay. It claims what
            # they left once every defer_to_takers_s, and looks again at once when a
            # worker's flag goes down (its ring): then it stands by.
            bell.announce(idle=False)
            bell.hear_planned(False)
            if bell.rung_within(self.config.defer_to_takers_s):
                self._takers_checked_at = None
            return True
        if self.standing_by:
            # The workers take due rows themselves: the flag down (enqueue rings the
            # workers'), a poll now and then, and a ring for them if a row became due that
            # no commit rang for (a backoff ended). A worker that takes only messages rings
            # as it starts and stops: then it looks at the flags again after this poll, not
            # a heartbeat interval later (outbox.workers.message_only). The rings are read
            # once a poll, not as they come: the takers' flags go up and down often through
            # a flat run, and waking for each of their rings doubled the relay's CPU. Enqueue's
            # bell is not for it meanwhile.
            bell.announce(idle=False)
            bell.hear_planned(False)
            bell.ring_takers()
            self._stop.wait(self.config.poll_interval_s)
            if bell.drain_for_consumer():
                self._takers_checked_at = None
            return True
        return False

    def _check_takers(self, bell: _Bell) -> None:
        """Stand by while a worker takes due operations directly (its flag's heartbeat is
        fresh): looked up every poll interval until one is seen (workers starting beside the
        relay), then once a heartbeat interval (to notice they are gone)."""
        now = time.monotonic()
        checked = self._takers_checked_at
        every = self.config.heartbeat_s if self.standing_by else self.config.poll_interval_s
        if checked is not None and now - checked < every:
            return
        seen = bell.takers(heartbeat_within_s=3 * self.config.heartbeat_s)
        self._takers_checked_at = now
        standing_by, deferring = seen.live, seen.waiting and not seen.live
        if deferring != self.deferring:
            if deferring:
                _log_mode("leaving fresh rows to workers waiting for work", "deferring")
            else:
                _log_mode("claiming fresh rows at once: no worker waits for work", "claiming")
                bell.hear_planned(True)
            self.deferring = deferring
        if standing_by != self.standing_by:
            if standing_by:
                _log_mode("standing by: workers take due operations directly", "standing_by")
            else:
                _log_mode("claiming at once: no worker takes directly", "claiming")
                if not deferring:
                    bell.hear_planned(True)  # it waits on enqueue's bell again
        self.standing_by = standing_by
        if seen.consumers != self.consumers:
            if seen.consumers:
                _log_mode(
                    "sees a worker that takes only messages: standing by, it leaves rows to "
                    f"the others for {self.config.defer_to_takers_s:g}s only",
                    "consumers",
                )
            else:
                _log_mode("sees no worker that takes only messages", "no_consumers")
            self.consumers = seen.consumers

    @staticmethod
    def _log(result: RelayResult) -> None:
        if result.claimed:
            log.info(
                "relay published %d of %d",
                result.published,
                result.claimed,
                extra={"action": Action.RELAY_PUBLISHED, **result.__dict__},
            )

    def _register(self) -> None:
        # Best effort: a relay that starts during a database outage still runs (its first
        # idle announcement creates the row), it just cannot clean up after dead peers yet.
        try:
            with self.engine.begin() as conn:
                sql.relay.forget_silent_relays(conn, older_than_s=self.config.silent_after_s)
                _announce(conn, self.name, idle=False)
        except DBAPIError as exc:
            log.warning(
                "relay could not register: %s",
                describe_error(exc),
                extra={"action": Action.RELAY_ERROR, "error": describe_error(exc)},
            )

    def _unregister(self) -> None:
        try:
            with self.engine.begin() as conn:
                sql.relay.forget_relay(conn, self.name)
        except DBAPIError as exc:
            log.warning(
                "relay could not unregister: %s",
                describe_error(exc),
                extra={"action": Action.RELAY_ERROR, "error": describe_error(exc)},
            )


def _log_mode(message: str, mode: str) -> None:
    """How the relay now claims, logged when it changes."""
    log.info("relay %s", message, extra={"action": Action.RELAY_STANDBY, "mode": mode})


def _announce(conn: Connection, name: str, *, idle: bool) -> None:
    sql.relay.announce_relay(conn, name, pid=os.getpid(), host=socket.gethostname(), idle=idle)


class _Bell:
    """The relay's doorbell: one autocommit connection that LISTENs for its whole life and
    writes the relay's idle flag (opened on first use, reopened after a failure)."""

    def __init__(self, engine: Engine, name: str, stop: threading.Event) -> None:
        self.engine = engine
        self.name = name
        self._stop = stop
        self._conn: Connection | None = None
        #: The flag as last written on this connection (None: not written yet).
        self.idle: bool | None = None
        #: Whether the connection listens to enqueue's bell (always to the workers' ring).
        self.hearing_planned = True
        self._announced_at = 0.0

    def _connection(self) -> Connection:
        if self._conn is None:
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            try:
                # The idle flag is advice (a lost one costs a poll interval or a needless
                # NOTIFY), so its commits need not wait for the disk.
                sql.notify.listen_planned(conn)
                sql.notify.listen_relay(conn)
            except BaseException:
                conn.invalidate()
                conn.close()
                raise
            self._conn, self.idle, self.hearing_planned = conn, None, True
        return self._conn

    def announce(self, *, idle: bool) -> None:
        """Write the idle flag (and the heartbeat), if it changed."""
        if self.idle is idle:
            return
        _announce(self._connection(), self.name, idle=idle)
        self.idle, self._announced_at = idle, time.monotonic()

    def heartbeat(self, every_s: float) -> None:
        """Refresh the heartbeat if the last one is ``every_s`` old (peers forget silent
        relays, whose flag would keep the bell ringing)."""
        if self.idle is not None and time.monotonic() - self._announced_at >= every_s:
            _announce(self._connection(), self.name, idle=self.idle)
            self._announced_at = time.monotonic()

    def in_transaction(self, work: Callable[[Connection], _T]) -> _T:
        """``work(connection)`` in a transaction on this connection (no checkout, no ping;
        its commit, like the flag's, does not wait for the disk: ``published_at`` is advice
        too, a lost one only publishes a row again and the dispatcher ignores duplicates)."""
        conn = self._connection()
        conn.commit()  # ends SQLAlchemy's autobegun (autocommit) transaction: nothing to send
        conn.execution_options(isolation_level=conn.default_isolation_level)
        try:
            return work(conn)
        finally:
            if not conn.invalidated and not conn.in_transaction():
                conn.execution_options(isolation_level="AUTOCOMMIT")

    def takers(self, *, heartbeat_within_s: float) -> sql.relay.Takers:
        """The workers taking directly that heartbeat within ``heartbeat_within_s``."""
        return sql.relay.takers(self._connection(), heartbeat_within_s=heartbeat_within_s)

    def hear_planned(self, hear: bool) -> None:
        """Listen to enqueue's bell (``hear``) or not; the workers' ring is always heard."""
        if self.hearing_planned is not hear:
            sql.notify.hear_planned(self._connection(), hear=hear)
            self.hearing_planned = hear

    def rung_within(self, timeout_s: float) -> bool:
        """Whether a bell rang within ``timeout_s`` (or before; stop ends the wait early)."""
        listener = self._connection().connection.driver_connection
        deadline = time.monotonic() + timeout_s
        while not self._stop.is_set():
            remaining = deadline - time.monotonic()
            if _drained(listener, max(min(remaining, _STOP_CHECK_S), 0.0)):
                return True
            if remaining <= 0:
                break
        return False

    def ring_takers(self) -> None:
        """Ring enqueue's bell if a due row was never published (the workers taking directly
        poll only every few seconds; a backoff's end rings nothing)."""
        sql.relay.ring_if_due_unpublished(self._connection())

    def drain_for_consumer(self) -> bool:
        """Read the rings received meanwhile (a relay standing by does not wait on them):
        whether a worker that takes only messages rang, as it started or stopped."""
        return _consumer_rang(self._connection().connection.driver_connection)

    def any_due_unpublished(self) -> bool:
        """Whether some due row was never published (checked after raising the flag)."""
        return sql.relay.any_due_unpublished(self._connection())

    def wait(self, timeout_s: float) -> bool:
        """Until a bell (those already rung return at once), ``timeout_s`` or stop; in short
        slices for stop. Rings are drained: one wake-up covers every commit before it.
        True if it had to wait."""
        listener = self._connection().connection.driver_connection
        if _drained(listener, 0.0):
            return False
        deadline = time.monotonic() + timeout_s
        while not self._stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or _drained(listener, min(remaining, _STOP_CHECK_S)):
                break
        return True

    def close(self) -> None:
        """Stop listening and give the connection back (discard it if that fails)."""
        conn, self._conn, self.idle = self._conn, None, None
        if conn is None:
            return
        try:
            if conn.invalidated:
                # Dead inside a statement (the server restarted, the session was ended):
                # nothing to unlisten, and SQLAlchemy refuses any statement on it until its
                # transaction is rolled back (PendingRollbackError, not a DBAPIError).
                return
            sql.notify.unlisten_planned(conn)
            # What arrived before the UNLISTEN would wait in psycopg for the pooled
            # connection's next notifies(): drained, as outbox.wait does.
            _drained(conn.connection.driver_connection, 0.0)
        except (SQLAlchemyError, psycopg.Error):
            conn.invalidate()
        finally:
            conn.close()


def _consumer_rang(listener: Any) -> bool:
    """Whether a message-only worker rang the relays' channel among the rings received so
    far (every one of them, of any kind, is consumed; nothing is waited for)."""
    rang = False
    for ring in listener.notifies(timeout=0.0):
        if ring.channel == sql.notify.RELAY_CHANNEL and ring.payload == sql.relay.CONSUMER_RING:
            rang = True
    return rang


def _drained(listener: Any, timeout_s: float) -> bool:
    """Whether a bell rang within ``timeout_s`` (then every ring received is consumed)."""
    rang = False
    for _ in listener.notifies(timeout=timeout_s, stop_after=1):
        rang = True
    if rang:
        for _ in listener.notifies(timeout=0.0):
            pass
    return rang
