"""The saga decision table (outbox.saga_rules) against a model of its own, with no database;
also with the agent's cancel (outbox.cancel_saga) at a random moment.

Hypothesis draws a saga (one to six steps, parallel groups, pivots, steps with and without a
compensation) and a script of what the world does: each step's final outcome (confirmed or
refused, possibly through ``unknown`` or ``needs_human`` first, decided later), each
compensation's (confirmed, refused, or a person's "applied" after ``needs_human``), and the
order in which in-flight operations move. A simulated world applies the table's decisions
(release, cancel the held, record a compensation, move the saga) and moves one in-flight
operation at a time, as the script says, until the table waits with nothing in flight.

The model says, independently of the table, where the saga must end and which steps must be
compensated in which order: run the stages in order until the first refusal; the steps after
its stage never run; if a confirmed pivot ran, a person decides and nothing is undone;
otherwise every confirmed step that declares a compensation is undone in reverse order,
stopping at the first compensation that is refused. Along the way the table must never
compensate while a step is in doubt, never release a step before every earlier stage is
confirmed, and never record a compensation twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.saga_rules import (
    FINAL_SAGA_STATES,
    Kind,
    SagaState,
    StepFacts,
    decide,
    stages,
)
from outbox.states import State

#: How a step's operation ends, as the script says.
STEP_ENDINGS = ("confirmed", "refused", "unknown_confirmed", "unknown_refused", "human_refused")
#: How a compensation ends.
COMPENSATION_ENDINGS = ("confirmed", "refused", "human_applied")


@dataclass
class Step:
    """One step of the simulated world."""

    name: str
    group: str | None
    pivot: bool
    compensable: bool
    ending: str
    compensation_ending: str
    state: State = State.PLANNED
    held: bool = True
    compensation: State | None = None
    #: Moves left before the operation reaches its ending (sent, maybe unknown, final).
    path: list[State] = field(default_factory=list)
    compensation_path: list[State] = field(default_factory=list)


def step_path(ending: str) -> list[State]:
    """The states a released step goes through, in order."""
    final = State.CONFIRMED if ending.endswith("confirmed") else State.FAILED
    if ending.startswith("unknown"):
        return [State.SENT, State.UNKNOWN, final]
    if ending.startswith("human"):
        return [State.SENT, State.UNKNOWN, State.NEEDS_HUMAN, final]
    return [State.SENT, final]


def compensation_path(ending: str) -> list[State]:
    """The states a recorded compensation goes through, in order."""
    if ending == "human_applied":
        return [State.SENT, State.UNKNOWN, State.NEEDS_HUMAN, State.CONFIRMED]
    return [State.SENT, State.CONFIRMED if ending == "confirmed" else State.FAILED]


@st.composite
def sagas(draw: st.DrawFn) -> list[Step]:
    """A saga of one to six steps and the script of how each step and undo ends."""
    count = draw(st.integers(1, 6))
    steps = []
    for position in range(count):
        pivot = draw(st.integers(0, 3)) == 0
        steps.append(
            Step(
                name=f"s{position}",
                group=draw(st.sampled_from([None, None, "g1", "g2"])),
                pivot=pivot,
                compensable=not pivot and draw(st.integers(0, 4)) > 0,
                ending=draw(st.sampled_from(STEP_ENDINGS)),
                compensation_ending=draw(st.sampled_from(COMPENSATION_ENDINGS)),
            )
        )
    return steps


def facts(steps: list[Step]) -> list[StepFacts]:
    """What the table reads of the world."""
    return [
        StepFacts(
            name=s.name,
            group=s.group,
            state=s.state,
            held=s.held,
            pivot=s.pivot,
            compensable=s.compensable,
            compensation=s.compensation,
        )
        for s in steps
    ]


@dataclass
class Expected:
    """Where the model says the saga ends."""

    state: SagaState
    compensated: list[str]


def model(steps: list[Step]) -> Expected:
    """The model's verdict from the script alone (not from the table)."""
    ran: list[Step] = []
    refused = False
    for stage in stages(facts(steps)):
        members = [steps[p] for p in stage]
        ran.extend(members)
        if any(not s.ending.endswith("confirmed") for s in members):
            refused = True
            break
    if not refused:
        return Expected(SagaState.COMPLETED, [])
    applied = [s for s in ran if s.ending.endswith("confirmed")]
    if any(s.pivot for s in applied):
        return Expected(SagaState.NEEDS_HUMAN, [])
    undone: list[str] = []
    for s in reversed(applied):
        if not s.compensable:
            continue
        undone.append(s.name)
        if s.compensation_ending == "refused":
            return Expected(SagaState.NEEDS_HUMAN, undone)
    return Expected(SagaState.COMPENSATED, undone)


def in_doubt(steps: list[Step]) -> bool:
    """Whether any step's outcome is not known yet (released and not final)."""
    return any(
        not s.held and s.state not in (State.CONFIRMED, State.FAILED, State.CANCELLED)
        for s in steps
    )


def release(steps: list[Step], names: tuple[str, ...]) -> None:
    """Release the named held steps, checking every earlier stage is confirmed."""
    for name in names:
        position = next(i for i, s in enumerate(steps) if s.name == name)
        earlier = [
            steps[p]
            for stage in stages(facts(steps))
            if stage[-1] < position and position not in stage
            for p in stage
        ]
        assert all(s.state is State.CONFIRMED for s in earlier), "released too early"
        released = steps[position]
        assert released.held
        released.held = False
        released.path = step_path(released.ending)


def move_one(steps: list[Step], data: st.DataObject) -> bool:
    """Move one in-flight operation (a step or an undo) on, chosen by the script; whether
    there was one."""
    moving = [s for s in steps if s.path] + [s for s in steps if s.compensation_path]
    if not moving:
        return False
    mover = moving[data.draw(st.sampled_from(range(len(moving))), label="moves")]
    if mover.path:
        mover.state = mover.path.pop(0)
    else:
        mover.compensation = mover.compensation_path.pop(0)
    return True


@given(steps=sagas(), data=st.data())
@settings(max_examples=400, deadline=None)
def test_the_table_ends_where_the_model_says(steps: list[Step], data: st.DataObject) -> None:
    """Whatever the order of outcomes, the table ends the saga where the model says, undoing
    exactly the model's steps in reverse order, each once, never while a step is in doubt."""
    expected = model(steps)
    by_name = {s.name: s for s in steps}
    state = SagaState.RUNNING
    recorded: list[str] = []
    for _ in range(500):
        decision = decide(state, facts(steps))
        if decision.kind is Kind.RELEASE:
            release(steps, decision.steps)
        elif decision.kind is Kind.CANCEL_HELD:
            for name in decision.steps:
                by_name[name].state = State.CANCELLED
        elif decision.kind is Kind.COMPENSATE:
            (name,) = decision.steps
            assert not in_doubt(steps), "compensated while a step was in doubt"
            assert name not in recorded, "compensated twice"
            undone = by_name[name]
            assert undone.state is State.CONFIRMED
            assert undone.compensable
            recorded.append(name)
            undone.compensation = State.PLANNED
            undone.compensation_path = compensation_path(undone.compensation_ending)
        elif decision.kind is Kind.MOVE:
            assert decision.to_state is not None
            assert decision.to_state is not state
            state = decision.to_state
            if state in FINAL_SAGA_STATES:
                break
        elif decision.kind is Kind.NOTHING or not move_one(steps, data):
            break
    else:
        raise AssertionError("the table never settled")
    assert (state, recorded) == (expected.state, expected.compensated)
    confirmed_undos = [s.name for s in steps if s.compensation is State.CONFIRMED]
    if state is SagaState.COMPENSATED:
        assert sorted(confirmed_undos) == sorted(expected.compensated)
    if state is SagaState.COMPLETED:
        assert all(s.state is State.CONFIRMED for s in steps)


def model_after_cancel(steps: list[Step]) -> Expected:
    """The model's verdict for a cancelled saga, from which steps ended confirmed: a pivot
    among them, a person; none, cancelled; else each compensable one undone in reverse, up
    to the first refused undo."""
    applied = [s for s in steps if s.state is State.CONFIRMED]
    if any(s.pivot for s in applied):
        return Expected(SagaState.NEEDS_HUMAN, [])
    if not applied:
        return Expected(SagaState.CANCELLED, [])
    undone: list[str] = []
    for s in reversed(applied):
        if not s.compensable:
            continue
        undone.append(s.name)
        if s.compensation_ending == "refused":
            return Expected(SagaState.NEEDS_HUMAN, undone)
    return Expected(SagaState.COMPENSATED, undone)


def cancel(steps: list[Step]) -> SagaState:
    """What outbox.cancel_saga does to the world: released steps nobody sent yet are
    cancelled; the saga is compensating."""
    for s in steps:
        if not s.held and s.state is State.PLANNED:
            s.state, s.path = State.CANCELLED, []
    return SagaState.COMPENSATING


@given(steps=sagas(), data=st.data())
@settings(max_examples=300, deadline=None)
def test_a_cancel_at_any_moment_ends_where_the_model_says(
    steps: list[Step], data: st.DataObject
) -> None:
    """The agent's cancel at any moment of a running saga: nothing released after it, the
    steps that ended confirmed undone in reverse order once each, cancelled if none did."""
    by_name = {s.name: s for s in steps}
    state = SagaState.RUNNING
    cancelled = False
    recorded: list[str] = []
    for _ in range(500):
        if state is SagaState.RUNNING and not cancelled and data.draw(st.booleans(), "cancel"):
            cancelled, state = True, cancel(steps)
        decision = decide(state, facts(steps), cancel_requested=cancelled)
        if decision.kind is Kind.RELEASE:
            assert not cancelled, "released after a cancel"
            release(steps, decision.steps)
        elif decision.kind is Kind.CANCEL_HELD:
            for name in decision.steps:
                by_name[name].state = State.CANCELLED
        elif decision.kind is Kind.COMPENSATE:
            (name,) = decision.steps
            assert not in_doubt(steps), "compensated while a step was in doubt"
            assert name not in recorded, "compensated twice"
            recorded.append(name)
            undone = by_name[name]
            undone.compensation = State.PLANNED
            undone.compensation_path = compensation_path(undone.compensation_ending)
        elif decision.kind is Kind.MOVE:
            assert decision.to_state is not None
            state = decision.to_state
            if state in FINAL_SAGA_STATES:
                break
        elif decision.kind is Kind.NOTHING or not move_one(steps, data):
            break
    else:
        raise AssertionError("the table never settled")
    if not cancelled:
        assert (state, recorded) == (model(steps).state, model(steps).compensated)
        return
    expected = model_after_cancel(steps)
    assert (state, recorded) == (expected.state, expected.compensated)
    assert all(s.state in (State.CONFIRMED, State.FAILED, State.CANCELLED) for s in steps)


def test_a_step_in_doubt_holds_a_refused_saga() -> None:
    """A refusal beside a step in unknown moves the saga to compensating and waits; nothing
    is compensated until it is decided."""
    steps = [
        StepFacts("a", None, State.CONFIRMED, compensable=True),
        StepFacts("b", "g", State.UNKNOWN, compensable=True),
        StepFacts("c", "g", State.FAILED),
    ]
    first = decide(SagaState.RUNNING, steps)
    assert (first.kind, first.to_state) == (Kind.MOVE, SagaState.COMPENSATING)
    decision = decide(SagaState.COMPENSATING, steps)
    assert decision.kind is Kind.WAIT
    assert "waiting for step b (unknown)" in decision.reason


def test_a_cancel_with_nothing_applied_ends_cancelled() -> None:
    """A cancelled saga with nothing confirmed ends cancelled, its held steps cancelled first."""
    steps = [
        StepFacts("a", None, State.CANCELLED),
        StepFacts("b", None, State.PLANNED, held=True),
    ]
    first = decide(SagaState.COMPENSATING, steps, cancel_requested=True)
    assert (first.kind, first.steps) == (Kind.CANCEL_HELD, ("b",))
    steps[1] = StepFacts("b", None, State.CANCELLED, held=True)
    final = decide(SagaState.COMPENSATING, steps, cancel_requested=True)
    assert (final.kind, final.to_state) == (Kind.MOVE, SagaState.CANCELLED)


def test_a_needs_human_saga_resumes_when_its_compensation_is_decided() -> None:
    """A saga waiting for a person goes back to compensating once the blocking undo moves on."""
    steps = [
        StepFacts("a", None, State.CONFIRMED, compensable=True, compensation=State.NEEDS_HUMAN),
        StepFacts("b", None, State.FAILED),
    ]
    assert decide(SagaState.NEEDS_HUMAN, steps).kind is Kind.WAIT
    steps[0] = StepFacts("a", None, State.CONFIRMED, compensable=True, compensation=State.PLANNED)
    resumed = decide(SagaState.NEEDS_HUMAN, steps)
    assert (resumed.kind, resumed.to_state) == (Kind.MOVE, SagaState.COMPENSATING)
