"""Read-only snapshots of rows: what the API hands back.

An :class:`Operation` is a frozen copy, not a live ORM object, so no caller can change a
state by assigning to an attribute: states change only through :mod:`outbox.transitions`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeAlias
from uuid import UUID

from outbox.states import SETTLED_STATES, TERMINAL_STATES, State

if TYPE_CHECKING:
    from sqlalchemy import Connection
    from sqlalchemy.orm import Session

    #: Anything that can run a statement in the caller's transaction.
    Executor: TypeAlias = Session | Connection


def __getattr__(name: str) -> Any:
    """``Executor`` built on first use: the enums here (``TokenScope``, ``DeliveryStatus``)
    are option types of the CLI, whose ``--help`` then imports no SQLAlchemy (issue 33)."""
    if name == "Executor":
        from sqlalchemy import Connection  # noqa: PLC0415
        from sqlalchemy.orm import Session  # noqa: PLC0415

        return Session | Connection
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


@dataclass(frozen=True, slots=True)
class Operation:
    """One consequential action, as recorded at the moment it was read."""

    id: UUID
    intent_key: str
    tool: str
    target: str
    payload: Any
    payload_hash: str
    state: State
    attempts: int
    checks: int
    maybe_applied: bool
    remote_ref: str | None
    result: Any
    last_error: str | None
    metadata: dict[str, Any]
    requested_by: str | None
    created_at: datetime
    updated_at: datetime
    available_at: datetime
    published_at: datetime | None
    first_sent_at: datetime | None
    sent_at: datetime | None
    next_check_at: datetime | None
    replay_deadline: datetime | None
    resolved_at: datetime | None
    attempt_budget_base: int
    #: sha256 of (tool, target, payload_hash), written at enqueue (the dispatcher checks it).
    intent_hash: str
    #: Whether a person must approve this payload before any send (the tool or the call said so).
    approval_required: bool = False
    #: When an approval nobody gave stops being possible (database clock; the sweep cancels it).
    approval_expires_at: datetime | None = None
    #: Who approved or rejected it, and when (also in its events).
    decided_by: str | None = None
    decided_at: datetime | None = None
    #: The payload hash the approver saw: set by an approval, equal to ``payload_hash``.
    approved_payload_hash: str | None = None
    #: The agent whose intent key this is (``""``: the deployment's shared scope): the same
    #: key from another agent names another operation.
    agent: str = ""
    #: The W3C trace context of the caller that enqueued it (``None`` without a caller's
    #: trace): every later stage's span joins that trace (docs/observability.md).
    traceparent: str | None = None
    tracestate: str | None = None

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Operation:
        """Build a snapshot from a mapping holding every column of ``outbox.operations``."""
        values = {field.name: row[field.name] for field in fields(cls)}
        values["state"] = State(values["state"])
        return cls(**values)

    @property
    def attempts_in_budget(self) -> int:
        """Attempts that count against the tool's ``max_attempts`` (an operator's replay
        starts a fresh budget)."""
        return self.attempts - self.attempt_budget_base

    @property
    def is_terminal(self) -> bool:
        """Confirmed, failed or cancelled: nothing will ever move it again."""
        return self.state in TERMINAL_STATES

    @property
    def is_settled(self) -> bool:
        """Terminal, or waiting for a person: no component will move it on its own."""
        return self.state in SETTLED_STATES

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping (ids and times as strings), as ``--json`` prints it."""
        data: dict[str, Any] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, datetime):
                value = _iso(value)
            elif isinstance(value, UUID | State):
                value = str(value)
            data[field.name] = value
        return data


@dataclass(frozen=True, slots=True)
class IntentKey:
    """An intent key in its agent's scope: together they name one operation."""

    #: The agent (``""``: the deployment's shared scope).
    agent: str
    key: str


@dataclass(frozen=True, slots=True)
class SagaRef:
    """A saga's identity: its key in its agent's scope (another agent's same key is another
    saga)."""

    key: str
    #: The agent (``""``: the deployment's shared scope).
    agent: str = ""


@dataclass(frozen=True, slots=True)
class Event:
    """One line of an operation's audit trail in ``outbox.events``."""

    id: int
    operation_id: UUID
    from_state: State | None
    to_state: State
    attempt: int
    actor: str
    reason: str
    detail: dict[str, Any] | None
    at: datetime

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Event:
        """Build an event from a mapping holding every column of ``outbox.events``."""
        from_state = row["from_state"]
        return cls(
            id=row["id"],
            operation_id=row["operation_id"],
            from_state=State(from_state) if from_state is not None else None,
            to_state=State(row["to_state"]),
            attempt=row["attempt"],
            actor=row["actor"],
            reason=row["reason"],
            detail=row["detail"],
            at=row["at"],
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping, as ``ops show --json`` prints it."""
        return {
            "id": self.id,
            "from_state": str(self.from_state) if self.from_state is not None else None,
            "to_state": str(self.to_state),
            "attempt": self.attempt,
            "actor": self.actor,
            "reason": self.reason,
            "detail": self.detail,
            "at": _iso(self.at),
        }


@dataclass(frozen=True, slots=True)
class PrunedIntent:
    """What is kept of an operation deleted by retention (``outbox.pruned_intents``): enough
    to tell a re-enqueue of its intent key that it was already done, never its payload."""

    intent_key: str
    operation_id: UUID
    tool: str
    target: str
    payload_hash: str
    state: State
    remote_ref: str | None
    attempts: int
    created_at: datetime
    first_sent_at: datetime | None
    resolved_at: datetime
    pruned_at: datetime
    #: The agent whose key it was (the one that asked, for a row of ``all_agents``).
    agent: str = ""
    #: Pruned before agents were recorded: its key is done for every agent.
    all_agents: bool = False

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> PrunedIntent:
        """Build one from a mapping holding every column of ``outbox.pruned_intents``."""
        values = {field.name: row[field.name] for field in fields(cls)}
        values["state"] = State(values["state"])
        return cls(**values)


def iso_utc(moment: datetime) -> str:
    """An instant as ISO 8601 in UTC, ``Z``-suffixed (as webhooks and their rows print it)."""
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def json_fields(record: Any) -> dict[str, Any]:
    """A dataclass's fields as a JSON-ready mapping: instants as :func:`iso_utc`, ids and
    enums as strings, the rest as they are (the ``--json`` output of the CLI's lists)."""
    data: dict[str, Any] = {}
    for f in fields(record):
        value = getattr(record, f.name)
        if isinstance(value, datetime):
            value = iso_utc(value)
        elif isinstance(value, UUID | enum.Enum):
            value = str(value)
        data[f.name] = value
    return data


class WebhookEvent(enum.StrEnum):
    """What a webhook reports; its ``type`` is ``operation.<event>``, or ``guard.<event>`` for
    the guard rails' events."""

    #: The operation entered ``needs_human``: an operator must decide.
    NEEDS_HUMAN = "needs_human"
    #: The operation left ``needs_human``: the follow-up of an escalation, whatever its verdict.
    RESOLVED = "resolved"
    #: The operation entered ``confirmed`` (opt-in).
    CONFIRMED = "confirmed"
    #: The operation entered ``failed`` (opt-in).
    FAILED = "failed"
    #: The operation waits for a person's approval before any send (``awaiting_approval``).
    APPROVAL_REQUESTED = "approval_requested"
    #: Nobody approved it within its TTL: the sweep cancelled it.
    APPROVAL_EXPIRED = "approval_expired"
    #: A circuit breaker opened: a tool (or tool and target) is failing; its operations wait.
    CIRCUIT_OPENED = "circuit_opened"
    #: A circuit breaker closed again: its probe succeeded, or an operator reset it.
    CIRCUIT_CLOSED = "circuit_closed"
    #: A budget has been used up for one key (once per key and window).
    BUDGET_EXHAUSTED = "budget_exhausted"
    #: A saga undid every applied step: it ended ``compensated`` (``type`` ``saga.compensated``).
    SAGA_COMPENSATED = "saga_compensated"
    #: A saga needs a person: a refusal after its pivot, or a compensation that failed or
    #: itself needs a human (``type`` ``saga.needs_human``).
    SAGA_NEEDS_HUMAN = "saga_needs_human"

    @property
    def about_an_operation(self) -> bool:
        """True for events about one operation (``type`` ``operation.<event>``); the guard
        events are about a guard or budget key (``guard.<event>``, ``subject``), the saga
        events about a saga (``saga.<event>``, ``subject`` its key)."""
        return self not in GUARD_EVENTS and self not in SAGA_EVENTS


#: The events about a guard or budget key rather than one operation.
GUARD_EVENTS = frozenset(
    {WebhookEvent.CIRCUIT_OPENED, WebhookEvent.CIRCUIT_CLOSED, WebhookEvent.BUDGET_EXHAUSTED}
)

#: The events about a saga rather than one operation.
SAGA_EVENTS = frozenset({WebhookEvent.SAGA_COMPENSATED, WebhookEvent.SAGA_NEEDS_HUMAN})


class DeliveryStatus(enum.StrEnum):
    """Where a delivery stands; only ``pending`` rows are ever sent."""

    #: Not delivered yet; sent when ``next_attempt_at`` has passed.
    PENDING = "pending"
    #: The receiver answered 2xx. Final.
    DELIVERED = "delivered"
    #: Still failing after the give-up period. Final; the operation itself is untouched.
    ABANDONED = "abandoned"


@dataclass(frozen=True, slots=True)
class Delivery:
    """One row of ``outbox.webhook_deliveries``, as read."""

    id: UUID
    #: The operation it reports on; ``None`` for a guard event (then ``subject`` says what).
    operation_id: UUID | None
    event: WebhookEvent
    payload: dict[str, Any]
    status: DeliveryStatus
    attempts: int
    next_attempt_at: datetime
    last_status: int | None
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None
    #: What a guard event is about (a guard or budget key); ``None`` for an operation's.
    subject: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> Delivery:
        """Build a snapshot from a mapping holding every column of the table."""
        values = {f.name: row[f.name] for f in fields(cls)}
        values["event"] = WebhookEvent(values["event"])
        values["status"] = DeliveryStatus(values["status"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping, as ``outbox webhooks list --json`` prints it."""
        return json_fields(self)


class TokenScope(enum.StrEnum):
    """What an API token may do (docs/api.md, "Auth")."""

    #: Enqueue, and read and wait for the operations it enqueued (``requested_by`` = its name).
    AGENT = "agent"
    #: Read every operation; approve, reject, resolve and cancel.
    OPERATOR = "operator"


@dataclass(frozen=True, slots=True)
class ApiToken:
    """One bearer token of the HTTP API, as ``outbox.api_tokens`` holds it: never its hash."""

    id: UUID
    #: The identity the API records (``requested_by``, the decider); unique for good.
    name: str
    scope: TokenScope
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None
    #: The agent it speaks for: the scope of its intent keys (its name unless made with
    #: ``--agent``: several tokens of one agent share its operations).
    agent: str

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> ApiToken:
        """Build one from a mapping holding the table's columns but the hash."""
        values = {f.name: row[f.name] for f in fields(cls)}
        values["scope"] = TokenScope(values["scope"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping, as ``outbox tokens list --json`` prints it."""
        return json_fields(self)
