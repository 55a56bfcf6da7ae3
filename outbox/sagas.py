"""Sagas: several operations that succeed together or are undone together (docs/sagas.md).

An agent opens a saga with :func:`saga` and adds its steps with :meth:`Saga.step`, each an
operation recorded through :func:`outbox.enqueue`'s own path (its checks, budgets and approval
policy), with an intent key derived from the saga key and the step name, and an optional
:class:`Compensate` (the tool call that undoes it). Both join the caller's transaction and
never commit. A step whose turn has not come is recorded *held*: the relay never publishes it
and no dispatcher sends it until the saga's driver releases it, once every step before it is
``confirmed``. A step refused makes the driver undo the confirmed steps before it, in reverse
order, each undo an operation of its own with a derived intent key, so a crash never undoes
anything twice. The rules are a pure table (:mod:`outbox.saga_rules`); the driver that applies
them, committing, is :func:`outbox.reconcilers.sagas.advance_saga_and_commit`, run by the
periodic sweep and nudged when a step's operation settles.

This module is the only writer of a saga's ``state`` (:func:`advance` and
:func:`cancel_saga`); an operation's state is still moved only by :mod:`outbox.transitions`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from outbox import api, sql, storable, transitions, webhooks
from outbox.canonical import NotCanonicalizable, canonical_json
from outbox.contracts import CONTRACTS
from outbox.db import translated
from outbox.errors import (
    IntentConflict,
    InvalidIntent,
    InvalidSagaRequest,
    NotCancellable,
    OutboxError,
    SagaNotFound,
    SagaNotRunning,
    StaleTransition,
)
from outbox.logs import Action as LogAction
from outbox.models import Executor, Operation, SagaRef, WebhookEvent, iso_utc, json_fields
from outbox.payloads import check_payload
from outbox.saga_rules import FINAL_SAGA_STATES, Decision, Kind, SagaState, StepFacts, decide
from outbox.segments import dot_segment_refusal, has_dot_segment
from outbox.sql.sagas import SagaRow, StepRow
from outbox.states import State
from outbox.storable import unstorable_text

__all__ = [
    "Compensate",
    "DeclaredSaga",
    "Saga",
    "SagaEvent",
    "SagaState",
    "SagaStep",
    "SagaSummary",
    "SagaView",
    "StepSpec",
    "advance",
    "cancel_saga",
    "compensation_intent_key",
    "compensation_payload",
    "declare_saga",
    "get_saga",
    "list_sagas",
    "saga",
    "step_intent_key",
]

log = logging.getLogger(__name__)

#: A saga key's longest length: its steps' intent keys (``saga:{key}:{name}:compensate``)
#: must fit :data:`outbox.api.MAX_INTENT_KEY_LENGTH`.
MAX_SAGA_KEY_LENGTH = 160
MAX_STEP_NAME_LENGTH = 64
MAX_GROUP_LENGTH = 64
#: What a compensation payload's strings may hold, replaced by the step's ``remote_ref``.
REMOTE_REF_PLACEHOLDER = "{remote_ref}"

#: Who moved a saga, as its events record it.
AGENT, OPERATOR, DRIVER = "agent", "operator", "driver"


@dataclass(frozen=True)
class Compensate:
    """The tool call that undoes a step once it is ``confirmed``: ``tool`` on ``target`` with
    ``payload``, in which the string ``"{remote_ref}"`` (anywhere inside a string value, at
    any depth) is replaced by the step's ``remote_ref``."""

    tool: str
    target: str
    payload: Mapping[str, Any] = field(hash=False)


def step_intent_key(saga_key: str, name: str) -> str:
    """The intent key of step ``name`` of saga ``saga_key``: ``saga:{len}:{key}:step:{name}``.

    The key's length comes first, so where it ends is never in doubt: ``saga:rel:a`` with
    step ``b`` and ``saga:rel`` with step ``a:b`` are two keys (in the form sagas opened
    before migration 0023 keep, ``saga:{key}:{name}``, they were one). In the saga's
    agent's scope, like every key of its operations.
    """
    return f"saga:{len(saga_key)}:{saga_key}:step:{name}"


def compensation_intent_key(saga_key: str, name: str) -> str:
    """The intent key of the compensation of step ``name``: ``saga:{len}:{key}:undo:{name}``
    (never a step's key: the word after the key tells them apart)."""
    return f"saga:{len(saga_key)}:{saga_key}:undo:{name}"


def compensation_payload(payload: Any, remote_ref: str | None) -> Any:
    """``payload`` with ``"{remote_ref}"`` replaced by ``remote_ref`` inside every string
    value, at any depth (keys are left as they are)."""
    if isinstance(payload, str):
        return payload.replace(REMOTE_REF_PLACEHOLDER, remote_ref or "")
    if isinstance(payload, Mapping):
        return {key: compensation_payload(value, remote_ref) for key, value in payload.items()}
    if isinstance(payload, list | tuple):
        return [compensation_payload(value, remote_ref) for value in payload]
    return payload


# --- the read model -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SagaStep:
    """One step of a saga as read: its declaration, its operation and its compensation."""

    position: int
    name: str
    #: Its parallel group (consecutive steps sharing one run together), or ``None``.
    group: str | None
    pivot: bool
    #: Its operation; ``None`` once pruned (only after the saga finished).
    operation_id: UUID | None
    #: Its operation's state (``None``: pruned).
    state: State | None
    remote_ref: str | None
    tool: str | None
    target: str | None
    #: The saga still holds it: never released, so never published nor sent.
    held: bool
    released_at: datetime | None
    #: The declared compensation, if any.
    compensate: Compensate | None
    #: The compensation's operation, once the saga started undoing this step.
    compensation_operation_id: UUID | None
    compensation_state: State | None
    compensation_remote_ref: str | None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping (``outbox sagas show --json``)."""
        data = json_fields(self)
        if self.compensate is not None:
            data["compensate"] = {
                "tool": self.compensate.tool,
                "target": self.compensate.target,
                "payload": dict(self.compensate.payload),
            }
        return data


@dataclass(frozen=True, slots=True)
class SagaEvent:
    """One line of a saga's audit trail: a move (``from_state`` != ``to_state``) or a note
    (a step released, a compensation recorded, a cancel)."""

    id: int
    at: datetime
    from_state: SagaState | None
    to_state: SagaState
    #: ``agent``, ``operator`` or ``driver``.
    actor: str
    reason: str
    detail: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping."""
        return json_fields(self)


@dataclass(frozen=True, slots=True)
class SagaView:
    """A saga as read by :func:`get_saga`: its state, its steps in order, its audit trail."""

    key: str
    state: SagaState
    #: Why it is where it is (what it waits for, what was refused, what a person must do).
    reason: str | None
    requested_by: str | None
    #: Who asked to cancel it (:func:`cancel_saga`), if anyone.
    cancelled_by: str | None
    created_at: datetime
    updated_at: datetime
    steps: tuple[SagaStep, ...]
    events: tuple[SagaEvent, ...]
    #: The agent whose saga key it is (``""``: the shared scope).
    agent: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping (``outbox sagas show KEY --json``)."""
        return {
            "key": self.key,
            "agent": self.agent,
            "state": self.state.value,
            "reason": self.reason,
            "requested_by": self.requested_by,
            "cancelled_by": self.cancelled_by,
            "created_at": iso_utc(self.created_at),
            "updated_at": iso_utc(self.updated_at),
            "steps": [s.to_dict() for s in self.steps],
            "events": [e.to_dict() for e in self.events],
        }


@dataclass(frozen=True, slots=True)
class SagaSummary:
    """A saga as listed by :func:`list_sagas`."""

    key: str
    state: SagaState
    reason: str | None
    requested_by: str | None
    steps: int
    created_at: datetime
    updated_at: datetime
    agent: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping (``outbox sagas list --json``)."""
        return json_fields(self)

    @property
    def position(self) -> SagaPosition:
        """Where a page ending with this saga ended: :func:`list_sagas`' ``after``."""
        return SagaPosition(self.created_at, self.key, self.agent)


@dataclass(frozen=True, slots=True)
class SagaPosition:
    """A place in :func:`list_sagas`' order (newest first, then by key and agent): a saga's
    ``created_at``, ``key`` and ``agent``."""

    created_at: datetime
    key: str
    agent: str = ""


@translated
def get_saga(session: Executor, saga_key: str, *, agent: str = api.SHARED_AGENT) -> SagaView | None:
    """``agent``'s saga with this key (its steps and their operations, its trail), or
    ``None``: the agent it was opened for (:func:`saga`'s ``agent``, else its
    ``requested_by``; default: the shared scope). Reads in the caller's transaction."""
    if not _storable(saga_key, agent):
        return None  # no saga can be stored under it
    ref = SagaRef(saga_key, agent)
    row = sql.sagas.get_saga(session, ref)
    if row is None:
        return None
    return _view(row, sql.sagas.steps_of(session, ref), sql.sagas.events_of(session, ref))


@translated
def agents_of_saga_key(session: Executor, saga_key: str) -> list[str]:
    """The agents that have a saga under ``saga_key``, by name: an operator's search (each
    agent's same key is a saga of its own). Reads in the caller's transaction."""
    return sql.sagas.agents_of_key(session, saga_key) if _storable(saga_key) else []


@translated
def list_sagas(
    session: Executor,
    *,
    state: SagaState | str | None = None,
    limit: int = 50,
    agent: str | None = None,
    after: SagaPosition | None = None,
) -> list[SagaSummary]:
    """Sagas, newest first, optionally only those in ``state`` and only ``agent``'s (an
    agent's own); at most ``limit``. ``after``: where the previous page ended (its last
    saga's :attr:`SagaSummary.position`), for the next one (keyset: no saga is skipped or
    listed twice as sagas are opened meanwhile). Reads in the caller's transaction.
    :class:`InvalidSagaRequest` names a bad argument."""
    if agent is not None and not isinstance(agent, str):
        raise InvalidSagaRequest("agent must be a string", field="agent")
    wanted: str | None = None
    if state is not None:
        try:
            wanted = SagaState(state).value
        except ValueError:
            known = ", ".join(s.value for s in SagaState)
            raise InvalidSagaRequest(
                f"unknown saga state {state!r}; one of: {known}", field="state"
            ) from None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidSagaRequest("limit must be a positive integer", field="limit")
    return [
        SagaSummary(
            key=listed.saga.key,
            state=SagaState(listed.saga.state),
            reason=listed.saga.reason,
            requested_by=listed.saga.requested_by,
            steps=listed.steps,
            created_at=listed.saga.created_at,
            updated_at=listed.saga.updated_at,
            agent=listed.saga.agent,
        )
        for listed in sql.sagas.list_sagas(
            session,
            state=wanted,
            limit=limit,
            agent=agent,
            after=None if after is None else (after.created_at, after.key, after.agent),
        )
    ]


def _view(row: SagaRow, steps: Sequence[StepRow], events: Sequence[Any]) -> SagaView:
    return SagaView(
        key=row.key,
        agent=row.agent,
        state=SagaState(row.state),
        reason=row.reason,
        requested_by=row.requested_by,
        cancelled_by=row.cancelled_by,
        created_at=row.created_at,
        updated_at=row.updated_at,
        steps=tuple(_step_view(s) for s in steps),
        events=tuple(
            SagaEvent(
                id=e.id,
                at=e.at,
                from_state=SagaState(e.from_state) if e.from_state is not None else None,
                to_state=SagaState(e.to_state),
                actor=e.actor,
                reason=e.reason,
                detail=e.detail,
            )
            for e in events
        ),
    )


def _step_view(step: StepRow) -> SagaStep:
    return SagaStep(
        position=step.position,
        name=step.name,
        group=step.grp,
        pivot=step.pivot,
        operation_id=step.operation_id,
        state=step.state,
        remote_ref=step.remote_ref,
        tool=step.tool,
        target=step.target,
        held=step.held,
        released_at=step.released_at,
        compensate=_declared(step),
        compensation_operation_id=step.compensation_operation_id,
        compensation_state=step.compensation_state,
        compensation_remote_ref=step.compensation_remote_ref,
    )


def _declared(step: StepRow) -> Compensate | None:
    if step.compensate_tool is None or step.compensate_target is None:
        return None
    return Compensate(step.compensate_tool, step.compensate_target, step.compensate_payload or {})


# --- the agent's side: open a saga, add steps -------------------------------------------------


class Saga:
    """A saga opened by :func:`saga` on the caller's session: add its steps with :meth:`step`.

    The handle is bound to the session it was opened with; its steps join that session's
    transaction. Its ``state`` is as read when it was opened (:func:`get_saga` reads it anew).
    """

    def __init__(self, session: Executor, row: SagaRow) -> None:
        self._session = session
        self.key: str = row.key
        #: The agent whose saga key it is; its steps' intent keys are that agent's too.
        self.agent: str = row.agent
        self.state: SagaState = SagaState(row.state)
        self.requested_by: str | None = row.requested_by
        self.created_at: datetime = row.created_at

    def __repr__(self) -> str:
        return f"Saga(key={self.key!r}, state={self.state.value!r})"

    @translated
    def step(
        self,
        name: str,
        *,
        tool: str,
        target: str,
        payload: Mapping[str, Any],
        compensate: Compensate | None = None,
        pivot: bool = False,
        group: str | None = None,
    ) -> Operation:
        """Add step ``name`` (or find it again) and return its operation; joins the session's
        transaction and never commits.

        The operation is recorded as :func:`outbox.enqueue` records one (the same checks:
        the tool's ``input_schema``, its budgets, its approval policy), under the intent key
        ``saga:{saga_key}:{name}``, with ``requested_by`` the saga's and ``metadata``
        ``{"saga": key, "saga_step": name}``. Steps run in the order they are added; steps
        added one after another with the same ``group`` run in parallel. A step whose turn
        has not come (an earlier step not ``confirmed`` yet) is recorded *held*: never
        published, never sent (nor expired, if it awaits approval) until the saga releases
        it; the first step, or one whose earlier steps are all confirmed, is due at once.

        ``compensate`` undoes the step once it is ``confirmed`` if a later step is refused;
        ``pivot=True`` marks a step that cannot be undone (it takes no ``compensate``): a
        refusal after a confirmed pivot leaves the saga ``needs_human`` and undoes nothing.
        A confirmed step without either is left as it is.

        Idempotent: the same step again (same name, tool, target, payload, compensation,
        pivot and group) returns its operation, whatever the saga's state, writing nothing;
        the same name with anything else different raises :class:`IntentConflict` naming
        what differs (``tool``, ``target``, ``payload``, ``compensate``, ``pivot``,
        ``group``). A new step on a saga no longer ``running`` raises :class:`SagaNotRunning`.
        Malformed arguments raise :class:`InvalidIntent` naming the field
        (``compensate.payload``...). Declare a saga's steps in one transaction: a saga whose
        committed steps are all confirmed is ``completed``, and takes no new step.
        """
        return _add_step(
            self._session,
            SagaRef(self.key, self.agent),
            _StepRequest(name, tool, target, payload, compensate, pivot, group),
        )


@translated
def saga(
    session: Executor,
    saga_key: str,
    *,
    requested_by: str | None = None,
    agent: str | None = None,
) -> Saga:
    """Open the saga ``saga_key``, creating it ``running`` if it does not exist; joins the
    caller's transaction and never commits (the saga exists if and only if the caller
    commits). Opening an existing saga loads it as it is, whatever its state.

    The key is ``agent``'s (default: ``requested_by``, else the shared scope), as an intent
    key is (:func:`outbox.enqueue`): another agent's same key is another saga, and its
    steps' operations are the agent's too. ``requested_by`` is recorded on a new saga and
    given to its steps' operations (budgets may count by it). :class:`InvalidSagaRequest`
    for a malformed key (``field`` ``saga_key``: a non-empty string of at most 160
    characters, no ``.`` or ``..`` path segment in any encoding (:mod:`outbox.segments`),
    no NUL or lone surrogate) or agent.
    """
    _check_key(saga_key)
    ref = SagaRef(saga_key, _agent(agent, requested_by))
    row = sql.sagas.create_saga(session, ref, requested_by=requested_by)
    if row is None:
        # Taken, possibly by a transaction that committed during our INSERT (invisible to
        # that statement's snapshot, visible to this one's).
        row = sql.sagas.get_saga(session, ref)
    if row is None:
        raise InvalidSagaRequest(
            f"saga {saga_key!r} is being created and removed concurrently; try again",
            field="saga_key",
        )
    return Saga(session, row)


@dataclass(frozen=True)
class StepSpec:
    """One step of :func:`declare_saga`: the arguments of :meth:`Saga.step`, as data."""

    name: str
    tool: str
    target: str
    payload: Mapping[str, Any]
    compensate: Compensate | None = None
    pivot: bool = False
    group: str | None = None


@dataclass(frozen=True)
class DeclaredSaga:
    """What :func:`declare_saga` did: the saga as it is now, and whether this call declared
    its steps (``False``: the same saga was declared already, nothing was written)."""

    saga: SagaView
    created: bool


#: Most steps one saga declares at once.
MAX_DECLARED_STEPS = 50


@translated
def declare_saga(
    session: Executor,
    saga_key: str,
    steps: Sequence[StepSpec],
    *,
    requested_by: str | None = None,
    agent: str | None = None,
) -> DeclaredSaga:
    """Open ``saga_key`` with exactly these steps, in this order, or find it again: a whole
    saga in one call, for callers that cannot hold a transaction open across
    :meth:`Saga.step` calls (the HTTP API). Joins the caller's transaction, never commits.

    A new saga is :func:`saga` then :meth:`Saga.step` for each step. The same declaration
    again by the same agent (same steps, same order) writes nothing and returns the saga as
    it is now (``created=False``), whatever its state; another agent's same key is another
    saga. Refused, with nothing written: ``IntentConflict`` when the agent's key names a
    saga of other steps (``differences`` ``("steps",)`` when their names or number differ,
    ``("steps[i].payload",)`` and the like when a step differs);
    ``InvalidIntent`` naming the step (``steps[i].name``, ``steps[i].payload.amount``);
    ``InvalidSagaRequest`` for the key or an empty or too long list (``steps``); and what
    :meth:`Saga.step` raises (``BudgetExceeded``...).
    """
    if not steps:
        raise InvalidSagaRequest("steps must be a non-empty list of steps", field="steps")
    if len(steps) > MAX_DECLARED_STEPS:
        raise InvalidSagaRequest(
            f"a saga declares at most {MAX_DECLARED_STEPS} steps, not {len(steps)}",
            field="steps",
        )
    names = [spec.name for spec in steps]
    for index, name in enumerate(names):
        if name in names[:index]:
            # Two steps of one name would be one step: the saga would not be what was sent.
            raise InvalidIntent(
                f"steps[{index}]: step name {name!r} is given twice; each step needs its own",
                field=f"steps[{index}].name",
            )
    handle = saga(session, saga_key, requested_by=requested_by, agent=agent)
    ref = SagaRef(saga_key, handle.agent)
    # Locked before its steps are read: concurrent declarations of one key take turns.
    row = sql.sagas.lock_saga(session, ref)
    if row is None:
        raise SagaNotFound(f"saga {saga_key!r} was removed concurrently", saga_key=saga_key)
    existing = [step.name for step in sql.sagas.steps_of(session, ref)]
    if existing and existing != names:
        raise IntentConflict(
            f"saga {saga_key!r} was declared with other steps ({', '.join(existing)}), not "
            f"({', '.join(map(str, names))}); nothing was written",
            intent_key=saga_key,
            operation_id=None,
            differences=("steps",),
        )
    for index, spec in enumerate(steps):
        try:
            handle.step(
                spec.name,
                tool=spec.tool,
                target=spec.target,
                payload=spec.payload,
                compensate=spec.compensate,
                pivot=spec.pivot,
                group=spec.group,
            )
        except IntentConflict as exc:
            where = tuple(f"steps[{index}].{name}" for name in exc.differences)
            raise IntentConflict(
                f"steps[{index}] ({spec.name!r}): {exc}", **(vars(exc) | {"differences": where})
            ) from None
        except InvalidIntent as exc:
            raise type(exc)(
                f"steps[{index}] ({spec.name!r}): {exc}",
                **(vars(exc) | {"field": f"steps[{index}].{exc.field}"}),
            ) from None
    view = get_saga(session, saga_key, agent=handle.agent)
    if view is None:  # locked above, in this transaction: not expected
        raise SagaNotFound(f"no saga {saga_key!r}", saga_key=saga_key)
    return DeclaredSaga(view, created=not existing)


@dataclass(frozen=True)
class _StepRequest:
    name: str
    tool: str
    target: str
    payload: Mapping[str, Any]
    compensate: Compensate | None
    pivot: bool
    group: str | None


def _add_step(session: Executor, ref: SagaRef, request: _StepRequest) -> Operation:
    _check_step(session, request)
    saga_key = ref.key
    row = sql.sagas.lock_saga(session, ref)
    if row is None:
        raise SagaNotFound(f"no saga {saga_key!r}", saga_key=saga_key)
    steps = sql.sagas.steps_of(session, ref)
    existing = next((s for s in steps if s.name == request.name), None)
    intent = api.Intent(
        request.tool,
        request.target,
        request.payload,
        # A step recorded already keeps the key it was recorded with (older sagas' form).
        intent_key=(
            existing.intent_key if existing is not None else step_intent_key(saga_key, request.name)
        ),
        metadata={"saga": saga_key, "saga_step": request.name},
        requested_by=row.requested_by,
        agent=row.agent,
    )
    if existing is not None:
        found = api.enqueue_intent(session, intent).operation  # IntentConflict if it differs
        _check_same_step(existing, request, found)
        return found
    if row.state != SagaState.RUNNING:
        raise SagaNotRunning(
            f"saga {saga_key!r} is {row.state}: step {request.name!r} cannot be added to it; "
            "nothing was written",
            saga_key=saga_key,
            state=SagaState(row.state),
            step=request.name,
        )
    joins_last = request.group is not None and bool(steps) and steps[-1].grp == request.group
    if request.group is not None and not joins_last and any(s.grp == request.group for s in steps):
        raise InvalidIntent(
            f"group {request.group!r} is closed: steps of one group must be added one after "
            "another",
            field="group",
        )
    if joins_last:
        # Beside its group's released steps, unless one was refused already: then it is held
        # and the saga's next pass cancels it with the other held steps.
        release_now = steps[-1].released_at is not None and not any(
            s.state in (State.FAILED, State.CANCELLED) for s in steps
        )
    else:
        release_now = all(s.state is State.CONFIRMED for s in steps)
    # A held step awaiting approval is announced when it is released, with its real expiry.
    enqueued = api.enqueue_intent(session, intent, announce_approval=release_now)
    if not enqueued.created:
        raise IntentConflict(
            f"intent key {intent.intent_key!r} already names operation {enqueued.operation.id}, "
            f"which is not a step of saga {saga_key!r}; nothing was written",
            intent_key=intent.intent_key,
            operation_id=enqueued.operation.id,
            differences=("saga",),
        )
    operation = enqueued.operation
    approval_ttl_s = None
    if not release_now:
        held = transitions.hold_for_saga(session, operation.id)
        approval_ttl_s = held.approval_ttl_s if held is not None else None
    compensate = request.compensate
    sql.sagas.insert_step(
        session,
        ref=ref,
        position=len(steps),
        name=request.name,
        intent_key=str(intent.intent_key),
        grp=request.group,
        pivot=request.pivot,
        operation_id=operation.id,
        compensate_tool=compensate.tool if compensate is not None else None,
        compensate_target=compensate.target if compensate is not None else None,
        compensate_payload=dict(compensate.payload) if compensate is not None else None,
        approval_ttl_s=approval_ttl_s,
        released=release_now,
    )
    sql.sagas.check_again_in(session, ref, delay_s=0)
    if release_now:
        return operation
    reread = sql.intents.get_operation(session, operation.id)
    return reread if reread is not None else operation


def _agent(agent: str | None, requested_by: str | None) -> str:
    """The agent a saga key belongs to: ``agent``, else ``requested_by``, else shared."""
    scope = agent if agent is not None else requested_by
    if scope is None:
        return api.SHARED_AGENT
    if not isinstance(scope, str) or len(scope) > api.MAX_AGENT_LENGTH:
        field = "agent" if agent is not None else "requested_by"
        raise InvalidSagaRequest(
            f"{field} must be a string of at most {api.MAX_AGENT_LENGTH} characters",
            field=field,
        )
    return scope


def _storable(*texts: object) -> bool:
    """Whether PostgreSQL can compare these: a NUL or a lone surrogate (from JSON's
    ``"\\ud800"``, over MCP) cannot be stored, so nothing is found under it."""
    return all(unstorable_text(t) is None for t in texts)


def _check_key(saga_key: Any) -> None:
    if not isinstance(saga_key, str) or not saga_key.strip():
        raise InvalidSagaRequest("saga_key must be a non-empty string", field="saga_key")
    if len(saga_key) > MAX_SAGA_KEY_LENGTH:
        raise InvalidSagaRequest(
            f"saga_key is {len(saga_key)} characters; at most {MAX_SAGA_KEY_LENGTH} are allowed",
            field="saga_key",
        )
    if not _storable(saga_key):
        raise InvalidSagaRequest(
            "saga_key holds a character PostgreSQL cannot store (NUL or a lone surrogate)",
            field="saga_key",
        )
    if has_dot_segment(saga_key):
        # The key is a path segment of the console's and the API's links and forms.
        raise InvalidSagaRequest(dot_segment_refusal("saga_key"), field="saga_key")


def _check_step(session: Executor, request: _StepRequest) -> None:
    name = request.name
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_STEP_NAME_LENGTH:
        raise InvalidIntent(
            f"step name must be a non-empty string of at most {MAX_STEP_NAME_LENGTH} characters",
            field="name",
        )
    if has_dot_segment(name):  # it is part of its operation's intent key
        raise InvalidIntent(dot_segment_refusal("step name"), field="name")
    if not isinstance(request.pivot, bool):
        raise InvalidIntent("pivot must be True or False", field="pivot")
    group = request.group
    if group is not None and (
        not isinstance(group, str) or not group.strip() or len(group) > MAX_GROUP_LENGTH
    ):
        raise InvalidIntent(
            f"group must be None or a non-empty string of at most {MAX_GROUP_LENGTH} characters",
            field="group",
        )
    compensate = request.compensate
    if compensate is None:
        return
    if not isinstance(compensate, Compensate):
        raise InvalidIntent(
            f"compensate must be an outbox.Compensate or None, not {type(compensate).__name__}",
            field="compensate",
        )
    if request.pivot:
        raise InvalidIntent(
            "a pivot step cannot be compensated: give it no compensate", field="compensate"
        )
    try:
        api._check_tool(compensate.tool)
        api._check_target(compensate.target)
        canonical = api._canonical_payload(compensate.payload)
        # Checked now, not when a later refusal needs the undo: a compensation its tool
        # would refuse could only end the saga in needs_human. What "{remote_ref}" will
        # become is judged then, substituted.
        contract = CONTRACTS.get(compensate.tool)
        if contract is not None and contract.input_schema is not None:
            check_payload(
                compensate.tool,
                contract.input_schema,
                json.loads(canonical),
                unresolved=REMOTE_REF_PLACEHOLDER,
            )
        if not CONTRACTS.loaded:  # the tools the deployment published say, as for a step
            api.check_published(
                session, compensate.tool, canonical, unresolved=REMOTE_REF_PLACEHOLDER
            )
    except InvalidIntent as exc:
        raise type(exc)(
            f"compensate: {exc}", **(vars(exc) | {"field": f"compensate.{exc.field}"})
        ) from None


def _canonical(payload: Any) -> bytes | None:
    try:
        return canonical_json(dict(payload))
    except (NotCanonicalizable, TypeError, ValueError):
        return None


def _check_same_step(existing: StepRow, request: _StepRequest, operation: Operation) -> None:
    declared = _declared(existing)
    given = request.compensate
    same_compensation = (declared is None) == (given is None) and (
        declared is None
        or given is None
        or (
            declared.tool == given.tool
            and declared.target == given.target
            and _canonical(declared.payload) == _canonical(given.payload)
        )
    )
    differences = tuple(
        name
        for name, same in (
            ("compensate", same_compensation),
            ("pivot", existing.pivot == request.pivot),
            ("group", existing.grp == request.group),
        )
        if not same
    )
    if differences:
        raise IntentConflict(
            f"saga step conflict: step {existing.name!r} of saga {existing.saga_key!r} was "
            f"declared with a different {', '.join(differences)}; nothing was written",
            intent_key=operation.intent_key,
            operation_id=operation.id,
            differences=differences,
        )


# --- moving a saga: the driver's pass and the agent's cancel -----------------------------------


@dataclass(frozen=True, slots=True)
class Advanced:
    """What one :func:`advance` did: the saga's state after it, and each action taken."""

    state: SagaState
    #: The decisions applied, in order (the last one a WAIT or NOTHING, or a MOVE).
    decisions: tuple[Decision, ...]
    #: The moved-into states, in order (for the driver's log).
    moves: tuple[SagaState, ...]


def advance(
    session: Executor,
    saga_key: str,
    *,
    agent: str = api.SHARED_AGENT,
    actor: str = DRIVER,
    skip_locked: bool = False,
) -> Advanced | None:
    """Apply the saga's decision table (:func:`outbox.saga_rules.decide`) until it says to
    wait, in the caller's transaction (never commits), under the saga row's lock.

    ``None``: no such saga, or (``skip_locked``) another transaction holds it (an agent
    adding a step, another pass): that one's commit decides, and the next pass sees it.
    Each saga move writes its event and, into ``compensated`` or ``needs_human``, its
    webhook delivery row, in this transaction.
    """
    ref = SagaRef(saga_key, agent)
    row = sql.sagas.lock_saga(session, ref, skip_locked=skip_locked)
    if row is None:
        return None
    decisions: list[Decision] = []
    moves: list[SagaState] = []
    limit = 8
    while len(decisions) < limit:
        steps = sql.sagas.steps_of(session, ref)
        limit = 4 * len(steps) + 8
        decision = decide(
            SagaState(row.state),
            [_facts(s) for s in steps],
            cancel_requested=row.cancelled_by is not None,
        )
        decisions.append(decision)
        if decision.kind is Kind.NOTHING:
            break
        if decision.kind is Kind.WAIT:
            if decision.reason != row.reason:
                sql.sagas.set_reason(session, ref, reason=storable.text(decision.reason))
            break
        if decision.kind is Kind.MOVE:
            assert decision.to_state is not None  # noqa: S101 -- a MOVE always names it
            row = _move(
                session,
                row,
                to_state=decision.to_state,
                reason=decision.reason,
                actor=actor,
                steps=steps,
            )
            moves.append(SagaState(row.state))
            if SagaState(row.state) in FINAL_SAGA_STATES:
                break
        elif decision.kind is Kind.RELEASE:
            _release(session, row, steps, decision, actor)
        elif decision.kind is Kind.CANCEL_HELD:
            _cancel_held(session, row, steps, decision, actor)
        elif decision.kind is Kind.COMPENSATE:
            escalated = _compensate(session, row, steps, decision, actor)
            if escalated is not None:  # it could not be recorded: a person decides
                if escalated.state != row.state:
                    moves.append(SagaState(escalated.state))
                row = escalated
                break
    return Advanced(SagaState(row.state), tuple(decisions), tuple(moves))


@translated
def cancel_saga(
    session: Executor,
    saga_key: str,
    *,
    by: str,
    reason: str,
    actor: str = AGENT,
    agent: str = api.SHARED_AGENT,
) -> SagaView:
    """Cancel a ``running`` saga; joins the caller's transaction and never commits.

    Its held steps are cancelled (they never ran), and so are released steps still
    ``planned`` or awaiting approval with no attempt; the saga moves to ``compensating``
    (who and why recorded) and undoes its ``confirmed`` steps in reverse order, as after a
    refusal, once every step in flight is decided; nothing applied, it ends ``cancelled``.
    ``actor`` is what its events record (``agent``, or ``operator`` from the CLI).

    Raises, writing nothing: :class:`InvalidSagaRequest` (``by`` or ``reason`` empty),
    :class:`SagaNotFound`, :class:`SagaNotRunning` (it finished, or is compensating or
    waiting for a person already).
    """
    who = _required_text(by, "by")
    why = _required_text(reason, "reason")
    ref = SagaRef(saga_key, agent)
    row = sql.sagas.lock_saga(session, ref) if _storable(saga_key, agent) else None
    if row is None:
        raise SagaNotFound(f"no saga {saga_key!r}", saga_key=saga_key)
    if row.state != SagaState.RUNNING:
        raise SagaNotRunning(
            f"saga {saga_key!r} is {row.state}: only a running saga can be cancelled; "
            "nothing was written",
            saga_key=saga_key,
            state=SagaState(row.state),
            step=None,
        )
    for step in sql.sagas.steps_of(session, ref):
        if step.operation_id is None or step.held:
            continue  # held steps: cancelled by the table below
        if step.state in (State.PLANNED, State.AWAITING_APPROVAL):
            _try_cancel(session, step.operation_id, step.state, f"saga {saga_key} cancelled")
    moved = sql.sagas.move_saga(
        session,
        ref,
        from_state=row.state,
        to_state=SagaState.COMPENSATING.value,
        actor=actor,
        reason=storable.text(f"cancelled by {who}: {why}"),
        detail={"by": who, "reason": why},
        cancelled_by=who,
    )
    assert moved is not None  # noqa: S101 -- under the row's lock, still running
    advance(session, saga_key, agent=agent, actor=actor)
    view = get_saga(session, saga_key, agent=agent)
    assert view is not None  # noqa: S101 -- locked by this transaction
    return view


def _required_text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidSagaRequest(f"{name} is required: a non-empty string", field=name)
    return value.strip()


def _facts(step: StepRow) -> StepFacts:
    return StepFacts(
        name=step.name,
        group=step.grp,
        state=step.state,
        held=step.held,
        pivot=step.pivot,
        compensable=step.compensate_tool is not None,
        compensation=step.compensation_state,
    )


def _by_name(steps: Sequence[StepRow], names: Sequence[str]) -> list[StepRow]:
    wanted = set(names)
    return [s for s in steps if s.name in wanted]


def _move(
    session: Executor,
    row: SagaRow,
    *,
    to_state: SagaState,
    reason: str,
    actor: str,
    steps: Sequence[StepRow],
) -> SagaRow:
    """Move the saga (compare-and-set under its lock), its event and webhook row with it."""
    reason = storable.text(reason)
    moved = sql.sagas.move_saga(
        session,
        row.ref,
        from_state=row.state,
        to_state=to_state.value,
        actor=actor,
        reason=reason,
    )
    if moved is None:  # cannot happen under the row lock; the next pass judges again
        return row
    event = {
        SagaState.COMPENSATED: WebhookEvent.SAGA_COMPENSATED,
        SagaState.NEEDS_HUMAN: WebhookEvent.SAGA_NEEDS_HUMAN,
    }.get(to_state)
    if event is not None:
        webhooks.record_saga_event(
            session,
            event,
            saga_key=row.key,
            data={
                "agent": row.agent,
                "state": to_state.value,
                "from_state": row.state,
                "reason": reason,
                "steps": [
                    {
                        "name": s.name,
                        "operation_id": str(s.operation_id) if s.operation_id else None,
                        "state": s.state.value if s.state is not None else None,
                        "remote_ref": s.remote_ref,
                        "compensation_operation_id": (
                            str(s.compensation_operation_id)
                            if s.compensation_operation_id
                            else None
                        ),
                        "compensation_state": (
                            s.compensation_state.value if s.compensation_state else None
                        ),
                    }
                    for s in steps
                ],
            },
            at=moved.updated_at,
        )
    log.info(
        "saga %s: %s -> %s: %s",
        row.key,
        row.state,
        to_state.value,
        reason,
        extra={"action": LogAction.SAGA_MOVED, "saga_key": row.key, "state": to_state.value},
    )
    return moved


def _release(
    session: Executor,
    row: SagaRow,
    steps: Sequence[StepRow],
    decision: Decision,
    actor: str,
) -> None:
    for step in _by_name(steps, decision.steps):
        if step.operation_id is None:
            continue
        state = transitions.release_for_saga(
            session, step.operation_id, approval_ttl_s=step.approval_ttl_s
        )
        if state is State.AWAITING_APPROVAL:
            released = sql.intents.get_operation(session, step.operation_id)
            if released is not None:  # its approval request, now that it can be acted on
                webhooks.record_approval_requested(session, released)
        sql.sagas.insert_note(
            session,
            row.ref,
            state=row.state,
            actor=actor,
            reason=f"step {step.name} released",
            detail={"step": step.name, "operation_id": str(step.operation_id)},
        )
        log.info(
            "saga %s: step %s released (%s)",
            row.key,
            step.name,
            state.value if state is not None else "moved on",
            extra={
                "action": LogAction.SAGA_STEP_RELEASED,
                "saga_key": row.key,
                "operation_id": str(step.operation_id),
            },
        )


def _cancel_held(
    session: Executor,
    row: SagaRow,
    steps: Sequence[StepRow],
    decision: Decision,
    actor: str,
) -> None:
    for step in _by_name(steps, decision.steps):
        if step.operation_id is None or step.state is None:
            continue
        cancelled = _try_cancel(
            session,
            step.operation_id,
            step.state,
            f"saga {row.key} is unwinding: step {step.name} will not run",
        )
        sql.sagas.insert_note(
            session,
            row.ref,
            state=row.state,
            actor=actor,
            reason=f"step {step.name} cancelled: never released"
            if cancelled
            else f"step {step.name} could not be cancelled",
            detail={"step": step.name, "operation_id": str(step.operation_id)},
        )
        if not cancelled:
            # Whatever moved it (a person, early): it is no longer held, so the table stops
            # asking; make sure it is not left waiting for a release that never comes.
            transitions.release_for_saga(
                session, step.operation_id, approval_ttl_s=step.approval_ttl_s
            )


def _try_cancel(session: Executor, operation_id: UUID, state: State, reason: str) -> bool:
    """Cancel an operation nobody sent (the agent's cancel), under a savepoint; whether it
    was cancelled (not: it moved on, or an attempt may have applied)."""
    try:
        with session.begin_nested():
            transitions.apply(
                session, transitions.cancel(operation_id, reason=reason, from_state=state)
            )
    except (StaleTransition, NotCancellable):
        return False
    return True


def _compensate(
    session: Executor,
    row: SagaRow,
    steps: Sequence[StepRow],
    decision: Decision,
    actor: str,
) -> SagaRow | None:
    """Record the compensation of the step ``decision`` names; the saga moved to
    ``needs_human`` when it cannot be recorded (refused by its checks or a budget), else
    ``None``."""
    (step,) = _by_name(steps, decision.steps)
    declared = _declared(step)
    assert declared is not None  # noqa: S101 -- the table compensates declared steps only
    intent = api.Intent(
        declared.tool,
        declared.target,
        compensation_payload(dict(declared.payload), step.remote_ref),
        intent_key=compensation_intent_key(row.key, step.name),
        metadata={"saga": row.key, "saga_compensates": step.name},
        requested_by=row.requested_by,
        agent=row.agent,
    )
    try:
        with session.begin_nested():
            operation = api.enqueue_intent(session, intent).operation
    except OutboxError as exc:
        reason = (
            f"{decision.reason}; the compensation of step {step.name} could not be recorded: "
            f"{storable.error_summary(exc)}"
        )
        if row.state == SagaState.NEEDS_HUMAN:
            if row.reason != reason:
                sql.sagas.set_reason(session, row.ref, reason=storable.text(reason))
            return row
        return _move(
            session, row, to_state=SagaState.NEEDS_HUMAN, reason=reason, actor=actor, steps=steps
        )
    sql.sagas.set_compensation(session, row.ref, step.position, operation.id)
    sql.sagas.insert_note(
        session,
        row.ref,
        state=row.state,
        actor=actor,
        reason=f"compensating step {step.name}",
        detail={"step": step.name, "compensation_operation_id": str(operation.id)},
    )
    log.info(
        "saga %s: compensating step %s with %s",
        row.key,
        step.name,
        operation.id,
        extra={
            "action": LogAction.SAGA_COMPENSATION_STARTED,
            "saga_key": row.key,
            "operation_id": str(operation.id),
        },
    )
    return None
