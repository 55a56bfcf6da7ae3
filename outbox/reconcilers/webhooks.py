"""The webhook deliverer: POSTs pending escalation webhooks, signed, until delivered or given up.

Rows come from ``outbox.webhook_deliveries``, written in the same transaction as the move
they report (``outbox.webhooks``). Each :meth:`WebhookDeliverer.run_once` leases a batch of
due rows in one short transaction (``FOR UPDATE SKIP LOCKED``, then ``next_attempt_at``
pushed past the lease), POSTs each one outside any transaction, and writes each outcome
fenced on its lease. So several deliverers share the work, no transaction is held open
across an HTTP call, and a deliverer killed anywhere leaves its rows to be sent again once
the lease ends: delivery is at least once, with the same ``webhook-id`` every time.

Every attempt is signed afresh with the ``standardwebhooks`` library (``webhook-id`` is the
row id; ``webhook-timestamp`` and ``webhook-signature`` are computed at send time, the
timestamp on the database's clock, not this host's: a receiver refuses a timestamp more than
five minutes off its own clock, so a deliverer whose clock was off would never deliver). A 2xx
answer delivers; anything else is retried with exponential backoff, and a row still failing
``give_up_after_s`` after it was written is abandoned (judged by the database's clock).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import TracebackType
from uuid import UUID

import httpx
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from standardwebhooks import Webhook

from outbox import faults, sql, tracing, webhooks
from outbox.backoff import Backoff, exponential_s, jittered
from outbox.config import Settings, get_settings
from outbox.logs import Action, describe_error
from outbox.models import DeliveryStatus
from outbox.sql.webhooks import AttemptOutcome, Claimed
from outbox.webhooks import Endpoint

log = logging.getLogger(__name__)

#: The longest ``last_error`` kept: enough to diagnose, never a whole response.
_MAX_ERROR_CHARS = 500
#: httpx's timeout applies per phase (connect, write, read): one POST can take up to this
#: many timeouts before it fails.
_PHASES = 3


@dataclass(frozen=True, kw_only=True)
class DeliveryConfig:
    """Deliverer knobs, each with the reason for its default."""

    #: Rows leased per batch. They are POSTed one after the other, so a small batch keeps
    #: the lease (and a stuck receiver's hold on the others) short.
    batch_size: int = 10
    #: Per-phase HTTP timeout: a receiver should acknowledge at once and do its work later.
    timeout_s: float = 10.0
    #: How long a leased row stays claimed: at least a whole batch of POSTs at their timeout,
    #: so no peer claims a row still being sent. A deliverer killed mid-batch is retried after.
    lease_s: float = 300.0
    #: The first retry's delay; each later one doubles it (with jitter, so a receiver coming
    #: back up is not hit by every pending row at the same instant).
    min_backoff_s: float = 5.0
    #: Retries never wait longer than this: a receiver that comes back is served within the hour.
    max_backoff_s: float = 3600.0
    #: A row still failing this long after it was written is abandoned: a receiver down for
    #: three days is an incident of its own, and `outbox ops list` still shows the operation.
    give_up_after_s: float = 3 * 86400.0
    #: How often run_forever looks for due rows when the last batch was not full.
    poll_interval_s: float = 2.0
    #: Backoff bounds after a database failure in run_forever.
    min_error_backoff_s: float = 0.5
    max_error_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        """Refuse a lease shorter than one batch's POSTs: peers would send rows twice."""
        batch_s = self.batch_size * self.timeout_s * _PHASES
        if self.lease_s < batch_s:
            raise ValueError(
                f"lease_s ({self.lease_s:g}) must cover a batch of POSTs at their timeout "
                f"(batch_size * timeout_s * {_PHASES} = {batch_s:g})"
            )


@dataclass(frozen=True)
class DeliveryResult:
    """What one :meth:`WebhookDeliverer.run_once` did."""

    delivered: int
    retried: int
    abandoned: int

    @property
    def attempted(self) -> int:
        """Rows whose outcome this run recorded."""
        return self.delivered + self.retried + self.abandoned


NOTHING = DeliveryResult(0, 0, 0)


def database_now(row: Claimed, config: DeliveryConfig, claimed_at: float) -> datetime:
    """The time on the database's clock, read without a round trip: the instant ``row`` was
    claimed (``claim_due`` set its lease to that plus ``lease_s``), advanced by the time this
    process's monotonic clock has measured since ``claimed_at`` (its reading then)."""
    at_claim = row.lease - timedelta(seconds=config.lease_s)
    return at_claim + timedelta(seconds=time.monotonic() - claimed_at)


def backoff_s(attempts: int, config: DeliveryConfig) -> float:
    """Seconds before the next try after ``attempts`` failed ones: doubling, jittered, capped."""
    # Jittered before the cap, so the cap is exact: a row failing for long retries hourly.
    wait = exponential_s(attempts, base_s=config.min_backoff_s, max_s=math.inf)
    return min(jittered(wait), config.max_backoff_s)


class WebhookDeliverer:
    """Sends due webhook deliveries; :meth:`run_once` is one batch.

    Validates the settings when built (:func:`outbox.webhooks.check_settings`): a URL
    without a secret raises :class:`~outbox.errors.ConfigError`. With no URL configured
    there is nothing to send and :meth:`run_once` returns zeros.
    """

    def __init__(
        self,
        engine: Engine,
        config: DeliveryConfig | None = None,
        settings: Settings | None = None,
        *,
        client: httpx.Client | None = None,
    ) -> None:
        self.engine = engine
        self.config = config or DeliveryConfig()
        self.endpoint: Endpoint | None = webhooks.check_settings(settings or get_settings())
        self._owns_client = client is None
        # No redirects: a signed escalation goes to the configured URL or nowhere.
        self._client = client or httpx.Client(
            timeout=self.config.timeout_s,
            follow_redirects=False,
            headers={"user-agent": "agent-outbox-webhooks"},
        )
        self._stop = threading.Event()

    def run_once(self) -> DeliveryResult:
        """Lease one batch of due deliveries, POST each, record each outcome."""
        return self._deliver(None)

    def deliver_one(self, delivery_id: UUID) -> DeliveryResult:
        """Send one delivery now if it is pending and due (else do nothing)."""
        return self._deliver(delivery_id)

    def _deliver(self, only: UUID | None) -> DeliveryResult:
        if self.endpoint is None:
            return NOTHING
        with self.engine.begin() as conn:
            claimed = sql.webhooks.claim_due(
                conn, limit=self.config.batch_size, lease_s=self.config.lease_s, only=only
            )
        # The claim's own instant on the database clock (its lease ends lease_s after it),
        # and this process's monotonic clock then: each POST's timestamp is the one plus the
        # time measured since on the other.
        claimed_at = time.monotonic()
        if claimed:
            faults.point("webhook_after_claim")
        outcomes = [self._attempt(self.endpoint, row, claimed_at) for row in claimed]
        return DeliveryResult(
            delivered=outcomes.count(DeliveryStatus.DELIVERED),
            retried=outcomes.count(DeliveryStatus.PENDING),
            abandoned=outcomes.count(DeliveryStatus.ABANDONED),
        )

    def _attempt(
        self, endpoint: Endpoint, row: Claimed, claimed_at: float
    ) -> DeliveryStatus | None:
        """POST one claimed row and record the outcome; ``None`` if its lease was lost."""
        # A CLIENT span in the operation's trace (the agent's), naming the event, not its body.
        with tracing.stored_span(
            tracing.WEBHOOK_SPAN,
            row.traceparent,
            row.tracestate,
            kind="client",
            attributes={
                "outbox.webhook.event": str(row.event),
                "outbox.webhook.attempt": row.attempts + 1,
                **({tracing.OPERATION_ID: str(row.operation_id)} if row.operation_id else {}),
            },
        ) as span:
            status, error = self._post(endpoint, row, database_now(row, self.config, claimed_at))
            if span is not None and status is not None:
                span.set_attribute("http.response.status_code", status)
        faults.point("webhook_after_send")
        retry_in = backoff_s(row.attempts + 1, self.config)
        with self.engine.begin() as conn:
            if error is None and status is not None:
                attempts = sql.webhooks.record_delivered(conn, row, status=status)
                outcome = (
                    None if attempts is None else AttemptOutcome(DeliveryStatus.DELIVERED, attempts)
                )
            else:
                outcome = sql.webhooks.record_failed(
                    conn,
                    row,
                    status=status,
                    error=error or "no answer",
                    retry_in_s=retry_in,
                    give_up_after_s=self.config.give_up_after_s,
                )
        _log_outcome(endpoint, row, outcome, http_status=status, error=error, retry_in=retry_in)
        return outcome.status if outcome is not None else None

    def _post(
        self, endpoint: Endpoint, row: Claimed, now: datetime
    ) -> tuple[int | None, str | None]:
        """One signed POST at ``now`` (database clock): (HTTP status or ``None``, error or
        ``None`` when 2xx)."""
        # The receiver compares this with its own clock to refuse replays, so it is taken
        # now, for this attempt: a retry days later must not carry the first try's time.
        # It decides nothing on our side (backoff and give-up are judged by the database).
        sent_at = now.replace(microsecond=0)
        msg_id = str(row.id)
        headers = {
            "webhook-id": msg_id,
            "webhook-timestamp": str(int(sent_at.timestamp())),
            "webhook-signature": Webhook(endpoint.secret).sign(msg_id, sent_at, row.body),
            "content-type": "application/json",
        }
        try:
            response = self._client.post(
                endpoint.url, content=row.body.encode("utf-8"), headers=headers
            )
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
        if response.is_success:
            return response.status_code, None
        return response.status_code, f"HTTP {response.status_code} {response.reason_phrase}"

    def stop(self) -> None:
        """Ask :meth:`run_forever` to finish its batch and return."""
        self._stop.set()

    def run_forever(self) -> None:
        """Deliver until :meth:`stop`; survive database outages with backoff."""
        backoff = Backoff(
            base_s=self.config.min_error_backoff_s, max_s=self.config.max_error_backoff_s
        )
        try:
            while not self._stop.is_set():
                try:
                    result = self.run_once()
                    backoff.reset()
                except DBAPIError as exc:
                    wait_s = backoff.next_s()
                    log.warning(
                        "webhook batch failed, retrying in %.1fs: %s",
                        wait_s,
                        describe_error(exc),
                        extra={"action": Action.WEBHOOK_ERROR, "error": describe_error(exc)},
                    )
                    self._stop.wait(wait_s)
                    continue
                if result.attempted < self.config.batch_size:
                    self._stop.wait(self.config.poll_interval_s)
        finally:
            self.close()

    def close(self) -> None:
        """Close the HTTP client, if this deliverer created it."""
        if self._owns_client:
            self._client.close()

    def __enter__(self) -> WebhookDeliverer:
        """Use as a context manager that closes the HTTP client."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Close the HTTP client."""
        self.close()


def _log_outcome(
    endpoint: Endpoint,
    row: Claimed,
    outcome: AttemptOutcome | None,
    *,
    http_status: int | None,
    error: str | None,
    retry_in: float,
) -> None:
    """One line per attempt, with its action; the URL's host only (its path may hold a token)."""
    fields: dict[str, object] = {
        "delivery_id": str(row.id),
        "operation_id": str(row.operation_id) if row.operation_id is not None else None,
        "event": row.event.value,
        "host": endpoint.host,
        "http_status": http_status,
    }
    if outcome is None:
        # A peer claimed the row after our lease ran out; it sends (or sent) it too.
        log.warning(
            "webhook %s: lease lost, outcome not recorded",
            row.id,
            extra={"action": Action.WEBHOOK_LEASE_LOST, **fields},
        )
        return
    status, attempts = outcome.status, outcome.attempts
    fields["attempts"] = attempts
    if status is DeliveryStatus.DELIVERED:
        log.info(
            "webhook %s delivered", row.id, extra={"action": Action.WEBHOOK_DELIVERED, **fields}
        )
    elif status is DeliveryStatus.ABANDONED:
        log.warning(
            "webhook %s abandoned after %d attempts: %s",
            row.id,
            attempts,
            error,
            extra={"action": Action.WEBHOOK_ABANDONED, **fields},
        )
    else:
        log.warning(
            "webhook %s failed (%s), retry in %.0fs",
            row.id,
            error,
            retry_in,
            extra={"action": Action.WEBHOOK_RETRY, **fields},
        )


def deliver_one(
    engine: Engine,
    delivery_id: UUID,
    *,
    config: DeliveryConfig | None = None,
    settings: Settings | None = None,
) -> DeliveryResult:
    """Send one delivery now if it is pending and due; what the Celery task calls with an id."""
    with WebhookDeliverer(engine, config, settings) as deliverer:
        return deliverer.deliver_one(delivery_id)
