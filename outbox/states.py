"""The operation state machine as data: states, actors, the allowed moves and their rules.

Each state says what is known about the remote effect and which component moves rows out of
it (DESIGN.md, "States"). :data:`ALLOWED` ties every permitted ``(from, to)`` move to the
actors that may make it; :data:`COLUMNS_FOR` says which columns a move into each state may
write. Pure: no database here. The moves themselves are made by :mod:`outbox.transitions`,
the only code that changes an operation's ``state``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from outbox.errors import TransitionNotAllowed


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
    #: The tool or the call requires a person's approval before any send: never published,
    #: never sent. Moved out by an operator (approve to ``planned``, reject to ``cancelled``),
    #: the sweep (``cancelled`` once its approval TTL has passed) or the agent (cancel).
    AWAITING_APPROVAL = "awaiting_approval"
    #: The agent withdrew it while no attempt could have reached the remote, or its approval
    #: was refused or expired. Terminal.
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
SETTLED_STATES = TERMINAL_STATES | {State.NEEDS_HUMAN, State.AWAITING_APPROVAL}
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
    # A person approved the payload (bound to its hash), refused it, the approval's TTL
    # passed (sweep), or the agent withdrew it.
    (_S.AWAITING_APPROVAL, _S.PLANNED): frozenset({_A.OPERATOR}),
    (_S.AWAITING_APPROVAL, _S.CANCELLED): frozenset({_A.OPERATOR, _A.SWEEP, _A.AGENT}),
    # The dispatcher's re-check: the worker's tool requires approval and the row, enqueued
    # before the tool's policy reached the database, has none.
    (_S.PLANNED, _S.AWAITING_APPROVAL): frozenset({_A.DISPATCHER}),
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


def check_remote_ref(
    from_state: State, to_state: State, actor: Actor, remote_ref: str | None
) -> None:
    """Raise :class:`TransitionNotAllowed` for a move into ``confirmed`` without a
    ``remote_ref``: a confirmed effect is always tied to the remote's identifier for it."""
    if to_state is State.CONFIRMED and not remote_ref:
        raise TransitionNotAllowed(
            "an operation can only be confirmed with a remote_ref",
            from_state=from_state,
            to_state=to_state,
            actor=actor,
        )


#: The columns a move into each state may write besides the ones its rules set
#: (DESIGN.md, the bookkeeping columns); a move given any other is refused.
COLUMNS_FOR: Mapping[State, frozenset[str]] = {
    State.PLANNED: frozenset(
        {
            "last_error",
            "available_in_s",
            "replay_window_s",
            "not_applied",
            "decided_by",
            "approved_payload_hash",
        }
    ),
    State.SENT: frozenset(),
    State.CONFIRMED: frozenset({"remote_ref", "result"}),
    State.FAILED: frozenset({"last_error", "result", "not_applied"}),
    State.UNKNOWN: frozenset({"last_error", "check_in_s"}),
    State.NEEDS_HUMAN: frozenset({"not_applied"}),
    State.AWAITING_APPROVAL: frozenset({"approval_ttl_s"}),
    State.CANCELLED: frozenset({"decided_by"}),
}

#: States that wait for a verdict: evidence that arrives late may still confirm them.
AWAITING_VERDICT = frozenset({State.UNKNOWN, State.NEEDS_HUMAN})


def may_take_late_evidence(state: State, attempts: int, evidence_attempt: int) -> bool:
    """Whether evidence that attempt ``evidence_attempt`` applied, arriving after the row
    moved on, may confirm a row now in ``state`` at ``attempts``: only while it still waits
    for a verdict about that same attempt (a later attempt, or a decision, wins)."""
    return state in AWAITING_VERDICT and attempts == evidence_attempt
