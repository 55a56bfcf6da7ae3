"""What a person can do about a saga, read from :class:`outbox.sagas.SagaView`: the
operations that hold it (a step or a compensation whose outcome a person must decide), and
what is left to do by hand. Shared by ``outbox sagas show`` and the console's saga page, so
both say the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from uuid import UUID

from outbox.saga_rules import SagaState
from outbox.states import State

if TYPE_CHECKING:
    from outbox.sagas import SagaView

__all__ = ["STATE_HELP", "Blocker", "blockers"]

#: One line per saga state: what it means, and what an operator does about it.
STATE_HELP: dict[SagaState, str] = {
    SagaState.RUNNING: (
        "its steps run in order; a later step is held until the ones before it are confirmed. "
        "Nothing to do; `cancel` undoes its confirmed steps and stops the rest."
    ),
    SagaState.COMPENSATING: (
        "a step was refused (or the saga cancelled): its confirmed steps are being undone in "
        "reverse order, each undo an operation of its own. Nothing to do unless a step or an "
        "undo waits for a person (`show` names it)."
    ),
    SagaState.COMPLETED: "every step confirmed. Final.",
    SagaState.COMPENSATED: "a step was refused and every confirmed step before it undone. Final.",
    SagaState.NEEDS_HUMAN: (
        "a person must act. If an operation holds it (a compensation in needs_human), resolve "
        "that operation (`outbox ops show ID`, then `outbox ops resolve`, or its console page): "
        "the saga carries on at its next pass. If an undo could not be recorded (its checks or a "
        "budget refused it), fix that: every pass tries again. If a compensation failed, or a "
        "step was refused after a confirmed pivot, nothing in the outbox can undo it: undo by "
        "hand what must be undone; the saga stays needs_human, as the record."
    ),
    SagaState.CANCELLED: "cancelled before anything was applied. Final.",
}

#: Operation states a person decides (``outbox ops resolve``).
_RESOLVABLE = frozenset({State.UNKNOWN, State.NEEDS_HUMAN})
_REFUSED = frozenset({State.FAILED, State.CANCELLED})


@dataclass(frozen=True, slots=True)
class Blocker:
    """An operation of the saga that waits for a person, or an undo that cannot happen."""

    #: The step it belongs to.
    step: str
    #: ``step`` (the step's own operation) or ``compensation`` (its undo).
    role: str
    operation_id: UUID | None
    state: State | None
    #: What a person does about it.
    action: str


def blockers(saga: SagaView) -> list[Blocker]:
    """The saga's operations a person must decide (in ``unknown`` or ``needs_human``), and,
    for a saga in ``needs_human``, its compensations that failed (to undo by hand); in step
    order. Empty for a finished saga."""
    if saga.state in (SagaState.COMPLETED, SagaState.COMPENSATED, SagaState.CANCELLED):
        return []
    found: list[Blocker] = []
    for step in saga.steps:
        if step.state in _RESOLVABLE:
            found.append(
                Blocker(
                    step.name,
                    "step",
                    step.operation_id,
                    step.state,
                    "resolve this operation: applied or not applied",
                )
            )
        if step.compensation_state in _RESOLVABLE:
            found.append(
                Blocker(
                    step.name,
                    "compensation",
                    step.compensation_operation_id,
                    step.compensation_state,
                    "resolve this undo: applied (the saga carries on) or not applied",
                )
            )
        elif saga.state is SagaState.NEEDS_HUMAN and step.compensation_state in _REFUSED:
            found.append(
                Blocker(
                    step.name,
                    "compensation",
                    step.compensation_operation_id,
                    step.compensation_state,
                    f"the undo of step {step.name} was refused: undo it by hand",
                )
            )
    return found
