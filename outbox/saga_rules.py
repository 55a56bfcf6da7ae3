"""The saga decision table as a pure function (docs/sagas.md, "The decision table").

:func:`decide` reads a saga's state and its steps (each step's operation state, whether the
saga still holds it, whether it is a pivot, whether it declares a compensation and how that
compensation stands) and answers the one next thing to do. The driver
(:mod:`outbox.reconcilers.sagas`) does it and asks again, until the answer is to wait or the
saga is finished. No database here: the property tests check it against a model of their own.

The rules, in order:

* A finished saga (``completed``, ``compensated``, ``cancelled``): nothing.
* No step refused (``failed`` or ``cancelled``) and no cancel asked: the first *stage* (one
  step, or consecutive steps sharing a group) that is not all ``confirmed`` is the current
  one; its held steps are released; when every stage is confirmed the saga is ``completed``.
* A step refused, or a cancel asked: the saga *unwinds* (``compensating`` from then on).
  Held steps are cancelled (they never ran). A step whose outcome is not known yet (in
  flight, ``unknown``, ``needs_human``, awaiting approval) holds everything: nothing is
  compensated until it is decided, and then it counts as applied (``confirmed``) or not
  (``failed``). With every step decided: a ``confirmed`` pivot means nothing can be undone,
  so ``needs_human``; otherwise the ``confirmed`` steps that declare a compensation are
  undone in reverse order, one at a time (the next only once the previous compensation is
  ``confirmed``); a compensation that fails, is cancelled or needs a human makes the saga
  ``needs_human``. All undone: ``compensated`` (``cancelled`` when a cancel found nothing
  applied).
* A ``needs_human`` saga is judged again on every pass: once a person decides the operation
  that blocked it, it carries on (``compensating``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from outbox.states import State


class SagaState(enum.StrEnum):
    """Where a saga stands."""

    #: Its steps run in order; later steps are held until the earlier ones are confirmed.
    RUNNING = "running"
    #: A step was refused (or the saga cancelled): its confirmed steps are being undone.
    COMPENSATING = "compensating"
    #: Every step confirmed. Final.
    COMPLETED = "completed"
    #: A step was refused and every confirmed step before it undone. Final.
    COMPENSATED = "compensated"
    #: A person must decide: a refusal after a confirmed pivot, or a compensation that failed
    #: or needs a human. Judged again on every pass.
    NEEDS_HUMAN = "needs_human"
    #: Cancelled before anything was applied. Final.
    CANCELLED = "cancelled"


#: States nothing moves a saga out of.
FINAL_SAGA_STATES = frozenset({SagaState.COMPLETED, SagaState.COMPENSATED, SagaState.CANCELLED})

#: Operation states that say the step's effect is not known yet (or not decided yet).
_UNDECIDED = frozenset(
    {State.PLANNED, State.AWAITING_APPROVAL, State.SENT, State.UNKNOWN, State.NEEDS_HUMAN}
)
_REFUSED = frozenset({State.FAILED, State.CANCELLED})


@dataclass(frozen=True, slots=True)
class StepFacts:
    """What the table needs of one step, in saga order."""

    name: str
    #: The step's parallel group; consecutive steps sharing one form a stage.
    group: str | None
    #: Its operation's state; ``None`` when the operation is gone (pruned).
    state: State | None
    #: The saga still holds it: never released (so it never ran).
    held: bool = False
    pivot: bool = False
    #: It declares a compensation.
    compensable: bool = False
    #: Its compensation's operation state; ``None`` while none was created.
    compensation: State | None = None


class Kind(enum.StrEnum):
    """What :func:`decide` says to do."""

    #: Release ``steps`` (held): due now.
    RELEASE = "release"
    #: Cancel ``steps`` (held): they will never run.
    CANCEL_HELD = "cancel_held"
    #: Create the compensation of ``steps[0]``.
    COMPENSATE = "compensate"
    #: Move the saga to ``to_state`` with ``reason``.
    MOVE = "move"
    #: Nothing to do until an operation moves (``reason`` says which).
    WAIT = "wait"
    #: The saga is finished.
    NOTHING = "nothing"


@dataclass(frozen=True, slots=True)
class Decision:
    """One next action of a saga."""

    kind: Kind
    #: The steps it concerns (RELEASE, CANCEL_HELD, COMPENSATE), by name, in saga order
    #: (COMPENSATE: the one step).
    steps: tuple[str, ...] = ()
    to_state: SagaState | None = None
    reason: str = ""


def stages(steps: Sequence[StepFacts]) -> list[list[int]]:
    """The steps' positions grouped into stages: consecutive steps sharing a group run
    together; a step without a group is a stage of its own."""
    found: list[list[int]] = []
    for position, step in enumerate(steps):
        if found and step.group is not None and steps[found[-1][-1]].group == step.group:
            found[-1].append(position)
        else:
            found.append([position])
    return found


def decide(
    state: SagaState, steps: Sequence[StepFacts], *, cancel_requested: bool = False
) -> Decision:
    """The saga's one next action (see the module's docstring for the rules)."""
    if state in FINAL_SAGA_STATES:
        return Decision(Kind.NOTHING)
    refused = next((s for s in steps if s.state in _REFUSED), None)
    if refused is None and not cancel_requested:
        return _running(state, steps)
    return _unwinding(state, steps, refused, cancel_requested=cancel_requested)


def _running(state: SagaState, steps: Sequence[StepFacts]) -> Decision:
    gone = next((s for s in steps if s.state is None), None)
    if gone is not None:
        return _escalate(state, f"the operation of step {gone.name} is gone (pruned)")
    for stage in stages(steps):
        members = [steps[p] for p in stage]
        if all(s.state is State.CONFIRMED for s in members):
            continue
        held = tuple(s.name for s in members if s.held)
        if held:
            return Decision(Kind.RELEASE, steps=held)
        waiting = next(s for s in members if s.state is not State.CONFIRMED)
        return _wait(state, f"step {waiting.name} is {_state_name(waiting.state)}")
    if not steps:
        return Decision(Kind.WAIT, reason="no steps yet")
    return Decision(Kind.MOVE, to_state=SagaState.COMPLETED, reason="every step confirmed")


def _unwinding(  # noqa: PLR0911 -- one return per row of the table
    state: SagaState,
    steps: Sequence[StepFacts],
    refused: StepFacts | None,
    *,
    cancel_requested: bool,
) -> Decision:
    if cancel_requested:
        refused = None  # a cancel explains what follows it (it cancels steps itself)
    why = (
        f"step {refused.name} {_state_name(refused.state)}" if refused is not None else "cancelled"
    )
    if state is SagaState.RUNNING:
        # Unwinding from the moment a step is refused, even while another is still in
        # doubt: `outbox sagas list --state compensating` shows it, and its reason says
        # what it waits for.
        return Decision(Kind.MOVE, to_state=SagaState.COMPENSATING, reason=why)
    held = tuple(s.name for s in steps if s.held and s.state in _UNDECIDED)
    if held:
        return Decision(Kind.CANCEL_HELD, steps=held)
    gone = next((s for s in steps if s.state is None), None)
    if gone is not None:
        return _escalate(state, f"{why}; the operation of step {gone.name} is gone (pruned)")
    undecided = next((s for s in steps if s.state in _UNDECIDED), None)
    if undecided is not None:
        return _wait(
            state,
            f"{why}; waiting for step {undecided.name} ({_state_name(undecided.state)}) "
            "to be decided before compensating",
        )
    pivot = next((s for s in steps if s.pivot and s.state is State.CONFIRMED), None)
    if pivot is not None:
        reason = (
            f"step {refused.name} refused after pivot {pivot.name}: nothing is compensated"
            if refused is not None
            else f"cancelled after pivot {pivot.name}: nothing is compensated"
        )
        return _escalate(state, reason)
    to_undo = [s for s in reversed(steps) if s.state is State.CONFIRMED and s.compensable]
    for step in to_undo:
        if step.compensation is State.CONFIRMED:
            continue
        if step.compensation is None:
            # From needs_human too (its compensation could not be recorded before): once
            # recorded, the wait below resumes the saga.
            return Decision(Kind.COMPENSATE, steps=(step.name,), reason=why)
        if step.compensation in (State.FAILED, State.CANCELLED):
            return _escalate(
                state,
                f"{why}; the compensation of step {step.name} {_state_name(step.compensation)}",
            )
        if step.compensation is State.NEEDS_HUMAN:
            return _escalate(state, f"{why}; the compensation of step {step.name} needs a human")
        return _wait(
            state,
            f"{why}; waiting for the compensation of step {step.name} ({step.compensation.value})",
            resume=SagaState.COMPENSATING,
        )
    applied = any(s.state is State.CONFIRMED for s in steps)
    if cancel_requested and not applied:
        return Decision(
            Kind.MOVE, to_state=SagaState.CANCELLED, reason="cancelled: nothing applied"
        )
    done = "every confirmed step compensated" if to_undo else "nothing to compensate"
    return Decision(Kind.MOVE, to_state=SagaState.COMPENSATED, reason=f"{why}; {done}")


def _state_name(state: State | None) -> str:
    if state is None:
        return "gone"
    if state in _REFUSED:
        return f"was refused ({state.value})" if state is State.FAILED else "was cancelled"
    return state.value


def _escalate(state: SagaState, reason: str) -> Decision:
    """To a person; a saga already waiting for one waits on (its reason may change)."""
    if state is SagaState.NEEDS_HUMAN:
        return Decision(Kind.WAIT, reason=reason)
    return Decision(Kind.MOVE, to_state=SagaState.NEEDS_HUMAN, reason=reason)


def _wait(state: SagaState, reason: str, *, resume: SagaState | None = None) -> Decision:
    """Wait; a ``needs_human`` saga whose blocking operation was decided resumes first."""
    if state is SagaState.NEEDS_HUMAN and resume is not None:
        return Decision(Kind.MOVE, to_state=resume, reason=f"resumed: {reason}")
    return Decision(Kind.WAIT, reason=reason)
