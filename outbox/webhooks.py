"""Escalation webhooks, the core's half: which moves make which events, and their delivery rows.

:func:`record_for_move` runs inside every move (:func:`outbox.transitions.apply`), in the caller's
transaction: a move and its delivery rows commit together or not at all, so a committed
escalation cannot lose its webhook and a rolled-back one never sends one. The deliverer
(``outbox.reconcilers.webhooks``) sends the rows later, signed per Standard Webhooks; the row's id
is the ``webhook-id``, the same on every retry, so receivers can deduplicate.

A message never carries a secret, nor the operation's payload (it may hold personal data):
only the payload's hash. Every statement on ``outbox.webhook_deliveries`` is a named
function below; every time and every age comparison is the database's clock.
"""

from __future__ import annotations

import base64
import binascii
import enum
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit
from uuid import UUID

from sqlalchemy import insert, select, text

from outbox import storable
from outbox.config import Settings, get_settings
from outbox.errors import ConfigError
from outbox.models import Executor, Operation
from outbox.schema import webhook_deliveries
from outbox.states import Actor, State

#: Standard Webhooks secrets are ``whsec_`` + base64; the convention asks for 24 to 64 bytes.
SECRET_PREFIX = "whsec_"  # noqa: S105 -- the format's prefix, not a secret
MIN_SECRET_BYTES = 24


class WebhookEvent(enum.StrEnum):
    """What a webhook reports; its ``type`` is ``operation.<event>``."""

    #: The operation entered ``needs_human``: an operator must decide.
    NEEDS_HUMAN = "needs_human"
    #: The operation left ``needs_human``: the follow-up of an escalation, whatever its verdict.
    RESOLVED = "resolved"
    #: The operation entered ``confirmed`` (opt-in).
    CONFIRMED = "confirmed"
    #: The operation entered ``failed`` (opt-in).
    FAILED = "failed"


class DeliveryStatus(enum.StrEnum):
    """Where a delivery stands; only ``pending`` rows are ever sent."""

    #: Not delivered yet; sent when ``next_attempt_at`` has passed.
    PENDING = "pending"
    #: The receiver answered 2xx. Final.
    DELIVERED = "delivered"
    #: Still failing after the give-up period. Final; the operation itself is untouched.
    ABANDONED = "abandoned"


def events_for_move(from_state: State, to_state: State) -> list[WebhookEvent]:
    """The events a move produces, before subscription; a move can produce two.

    ``needs_human -> confirmed`` is both ``resolved`` (the escalation's follow-up) and
    ``confirmed``.
    """
    found: list[WebhookEvent] = []
    if to_state is State.NEEDS_HUMAN:
        found.append(WebhookEvent.NEEDS_HUMAN)
    if from_state is State.NEEDS_HUMAN:
        found.append(WebhookEvent.RESOLVED)
    if to_state is State.CONFIRMED:
        found.append(WebhookEvent.CONFIRMED)
    if to_state is State.FAILED:
        found.append(WebhookEvent.FAILED)
    return found


def resolve_command(operation: Operation) -> str:
    """The ``outbox ops resolve`` line an operator copies, fenced on what the webhook reported.

    ``--expect-attempts`` and ``--payload-hash`` make the command refuse to act if the
    operation moved on (another attempt) or is not the one the operator read about.
    """
    return (
        f"outbox ops resolve {operation.id} --expect-attempts {operation.attempts} "
        f"--payload-hash {operation.payload_hash} "
        "(--applied --remote-ref REMOTE_ID | --not-applied [--replay]) "
        '--by "YOUR NAME" --note "WHAT YOU CHECKED"'
    )


def _iso_utc(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def message(
    event: WebhookEvent, operation: Operation, *, from_state: State, actor: Actor, reason: str
) -> dict[str, Any]:
    """The body of one webhook (Standard Webhooks' ``type`` / ``timestamp`` / ``data``).

    ``timestamp`` is the move's own instant (``updated_at``, the database clock). The
    operation's payload is left out on purpose: only its hash identifies it.
    """
    return {
        "type": f"operation.{event.value}",
        "timestamp": _iso_utc(operation.updated_at),
        "data": {
            "operation_id": str(operation.id),
            "intent_key": operation.intent_key,
            "tool": operation.tool,
            "target": operation.target,
            "state": operation.state.value,
            "from_state": from_state.value,
            "attempts": operation.attempts,
            "remote_ref": operation.remote_ref,
            "payload_hash": operation.payload_hash,
            "reason": reason,
            "actor": actor.value,
            "resolve_command": (
                resolve_command(operation) if event is WebhookEvent.NEEDS_HUMAN else None
            ),
        },
    }


def subscribed_events(from_state: State, to_state: State) -> list[WebhookEvent]:
    """The events this move makes that are delivered here (none without a webhook URL).

    A move with any writes its delivery rows in the same transaction, so a caller that
    commits statements one by one (the dispatcher) wraps such a move in a transaction.
    """
    settings = get_settings()
    if settings.webhook_url is None:
        return []
    subscribed = set(settings.webhook_events)
    return [e for e in events_for_move(from_state, to_state) if e.value in subscribed]


def record_for_move(
    executor: Executor,
    operation: Operation,
    *,
    from_state: State,
    to_state: State,
    actor: Actor,
    reason: str,
) -> None:
    """Write a pending delivery for each subscribed event of this move, in the caller's
    transaction (never commits).

    Does nothing when ``OUTBOX_WEBHOOK_URL`` is unset or the move makes no subscribed event
    (``OUTBOX_WEBHOOK_EVENTS``), so the common move costs no statement.
    """
    events = subscribed_events(from_state, to_state)
    if not events:
        return
    rows = [
        {
            "operation_id": operation.id,
            "event": event.value,
            "payload": message(event, operation, from_state=from_state, actor=actor, reason=reason),
        }
        for event in events
    ]
    executor.execute(insert(webhook_deliveries).values(rows))


# --- configuration -------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: the validated ``OUTBOX_WEBHOOK_*`` settings."""

    # Kept out of repr: receivers often put a token in the URL's path or query.
    url: str = field(repr=False)
    #: The ``whsec_`` signing secret, validated; the deliverer signs with it
    #: (``standardwebhooks``, in the ``[worker]`` extra: the core only records rows).
    secret: str = field(repr=False)

    @property
    def host(self) -> str:
        """The receiver's host, the only part of the URL that may be logged."""
        return urlsplit(self.url).hostname or "?"


def _decode_secret(secret: str) -> bytes:
    encoded = secret.removeprefix(SECRET_PREFIX)
    try:
        # Standard Webhooks secrets are sometimes written without base64 padding.
        return base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except binascii.Error:
        return b""


def check_settings(settings: Settings) -> Endpoint | None:
    """Validate the webhook settings at start-up; ``None`` when webhooks are off.

    Raises :class:`ConfigError` naming the variable: ``OUTBOX_WEBHOOK_URL`` set without
    ``OUTBOX_WEBHOOK_SECRET``, a secret that is not ``whsec_`` + base64 of at least
    :data:`MIN_SECRET_BYTES` bytes, or a URL that is not http(s) (pydantic's ``HttpUrl``
    refuses those already when the settings load; checked again for settings built otherwise).
    """
    if settings.webhook_url is None:
        return None
    if settings.webhook_url.scheme not in ("http", "https"):
        raise ConfigError(
            "invalid configuration: OUTBOX_WEBHOOK_URL: must be an http or https URL, "
            f"not {settings.webhook_url.scheme}://"
        )
    if settings.webhook_secret is None:
        raise ConfigError(
            "invalid configuration: OUTBOX_WEBHOOK_SECRET: required when OUTBOX_WEBHOOK_URL "
            "is set (the Standard Webhooks signing secret, whsec_...)"
        )
    secret = settings.webhook_secret.get_secret_value()
    if len(_decode_secret(secret)) < MIN_SECRET_BYTES:
        raise ConfigError(
            "invalid configuration: OUTBOX_WEBHOOK_SECRET: must be 'whsec_' followed by the "
            f"base64 of at least {MIN_SECRET_BYTES} random bytes (see docs/webhooks.md)"
        )
    return Endpoint(url=str(settings.webhook_url), secret=secret)


# --- statements ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delivery:
    """One row of ``outbox.webhook_deliveries``, as read."""

    id: UUID
    operation_id: UUID
    event: WebhookEvent
    payload: dict[str, Any]
    status: DeliveryStatus
    attempts: int
    next_attempt_at: datetime
    last_status: int | None
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> Delivery:
        """Build a snapshot from a mapping holding every column of the table."""
        values = {f.name: row[f.name] for f in fields(cls)}
        values["event"] = WebhookEvent(values["event"])
        values["status"] = DeliveryStatus(values["status"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping, as ``outbox webhooks list --json`` prints it."""
        data: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, datetime):
                value = _iso_utc(value)
            elif isinstance(value, UUID | enum.Enum):
                value = str(value)
            data[f.name] = value
        return data


@dataclass(frozen=True, slots=True)
class Claimed:
    """A delivery claimed for one attempt: what to send, and the lease that fences its outcome."""

    id: UUID
    operation_id: UUID
    event: WebhookEvent
    #: The body exactly as stored (``payload::text``): what is signed and sent, on every attempt.
    body: str
    #: Attempts made before this one.
    attempts: int
    #: ``next_attempt_at`` as the claim set it; the outcome is written only if it is unchanged.
    lease: datetime


_CLAIM_DUE = text(
    """
    WITH due AS (
        SELECT id FROM outbox.webhook_deliveries
        WHERE status = 'pending'
          AND next_attempt_at <= clock_timestamp()
          AND (CAST(:only AS uuid) IS NULL OR id = CAST(:only AS uuid))
        ORDER BY next_attempt_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox.webhook_deliveries AS d
    SET next_attempt_at = clock_timestamp() + make_interval(secs => :lease)
    FROM due WHERE d.id = due.id
    RETURNING d.id, d.operation_id, d.event, d.payload::text AS body, d.attempts,
              d.next_attempt_at AS lease
    """
)


def claim_due(
    executor: Executor, *, limit: int, lease_s: float, only: UUID | None = None
) -> list[Claimed]:
    """Lease up to ``limit`` due pending deliveries (or just ``only``), oldest due first.

    ``SKIP LOCKED`` lets deliverers claim disjoint rows; pushing ``next_attempt_at`` out by
    ``lease_s`` keeps them claimed after this short transaction commits, so no transaction
    stays open across an HTTP call. A deliverer that dies mid-send leaves the row to be
    claimed again once the lease has passed.
    """
    rows = executor.execute(_CLAIM_DUE, {"limit": limit, "lease": lease_s, "only": only})
    return [
        Claimed(
            id=row.id,
            operation_id=row.operation_id,
            event=WebhookEvent(row.event),
            body=row.body,
            attempts=row.attempts,
            lease=row.lease,
        )
        for row in rows
    ]


_DELIVERED = text(
    """
    UPDATE outbox.webhook_deliveries
    SET status = 'delivered', delivered_at = clock_timestamp(), attempts = attempts + 1,
        last_status = :status, last_error = NULL
    WHERE id = :id AND status = 'pending' AND next_attempt_at = :lease
    RETURNING attempts
    """
)


def record_delivered(executor: Executor, claimed: Claimed, *, status: int) -> int | None:
    """Mark a claimed delivery delivered; its attempt count, or ``None`` if the lease was lost."""
    row = executor.execute(
        _DELIVERED, {"id": claimed.id, "lease": claimed.lease, "status": status}
    ).first()
    return int(row.attempts) if row is not None else None


_FAILED = text(
    """
    UPDATE outbox.webhook_deliveries
    SET attempts = attempts + 1, last_status = :status, last_error = :error,
        next_attempt_at = clock_timestamp() + make_interval(secs => :retry_in),
        status = CASE WHEN created_at <= clock_timestamp() - make_interval(secs => :give_up)
                      THEN 'abandoned' ELSE 'pending' END
    WHERE id = :id AND status = 'pending' AND next_attempt_at = :lease
    RETURNING status, attempts
    """
)


def record_failed(
    executor: Executor,
    claimed: Claimed,
    *,
    status: int | None,
    error: str,
    retry_in_s: float,
    give_up_after_s: float,
) -> tuple[DeliveryStatus, int] | None:
    """Record a failed attempt: retry after ``retry_in_s``, or abandon the row once it is
    older than ``give_up_after_s`` (judged by the database). Returns the new status and
    attempt count, or ``None`` if the lease was lost to another deliverer.
    """
    row = executor.execute(
        _FAILED,
        {
            "id": claimed.id,
            "lease": claimed.lease,
            "status": status,
            "error": storable.text(error),  # it quotes the endpoint's answer
            "retry_in": retry_in_s,
            "give_up": give_up_after_s,
        },
    ).first()
    return (DeliveryStatus(row.status), int(row.attempts)) if row is not None else None


def list_deliveries(
    executor: Executor,
    *,
    status: DeliveryStatus | None = None,
    operation_id: UUID | None = None,
    limit: int = 50,
) -> list[Delivery]:
    """Deliveries, newest first."""
    t = webhook_deliveries.c
    # UUIDv7 ids only order by the millisecond; created_at tells apart rows of one statement.
    query = select(webhook_deliveries).order_by(t.created_at.desc(), t.id.desc()).limit(limit)
    if status is not None:
        query = query.where(t.status == status.value)
    if operation_id is not None:
        query = query.where(t.operation_id == operation_id)
    return [Delivery.from_row(row) for row in executor.execute(query).mappings()]
