"""Escalation webhooks, the core's half: which moves make which events, and their delivery rows.

:func:`record_for_move` runs inside every move (:func:`outbox.transitions.apply`), in the caller's
transaction: a move and its delivery rows commit together or not at all, so a committed
escalation cannot lose its webhook and a rolled-back one never sends one. The deliverer
(``outbox.reconcilers.webhooks``) sends the rows later, signed per Standard Webhooks; the row's id
is the ``webhook-id``, the same on every retry, so receivers can deduplicate.

A message never carries a secret, nor the operation's payload (it may hold personal data):
only the payload's hash; except ``approval_requested``, whose reader must see exactly the
payload they are asked to approve. The statements on ``outbox.webhook_deliveries`` are in
:mod:`outbox.sql.webhooks`.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from outbox import sql
from outbox.config import Settings, get_settings
from outbox.errors import ConfigError
from outbox.models import SAGA_EVENTS, Executor, Operation, WebhookEvent, iso_utc
from outbox.states import Actor, State

#: Standard Webhooks secrets are ``whsec_`` + base64; the convention asks for 24 to 64 bytes.
SECRET_PREFIX = "whsec_"  # noqa: S105 -- the format's prefix, not a secret
MIN_SECRET_BYTES = 24


def events_for_move(
    from_state: State, to_state: State, actor: Actor | None = None
) -> list[WebhookEvent]:
    """The events a move produces, before subscription; a move can produce two.

    ``needs_human -> confirmed`` is both ``resolved`` (the escalation's follow-up) and
    ``confirmed``. A move into ``awaiting_approval`` (the dispatcher's re-check) is
    ``approval_requested``; the sweep's ``awaiting_approval -> cancelled``,
    ``approval_expired``.
    """
    found: list[WebhookEvent] = []
    if to_state is State.AWAITING_APPROVAL:
        found.append(WebhookEvent.APPROVAL_REQUESTED)
    if from_state is State.AWAITING_APPROVAL and actor is Actor.SWEEP:
        found.append(WebhookEvent.APPROVAL_EXPIRED)
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


def message(
    event: WebhookEvent, operation: Operation, *, from_state: State, actor: Actor, reason: str
) -> dict[str, Any]:
    """The body of one webhook (Standard Webhooks' ``type`` / ``timestamp`` / ``data``).

    ``timestamp`` is the move's own instant (``updated_at``, the database clock). The
    operation's payload is left out on purpose: only its hash identifies it. Except in
    ``approval_requested``: the approver must see exactly what they approve (its hash is what
    the approve command binds to), with the approve and reject commands. With
    ``OUTBOX_CONSOLE_URL`` set, ``console_url`` links to the operation's console page.
    """
    body: dict[str, Any] = {
        "type": f"operation.{event.value}",
        "timestamp": iso_utc(operation.updated_at),
        "data": {
            "operation_id": str(operation.id),
            "intent_key": operation.intent_key,
            "agent": operation.agent,
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
    console = get_settings().console_url
    if console is not None:  # a link for the person reading the escalation (docs/console.md)
        body["data"]["console_url"] = f"{str(console).rstrip('/')}/operations/{operation.id}"
    if event in (WebhookEvent.APPROVAL_REQUESTED, WebhookEvent.APPROVAL_EXPIRED):
        expires = operation.approval_expires_at
        body["data"] |= {
            "requested_by": operation.requested_by,
            "approval_expires_at": iso_utc(expires) if expires is not None else None,
        }
    if event is WebhookEvent.APPROVAL_REQUESTED:
        body["data"] |= {
            "payload": operation.payload,
            "approve_command": (
                f"outbox ops approve {operation.id} --by NAME "
                f"--payload-hash {operation.payload_hash}"
            ),
            "reject_command": f"outbox ops reject {operation.id} --by NAME --reason TEXT",
        }
    return body


def subscribed_events(
    from_state: State, to_state: State, actor: Actor | None = None
) -> list[WebhookEvent]:
    """The events this move makes that are delivered here (none without a webhook URL).

    A move with any writes its delivery rows in the same transaction, so a caller that
    commits statements one by one (the dispatcher) wraps such a move in a transaction.
    """
    settings = get_settings()
    if settings.webhook_url is None:
        return []
    subscribed = set(settings.webhook_events)
    return [e for e in events_for_move(from_state, to_state, actor) if e.value in subscribed]


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
    events = subscribed_events(from_state, to_state, actor)
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
    sql.webhooks.insert_deliveries(executor, rows)


def record_approval_requested(executor: Executor, operation: Operation) -> None:
    """Write the ``approval_requested`` delivery of an operation just enqueued
    ``awaiting_approval``, in the caller's transaction (never commits); nothing when the
    event is not subscribed."""
    settings = get_settings()
    event = WebhookEvent.APPROVAL_REQUESTED
    if settings.webhook_url is None or event.value not in settings.webhook_events:
        return
    payload = message(
        event, operation, from_state=State.AWAITING_APPROVAL, actor=Actor.AGENT, reason="enqueued"
    )
    payload["data"]["from_state"] = None
    sql.webhooks.insert_deliveries(
        executor, [{"operation_id": operation.id, "event": event.value, "payload": payload}]
    )


def record_guard_event(
    executor: Executor,
    event: WebhookEvent,
    *,
    subject: str,
    data: dict[str, Any],
    at: datetime,
) -> bool:
    """Write the delivery of a guard event (``circuit_opened``, ``circuit_closed``,
    ``budget_exhausted``) about ``subject`` (a guard or budget key), in the caller's
    transaction (never commits). Whether a row was written: none when no webhook URL is set
    or the event is not subscribed.

    The body is ``{"type": "guard.<event>", "timestamp": at, "data": {"subject": ..., **data}}``;
    ``at`` is the database's instant of the change. ``data`` must be JSON and hold no secret
    and no payload (the guard rails only ever report keys, counts and times).
    """
    if event.about_an_operation:
        raise ValueError(f"{event.value} is about an operation, not a guard: see record_for_move")
    settings = get_settings()
    if settings.webhook_url is None or event.value not in settings.webhook_events:
        return False
    body = {
        "type": f"guard.{event.value}",
        "timestamp": iso_utc(at),
        "data": {"subject": subject, **data},
    }
    row = {"operation_id": None, "subject": subject, "event": event.value, "payload": body}
    sql.webhooks.insert_deliveries(executor, [row])
    return True


def record_saga_event(
    executor: Executor,
    event: WebhookEvent,
    *,
    saga_key: str,
    data: dict[str, Any],
    at: datetime,
) -> bool:
    """Write the delivery of a saga event (``saga_compensated``, ``saga_needs_human``) about
    the saga ``saga_key``, in the caller's transaction (never commits), as the saga's move
    is: the two commit together. Whether a row was written: none when no webhook URL is set
    or the event is not subscribed.

    The body is ``{"type": "saga.<compensated|needs_human>", "timestamp": at, "data":
    {"saga_key": ..., **data}}`` and the row's ``subject`` is ``saga:<key>``. ``data`` holds
    the saga's state, reason and steps (names, states, remote refs): never a payload.
    """
    if event not in SAGA_EVENTS:
        raise ValueError(f"{event.value} is not a saga event")
    settings = get_settings()
    if settings.webhook_url is None or event.value not in settings.webhook_events:
        return False
    body = {
        "type": f"saga.{event.value.removeprefix('saga_')}",
        "timestamp": iso_utc(at),
        "data": {"saga_key": saga_key, **data},
    }
    row = {
        "operation_id": None,
        "subject": f"saga:{saga_key}",
        "event": event.value,
        "payload": body,
    }
    sql.webhooks.insert_deliveries(executor, [row])
    return True


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
