"""Typed errors of the outbox core.

Every error the outbox raises on purpose derives from :class:`OutboxError`. Each class's
docstring is its default message; identifiers travel as attributes so callers never parse
a message. The CLI prints ``str(error)`` on one line and exits non-zero.
"""

from __future__ import annotations

from typing import Any


class OutboxError(Exception):
    """The outbox refused the request."""

    def __init__(self, message: str | None = None, **attributes: Any) -> None:
        super().__init__(message or (self.__doc__ or "").strip())
        for name, value in attributes.items():
            setattr(self, name, value)


class ConfigError(OutboxError):
    """A setting is invalid."""


class DatabaseUnavailable(OutboxError):
    """The database cannot be reached."""


class AsyncReplicas(OutboxError):
    """The database streams to standbys and none is synchronous: a failover to one may roll
    back a committed `sent` whose request already left, and the operation would be sent
    again. Make a standby synchronous (synchronous_standby_names), or set
    OUTBOX_ALLOW_ASYNC_REPLICAS=true to accept the risk.

    ``standbys`` and ``synchronous_standby_names`` are what the server reported.
    """

    standbys: int
    synchronous_standby_names: str


class BrokerUnavailable(OutboxError):
    """The broker cannot be reached or did not confirm a batch; nothing was marked published."""


class SchemaNotReady(OutboxError):
    """The outbox schema is missing or not at the latest revision; run `outbox db upgrade`."""


class InvalidIntent(OutboxError):
    """The intent is malformed; nothing was written.

    ``field`` names the offending argument (``tool``, ``target``, ``payload``, ``intent_key``,
    ``metadata``).
    """

    field: str


class PayloadTooLarge(InvalidIntent):
    """The payload is larger, as canonical JSON, than ``OUTBOX_MAX_PAYLOAD_BYTES``; nothing
    was written. ``size`` and ``limit`` are in bytes (the HTTP API answers 413)."""

    size: int
    limit: int


class PayloadInvalid(InvalidIntent):
    """The payload does not match its tool's declared ``input_schema``; nothing was written.

    ``field`` is the offending path (``payload.amount``, ``payload.items[2].sku``), ``keyword``
    the JSON Schema keyword it fails (``type``, ``required``, ``maximum``...). The message
    never quotes the payload's values.
    """

    keyword: str


class IntentConflict(OutboxError):
    """The intent key is already used by an operation with another tool, target or payload.

    ``intent_key`` is the reused key, ``agent`` the agent it belongs to (the caller's: no
    other agent's operation is ever compared), ``operation_id`` the existing operation, and
    ``differences`` the names of the fields that differ (a subset of ``tool``, ``target``,
    ``payload``); ``fields`` names them as the message does, down to the payload's own
    fields when the existing payload was at hand (``payload.amount``; else ``payload``).
    Nothing was written.
    """

    intent_key: str
    agent: str = ""
    operation_id: object
    differences: tuple[str, ...]
    fields: tuple[str, ...] = ()


class IntentAlreadyDone(OutboxError):
    """The intent key names an operation that finished and was pruned; nothing was written.

    Raised by ``enqueue`` (and ``enqueue_many``) when the same intent (key, tool, target and
    payload) is enqueued again after ``outbox db prune`` deleted its operation: it already
    happened, or was refused or cancelled, and must not happen twice. ``operation_id``,
    ``state`` (``confirmed``, ``failed`` or ``cancelled``), ``remote_ref`` and
    ``resolved_at`` are the pruned operation's; ``intent`` is the whole
    :class:`outbox.models.PrunedIntent`.
    """

    intent_key: str
    operation_id: object
    state: object
    remote_ref: str | None
    resolved_at: object
    intent: object


class BudgetExceeded(OutboxError):
    """The intent would take a budget over its limit within its window; nothing was written.

    ``budget`` names the budget, ``by`` what it counts by (``requested_by``,
    ``metadata.<key>``) and ``key`` the value (``""`` when the intent has none);
    ``window_s`` is the sliding window; ``measure`` is ``operations`` or ``cost``, ``limit``
    its maximum, ``used`` what the window holds, ``remaining`` what is left and ``asked`` what
    this intent needed (1 operation, or its cost). A re-enqueue of a recorded intent is never
    refused: it returns the existing operation.
    """

    budget: str
    key: str
    by: str
    window_s: float
    measure: str
    limit: float
    used: float
    remaining: float
    asked: float


class OperationNotFound(OutboxError):
    """No operation has this id."""

    operation_id: object


class TransitionError(OutboxError):
    """A state change was refused; nothing was written."""


class TransitionNotAllowed(TransitionError):
    """The state machine does not allow this actor to make this move.

    Carries ``from_state``, ``to_state`` and ``actor``.
    """

    from_state: object
    to_state: object
    actor: object


class StaleTransition(TransitionError):
    """The operation is no longer where the caller saw it (another component moved it first).

    Carries ``operation_id``, the ``expected`` state (and attempt), and the ``actual`` ones.
    """

    operation_id: object
    expected: tuple[object, int | None]
    actual: tuple[object, int]


class ReplayDeadlinePassed(StaleTransition):
    """The dedup window closed before the replay left: the replay deadline has passed."""


class SendDeadlinePassed(OutboxError):
    """The send deadline passed before the request left: nothing was sent.

    Raised by :meth:`ToolCall.check_send_deadline` (and the HTTP transport) at the last
    moment before the first byte; the dispatcher moves the attempt back to ``planned``
    ("not sent"). ``late_by_s``: how far past the deadline the check ran.
    """

    late_by_s: float


class NotCancellable(TransitionError):
    """The operation cannot be cancelled: an attempt may already have reached the remote."""

    operation_id: object


class WaitTimeout(OutboxError):
    """The operation did not settle before the timeout.

    ``operation`` holds its state when the wait gave up.
    """

    operation: object


class OperationBusy(OutboxError):
    """Another component is working on this operation right now; try again.

    ``operation_id`` names the operation and ``holder_pid`` the PostgreSQL backend holding
    its lock, when it could still be seen (``None`` otherwise). Nothing was written.
    """

    operation_id: object
    holder_pid: int | None


class ResolutionRefused(TransitionError):
    """The operator's resolution was refused; nothing was written.

    ``operation_id`` names the operation. A refusal about the request itself names the
    argument in ``field`` (``by``, ``note``, ``remote_ref``, ``replay``, ``payload_hash``,
    ``force``); otherwise ``field`` is ``None``. A refusal because the in-flight horizon has
    not passed carries ``retry_after_s``, the seconds until it will have.
    """

    operation_id: object
    field: str | None = None
    retry_after_s: float | None = None


class StaleResolution(ResolutionRefused, StaleTransition):
    """The operation moved on since the operator looked at it; show it again and decide anew.

    Also a :class:`StaleTransition`: ``expected`` is the state and attempt the operator saw
    (the state as ``None`` when only the attempt was given), ``actual`` what the row holds now.
    """


class ApprovalMismatch(TransitionError):
    """The payload hash given with the approval is not the operation's: the approver did not
    see this payload. Nothing was written.

    ``operation_id``, ``given`` (the hash the approver sent) and ``expected`` (the stored one).
    """

    operation_id: Any
    given: str
    expected: str


class AlreadyDecided(TransitionError):
    """The operation no longer waits for approval: someone decided it, it expired, or it moved
    on. Nothing was written.

    ``operation_id``; ``state`` (where it is now); ``decided_by`` and ``decided_at`` (the
    decision, when a person made one); ``expired_at`` (its approval's TTL end, when that is why).
    """

    operation_id: Any
    state: Any
    decided_by: str | None
    decided_at: Any
    expired_at: Any


class ApprovalRefused(TransitionError):
    """The approval or rejection is malformed (``field`` names it). Nothing was written."""

    operation_id: Any
    field: str


class TokenRefused(OutboxError):
    """The API token cannot be made as asked (``field`` names the argument: ``name``,
    ``scope``). Nothing was written."""

    field: str


class TokenNotFound(OutboxError):
    """No API token has this name."""

    name: str


class OperatorRefused(OutboxError):
    """The operator account cannot be made as asked (``field`` names the argument: ``name``,
    ``password``). Nothing was written."""

    field: str


class OperatorNotFound(OutboxError):
    """No operator account has this name."""

    name: str


class SagaNotRunning(OutboxError):
    """A new step was added to a saga that is no longer ``running`` (it completed, is
    compensating, was compensated or cancelled, or waits for a person); nothing was written.

    ``saga_key`` names the saga, ``state`` is its state now and ``step`` the refused step's
    name. Re-running a step already recorded with the same input is never refused: it
    returns the step's operation whatever the saga's state.
    """

    saga_key: str
    state: object
    step: str | None


class SagaNotFound(OutboxError):
    """No saga has this key."""

    saga_key: str


class InvalidSagaRequest(OutboxError):
    """A saga request is malformed (``field`` names the argument: ``saga_key``, ``state``,
    ``limit``, ``by``, ``reason``); nothing was written."""

    field: str
