"""The API's request and response bodies, as pydantic models: what /openapi.json documents.

Requests are strict (no coercion, no unknown member): an agent in any language learns of a
typo at once. The checks the Python API makes (tool names, lengths, canonical JSON, sizes) are
not repeated here: :mod:`outbox.api` makes them, with the same words, answered as 422s.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any
from uuid import UUID

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from outbox.models import Event, Operation
from outbox.saga_rules import SagaState
from outbox.sagas import MAX_DECLARED_STEPS
from outbox.states import State
from outbox.storable import unstorable_text

_STRICT = ConfigDict(extra="forbid", strict=True)


#: The validation error type of text PostgreSQL cannot store.
UNSTORABLE_TEXT = "unstorable_text"


def _storable(value: Any) -> Any:
    """Refuse what PostgreSQL cannot store (a NUL, a lone surrogate), naming it: a 422, not
    an error from the database."""
    found = unstorable_text(value)
    if found is not None:
        shown = found.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
        # A type of its own: in a path or query parameter it is a 400, not a 422 (problems.py).
        raise PydanticCustomError(
            UNSTORABLE_TEXT,
            "holds a character PostgreSQL cannot store (NUL or a lone surrogate): {shown}",
            {"shown": repr(shown[:80])},
        )
    return value


#: Text the API stores or compares in SQL: no NUL, no lone surrogate.
Text = Annotated[str, AfterValidator(_storable)]
#: A JSON object the API stores: its keys and strings, likewise.
JsonObject = Annotated[dict[str, Any], AfterValidator(_storable)]


class EnqueueRequest(BaseModel):
    """``POST /v1/operations``: the intent; its key is the ``Idempotency-Key`` header."""

    model_config = _STRICT

    tool: Text = Field(description="A tool the deployment knows (docs/api.md, unknown tools).")
    target: Text = Field(description="What the tool acts on, e.g. a project or an account.")
    payload: JsonObject = Field(description="The tool's input: a JSON object, never changed.")
    metadata: JsonObject | None = Field(
        default=None, description="Free JSON kept with the operation (not sent)."
    )
    require_approval: bool = Field(
        default=False,
        description="Wait for an operator's approval before any send, whatever the tool says.",
    )


class CancelRequest(BaseModel):
    """``POST /v1/operations/{id}/cancel``."""

    model_config = _STRICT

    reason: Text | None = Field(default=None, description="Why, for the audit trail.")


class SagaCancelRequest(BaseModel):
    """``POST /v1/sagas/{key}/cancel``."""

    model_config = _STRICT

    reason: Text = Field(min_length=1, description="Why, for the saga's audit trail.")


class CompensateIn(BaseModel):
    """A step's undo: the tool call that reverses it once it is confirmed."""

    model_config = _STRICT

    tool: Text = Field(description="A tool the deployment knows.")
    target: Text
    payload: JsonObject = Field(
        description='Its payload; "{remote_ref}" in a string stands for the step\'s remote_ref.'
    )


class SagaStepIn(BaseModel):
    """One step of ``POST /v1/sagas``: ``outbox.Saga.step``'s arguments."""

    model_config = _STRICT

    name: Text = Field(
        description="Unique in the saga; its operation's intent key is saga:{saga_key}:{name}."
    )
    tool: Text = Field(description="A tool the deployment knows.")
    target: Text
    payload: JsonObject
    compensate: CompensateIn | None = Field(
        default=None, description="How to undo it if a later step is refused."
    )
    pivot: bool = Field(default=False, description="It cannot be undone (and takes no compensate).")
    group: Text | None = Field(
        default=None,
        description="Steps of one group, declared one after another, run in parallel.",
    )


class SagaDeclareRequest(BaseModel):
    """``POST /v1/sagas``: a whole saga, its steps in the order they run."""

    model_config = _STRICT

    saga_key: Text = Field(
        description="Names the saga across retries: the same key and steps return it again."
    )
    steps: list[SagaStepIn] = Field(min_length=1, max_length=MAX_DECLARED_STEPS)


class ApproveRequest(BaseModel):
    """``POST /v1/operations/{id}/approve``: bound to the payload the approver read."""

    model_config = _STRICT

    payload_hash: Text = Field(description="The operation's payload_hash, as the approver saw it.")
    note: Text | None = Field(default=None, description="Why, for the audit trail.")


class RejectRequest(BaseModel):
    """``POST /v1/operations/{id}/reject``."""

    model_config = _STRICT

    reason: Text = Field(description="Why, for the audit trail (required).")


class ResolveRequest(BaseModel):
    """``POST /v1/operations/{id}/resolve``: an operator's verdict (``outbox.resolve``)."""

    model_config = _STRICT

    applied: bool = Field(
        description="true: the effect exists at the remote (confirm it, with remote_ref); "
        "false: it does not (fail it, or replay it)."
    )
    remote_ref: Text | None = Field(
        default=None, description="With applied=true: the remote's id of the effect."
    )
    replay: bool = Field(
        default=False,
        description="With applied=false: send it again (same key, same payload) instead.",
    )
    note: Text = Field(description="What you checked and found, for the audit trail.")
    payload_hash: Text | None = Field(
        default=None, description="The payload hash you looked at; refused if different."
    )
    force: bool = Field(
        default=False,
        description="Allow applied=false before the tool's in-flight horizon has passed.",
    )


class OperationOut(BaseModel):
    """One operation, as recorded when it was read (``outbox ops show --json``)."""

    id: UUID
    intent_key: str
    tool: str
    target: str
    payload: dict[str, Any]
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
    intent_hash: str
    approval_required: bool
    approval_expires_at: datetime | None
    decided_by: str | None
    decided_at: datetime | None
    approved_payload_hash: str | None
    agent: str = Field(
        description="The agent whose intent key this is (an agent token's agent): the same "
        "key from another agent names another operation."
    )
    traceparent: str | None = Field(
        default=None,
        description="The W3C traceparent of the caller that enqueued it (null without one): "
        "every later stage's span joins that trace.",
    )
    tracestate: str | None = Field(default=None, description="The caller's W3C tracestate.")

    @classmethod
    def of(cls, operation: Operation) -> dict[str, Any]:
        """The JSON-ready mapping of ``operation`` (validated against this model by FastAPI)."""
        return operation.to_dict()


class OperationPage(BaseModel):
    """``GET /v1/operations``: newest first; ``next_cursor`` fetches the next page."""

    items: list[OperationOut]
    next_cursor: str | None = Field(
        description="Pass as ?cursor= for the next (older) page; null on the last page."
    )


class EventOut(BaseModel):
    """One line of an operation's audit trail."""

    id: int
    from_state: State | None
    to_state: State
    attempt: int
    actor: str
    reason: str
    detail: dict[str, Any] | None
    at: datetime

    @classmethod
    def of(cls, event: Event) -> dict[str, Any]:
        """The JSON-ready mapping of ``event``."""
        return event.to_dict()


class EventList(BaseModel):
    """``GET /v1/operations/{id}/events``: oldest first."""

    items: list[EventOut]


class CompensateOut(BaseModel):
    """A step's declared compensation: the tool call that undoes it."""

    tool: str
    target: str
    payload: dict[str, Any] = Field(
        description='Its payload; "{remote_ref}" in a string stands for the step\'s remote_ref.'
    )


class SagaStepOut(BaseModel):
    """One step of a saga: its declaration, its operation and its compensation's."""

    position: int
    name: str
    group: str | None = Field(description="Its parallel group, if any.")
    pivot: bool = Field(description="It cannot be undone.")
    operation_id: UUID | None = Field(description="Its operation (null once pruned).")
    state: State | None = Field(description="Its operation's state (null once pruned).")
    remote_ref: str | None
    tool: str | None
    target: str | None
    held: bool = Field(description="The saga still holds it: never released, never sent.")
    released_at: datetime | None
    compensate: CompensateOut | None
    compensation_operation_id: UUID | None = Field(
        description="The operation that undoes it, once the saga started undoing it."
    )
    compensation_state: State | None
    compensation_remote_ref: str | None


class SagaEventOut(BaseModel):
    """One line of a saga's audit trail: a move, or a note (from_state = to_state)."""

    id: int
    at: datetime
    from_state: SagaState | None
    to_state: SagaState
    actor: str = Field(description="agent, operator or driver.")
    reason: str
    detail: dict[str, Any] | None


class SagaOut(BaseModel):
    """``GET /v1/sagas/{key}``: a saga, its steps in order and its audit trail
    (``outbox sagas show --json``)."""

    key: str
    state: SagaState
    reason: str | None = Field(description="Why it is where it is.")
    requested_by: str | None
    cancelled_by: str | None
    created_at: datetime
    updated_at: datetime
    steps: list[SagaStepOut]
    events: list[SagaEventOut]


class SagaSummaryOut(BaseModel):
    """A saga as listed."""

    key: str
    state: SagaState
    reason: str | None
    requested_by: str | None
    steps: int
    created_at: datetime
    updated_at: datetime


class SagaList(BaseModel):
    """``GET /v1/sagas``: newest first, a page at a time."""

    items: list[SagaSummaryOut]
    next_cursor: str | None = Field(
        default=None, description="Pass as cursor for the next page; null on the last one."
    )


class ProblemOut(BaseModel):
    """An RFC 9457 problem document (``application/problem+json``)."""

    model_config = ConfigDict(extra="allow", title="Problem")

    type: str = Field(description="about:blank, or urn:agent-outbox:problem:<slug>.")
    title: str
    status: int
    detail: str
    instance: str | None = None
    field: str | None = Field(default=None, description="The request member at fault.")


class Health(BaseModel):
    """``/healthz`` and ``/readyz``."""

    status: str
    database: str | None = None
    schema_revision: str | None = None
    head: str | None = None
