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
import random
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol
from uuid import UUID

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from outbox import faults, statements
from outbox.errors import BrokerUnavailable

log = logging.getLogger(__name__)

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
    """Sends dispatch messages to the broker (implemented in ``workers.publish``)."""

    def publish(self, messages: Sequence[OutboundMessage]) -> set[UUID]:
        """Publish ``messages``; return the ids the broker confirmed (may be a subset).

        Raises :class:`BrokerUnavailable` on a broker failure; the relay then records
        nothing for the batch.
        """
        ...

    def close(self) -> None:
        """Release the broker connection."""
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

    def run_once(self) -> RelayResult:
        """Claim one batch of due rows, publish them, record the confirmed ones."""
        with self.engine.begin() as conn:
            claimed = statements.claim_due(
                conn,
                limit=self.config.batch_size,
                republish_after_s=self.config.republish_after_s,
            )
            if not claimed:
                return RelayResult(0, 0)
            faults.point("relay_before_publish")
            messages = [OutboundMessage(op_id, tool, target) for op_id, tool, target in claimed]
            confirmed = self.publisher.publish(messages)
            faults.point("relay_after_publish")
            published = statements.mark_published(
                conn, [m.operation_id for m in messages if m.operation_id in confirmed]
            )
        faults.point("relay_after_commit")
        return RelayResult(len(claimed), published)

    def stop(self) -> None:
        """Ask :meth:`run_forever` to finish its batch and return."""
        self._stop.set()

    def run_forever(self) -> None:
        """Publish until :meth:`stop`; survive broker and database outages with backoff."""
        backoff = self.config.min_backoff_s
        self._register()
        try:
            while not self._stop.is_set():
                try:
                    result = self.run_once()
                    backoff = self.config.min_backoff_s
                except (DBAPIError, BrokerUnavailable, OSError) as exc:
                    log.warning(
                        "relay batch failed, retrying in %.1fs: %s",
                        backoff,
                        exc,
                        extra={"action": "relay_error"},
                    )
                    self._stop.wait(backoff * random.uniform(0.8, 1.2))  # noqa: S311
                    backoff = min(backoff * 2, self.config.max_backoff_s)
                    continue
                if result.claimed:
                    log.info(
                        "relay published %d of %d",
                        result.published,
                        result.claimed,
                        extra={"action": "relay_published", **result.__dict__},
                    )
                if result.claimed < self.config.batch_size or result.unconfirmed:
                    self._sleep()
        finally:
            self._unregister()
            self.publisher.close()

    def _sleep(self) -> None:
        """Wait for the bell (or the poll interval), saying we are idle while we do."""
        if self._stop.is_set():
            return
        try:
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                # The idle flag is advice (a lost one costs a poll interval or a needless
                # NOTIFY), so its commits need not wait for the disk: waking up to a bell
                # should not pay a WAL flush before the claim.
                conn.execute(
                    text(f"SET synchronous_commit = off; LISTEN {statements.PLANNED_CHANNEL}")
                )
                self._announce(conn, idle=True)
                try:
                    # Rows committed between our last claim and the idle flag rang no bell.
                    if not statements.any_due_unpublished(conn):
                        self._wait_for_bell(conn)
                finally:
                    self._announce(conn, idle=False)
                    conn.execute(text("UNLISTEN *; RESET synchronous_commit"))
        except DBAPIError as exc:
            log.warning("relay cannot listen: %s", exc, extra={"action": "relay_error"})
            self._stop.wait(self.config.poll_interval_s)

    def _wait_for_bell(self, conn: Connection) -> None:
        """Block until a NOTIFY, the poll interval, or stop(); in short slices for stop()."""
        listener = conn.connection.driver_connection
        deadline = time.monotonic() + self.config.poll_interval_s
        while not self._stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            rang = False
            for _ in listener.notifies(  # type: ignore[union-attr]
                timeout=min(remaining, _STOP_CHECK_S), stop_after=1
            ):
                rang = True
            if rang:
                return

    def _announce(self, conn: Connection, *, idle: bool) -> None:
        statements.announce_relay(
            conn, self.name, pid=os.getpid(), host=socket.gethostname(), idle=idle
        )

    def _register(self) -> None:
        # Best effort: a relay that starts during a database outage still runs (its first
        # idle announcement creates the row), it just cannot clean up after dead peers yet.
        try:
            with self.engine.begin() as conn:
                statements.forget_silent_relays(conn, older_than_s=self.config.silent_after_s)
                self._announce(conn, idle=False)
        except DBAPIError as exc:
            log.warning("relay could not register: %s", exc, extra={"action": "relay_error"})

    def _unregister(self) -> None:
        try:
            with self.engine.begin() as conn:
                statements.forget_relay(conn, self.name)
        except DBAPIError as exc:
            log.warning("relay could not unregister: %s", exc, extra={"action": "relay_error"})
