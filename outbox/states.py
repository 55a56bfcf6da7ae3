"""The operation state machine: the only code that changes an operation's ``state``.

Each state says what is known about the remote effect and which component moves rows out of
it (DESIGN.md, "States"). :data:`ALLOWED` ties every permitted ``(from, to)`` move to the
actors that may make it; :func:`transition` is a compare-and-set on the state the caller saw
(and the attempt number, where an attempt is concerned) that appends the audit row to
``outbox.events`` in the same statement. A move that is not allowed, or whose CAS misses,
raises a typed error and writes nothing.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from uuid import UUID

from outbox import storable
from outbox.errors import (
    NotCancellable,
    OperationNotFound,
    ReplayDeadlinePassed,
    StaleTransition,
    TransitionNotAllowed,
)

if TYPE_CHECKING:
    from outbox.models import Executor, Operation


class State(enum.StrEnum):
    """Where an operation stands, and so what may happen to it next."""

    #: Intent committed with the agent's own transaction; nobody is sending it now.
    #: Moved out by a dispatcher (to ``sent``) or the agent (``cancelled``).
    PLANNED = "planned"
    #: A dispatcher committed that it is about to call the remote. Proves nothing about
    #: receipt. Moved out by that dispatcher, or by the sweep once it is lost.
    SENT = "sent"
    #: An effect exists at the remote, tied to this operation; ``remote_ref`` saved. Terminal.
    CONFIRMED = "confirmed"
    #: Authoritative: the remote refused and no earlier attempt may have applied, or an
    #: operator said so. Terminal.
    FAILED = "failed"
    #: An attempt's outcome cannot be determined yet. Moved out by the reconciler or an operator.
    UNKNOWN = "unknown"
    #: No conclusive lookup and no usable dedup contract, or a limit was reached.
    #: Moved out by an operator only (or by evidence that the effect applied).
    NEEDS_HUMAN = "needs_human"
    #: The agent withdrew it while no attempt could have reached the remote. Terminal.
    CANCELLED = "cancelled"


class Actor(enum.StrEnum):
    """The component making a move; recorded in every event."""

    AGENT = "agent"
    RELAY = "relay"
    DISPATCHER = "dispatcher"
    SWEEP = "sweep"
    RECONCILER = "reconciler"
    OPERATOR = "operator"
    #: Evidence that the effect applied (a lookup or a late outcome), whoever brings it.
    EVIDENCE = "evidence"


TERMINAL_STATES = frozenset({State.CONFIRMED, State.FAILED, State.CANCELLED})
#: States an operation waits in until a person or a terminal verdict moves it: what `wait()` awaits.
SETTLED_STATES = TERMINAL_STATES | {State.NEEDS_HUMAN}
LIVE_STATES = frozenset(State) - TERMINAL_STATES

_S, _A = State, Actor

#: Every permitted move and who may make it (DESIGN.md, "Allowed transitions").
ALLOWED: Mapping[tuple[State, State], frozenset[Actor]] = {
    (_S.PLANNED, _S.SENT): frozenset({_A.DISPATCHER}),
    (_S.PLANNED, _S.CANCELLED): frozenset({_A.AGENT}),
    # It cannot be dispatched at all: unknown tool, max_attempts reached, replay deadline passed.
    (_S.PLANNED, _S.NEEDS_HUMAN): frozenset({_A.DISPATCHER, _A.RELAY}),
    (_S.SENT, _S.CONFIRMED): frozenset({_A.DISPATCHER}),
    (_S.SENT, _S.FAILED): frozenset({_A.DISPATCHER}),
    (_S.SENT, _S.UNKNOWN): frozenset({_A.DISPATCHER, _A.SWEEP}),
    # Only when the request provably never left (refused connection, send deadline missed).
    (_S.SENT, _S.PLANNED): frozenset({_A.DISPATCHER}),
    (_S.SENT, _S.NEEDS_HUMAN): frozenset({_A.SWEEP}),
    (_S.UNKNOWN, _S.CONFIRMED): frozenset({_A.RECONCILER, _A.OPERATOR, _A.EVIDENCE}),
    (_S.UNKNOWN, _S.FAILED): frozenset({_A.RECONCILER, _A.OPERATOR}),
    (_S.UNKNOWN, _S.PLANNED): frozenset({_A.RECONCILER, _A.OPERATOR}),
    (_S.UNKNOWN, _S.NEEDS_HUMAN): frozenset({_A.RECONCILER}),
    (_S.NEEDS_HUMAN, _S.CONFIRMED): frozenset({_A.OPERATOR, _A.EVIDENCE}),
    (_S.NEEDS_HUMAN, _S.FAILED): frozenset({_A.OPERATOR}),
    (_S.NEEDS_HUMAN, _S.PLANNED): frozenset({_A.OPERATOR}),
}


def is_allowed(from_state: State, to_state: State, actor: Actor) -> bool:
    """Whether ``actor`` may move an operation from ``from_state`` to ``to_state``."""
    return actor in ALLOWED.get((from_state, to_state), frozenset())


def check_allowed(from_state: State, to_state: State, actor: Actor) -> None:
    """Raise :class:`TransitionNotAllowed` unless the move is in :data:`ALLOWED` for ``actor``."""
    if not is_allowed(from_state, to_state, actor):
        raise TransitionNotAllowed(
            f"{actor.value} may not move an operation from {from_state.value} to {to_state.value}",
            from_state=from_state,
            to_state=to_state,
            actor=actor,
        )


@dataclass(frozen=True, kw_only=True)
class Effects:
    """Column changes that ride along with a move; only the ones that make sense for it apply.

    ``None`` leaves a column as the rules of the move set it (see :func:`transition`).
    """

    #: The remote's identifier for the effect; required to enter ``confirmed``.
    remote_ref: str | None = None
    #: The remote's answer (JSON), kept for the operator.
    result: Any = None
    #: Why the last attempt or check did not succeed, for people.
    last_error: str | None = None
    #: Override the rule for ``maybe_applied`` (an authoritative "not applied" clears it).
    maybe_applied: bool | None = None
    #: Entering ``planned``: seconds before it becomes due again (backoff).
    available_in_s: float = 0.0
    #: Entering ``planned`` for a dedup replay: the replay must leave before
    #: ``first_sent_at`` + this many seconds (the window minus the safety margin).
    replay_window_s: float | None = None
    #: Entering ``unknown``: seconds before the reconciler's first check.
    check_in_s: float = 0.0


NO_EFFECTS = Effects()


def transition(
    executor: Executor,
    operation_id: UUID,
    *,
    from_state: State,
    to_state: State,
    actor: Actor,
    reason: str,
    attempt: int | None = None,
    effects: Effects = NO_EFFECTS,
    detail: Mapping[str, Any] | None = None,
) -> Operation:
    """Move one operation from ``from_state`` to ``to_state`` and record why.

    A compare-and-set on the state the caller saw, and on ``attempt`` when given (a write
    about attempt *k* must not land on attempt *k+1*). The event row is appended by the same
    statement, inside the caller's transaction: this function never commits.

    Raises :class:`TransitionNotAllowed` for a move the table forbids to ``actor``,
    :class:`StaleTransition` when the row is no longer where the caller saw it,
    :class:`ReplayDeadlinePassed` when a replay would leave after its deadline,
    :class:`NotCancellable` when a cancel meets an attempt that may have applied, and
    :class:`OperationNotFound`. In every one of these cases nothing is written.

    ``reason``, ``detail`` and the remote's values in ``effects`` are made storable first
    (:mod:`outbox.storable`): a NUL byte in a remote's answer must not make the move raise.
    """
    # Deferred: statements imports the table definitions, which import this module's enums.
    from outbox import statements, webhooks  # noqa: PLC0415

    check_allowed(from_state, to_state, actor)
    if to_state is State.CONFIRMED and not effects.remote_ref:
        raise TransitionNotAllowed(
            "an operation can only be confirmed with a remote_ref",
            from_state=from_state,
            to_state=to_state,
            actor=actor,
        )
    reason = storable.text(reason)
    effects = _storable_effects(effects)
    if detail is not None:
        detail = storable.json_mapping(detail)
    moved = statements.move(
        executor,
        operation_id,
        from_state=from_state,
        to_state=to_state,
        actor=actor,
        reason=reason,
        attempt=attempt,
        effects=effects,
        detail=detail,
    )
    if moved is not None:
        webhooks.record_for_move(
            executor, moved, from_state=from_state, to_state=to_state, actor=actor, reason=reason
        )
        return moved
    raise _why_missed(executor, operation_id, from_state, to_state, attempt)


def _storable_effects(effects: Effects) -> Effects:
    """``effects`` with its remote-supplied values made storable (the same object if none)."""
    if effects.remote_ref is None and effects.result is None and effects.last_error is None:
        return effects
    return dataclasses.replace(
        effects,
        remote_ref=storable.optional_text(effects.remote_ref),
        result=storable.json_value(effects.result) if effects.result is not None else None,
        last_error=storable.optional_text(effects.last_error),
    )


def _why_missed(
    executor: Executor,
    operation_id: UUID,
    from_state: State,
    to_state: State,
    attempt: int | None,
) -> Exception:
    from outbox.sql import intents  # noqa: PLC0415

    current = intents.get_operation(executor, operation_id)
    if current is None:
        return OperationNotFound(f"no operation {operation_id}", operation_id=operation_id)
    where_seen = current.state is from_state and attempt in (None, current.attempts)
    if where_seen and to_state is State.SENT:
        return ReplayDeadlinePassed(
            f"operation {operation_id}: the dedup window closed before the replay left "
            f"(replay deadline {current.replay_deadline})",
            operation_id=operation_id,
            expected=(from_state, attempt),
            actual=(current.state, current.attempts),
        )
    if where_seen and to_state is State.CANCELLED:
        return NotCancellable(
            f"operation {operation_id} cannot be cancelled: attempt {current.attempts} may "
            "have reached the remote; resolve it instead",
            operation_id=operation_id,
        )
    expected = from_state.value + (f" at attempt {attempt}" if attempt is not None else "")
    return StaleTransition(
        f"operation {operation_id} is {current.state.value} at attempt {current.attempts}, "
        f"not {expected}; nothing was changed",
        operation_id=operation_id,
        expected=(from_state, attempt),
        actual=(current.state, current.attempts),
    )
