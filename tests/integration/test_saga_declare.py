"""outbox.declare_saga: a whole saga in one call, found again by the same call, refused
(nothing written) when the key names other steps or another requester's saga, or when a
step's payload fails its tool's input_schema."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import outbox
from outbox import aio
from outbox.contracts import CONTRACTS, ToolContract
from outbox.db import create_async_engine
from outbox.errors import IntentConflict, InvalidIntent, InvalidSagaRequest, PayloadInvalid
from outbox.sagas import MAX_DECLARED_STEPS, DeclaredSaga, SagaState, StepSpec
from outbox.states import State
from tests.integration.test_sagas import THREE, open_saga

SPECS = [StepSpec(**step) for step in THREE]
#: An undo whose payload is not JSON (NaN): refused as canonical JSON would refuse it.
NAN_UNDO = outbox.Compensate("deploy.delete_release", "p", {"x": float("nan")})
#: The payload schema the second step's tool (lb.point) declares in the schema tests.
LB_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["to"],
    "properties": {"to": {"type": "string", "minLength": 1}},
}


def declare(engine: Engine, key: str, specs: list[StepSpec], **options: Any) -> DeclaredSaga:
    """declare_saga in one committed transaction."""
    with Session(engine) as session, session.begin():
        return outbox.declare_saga(session, key, specs, **options)


def counts(engine: Engine) -> tuple[int, int, int, int]:
    """Sagas, steps, saga events and operations: what a refusal must leave as it was."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT (SELECT count(*) FROM outbox.sagas), (SELECT count(*) FROM "
                "outbox.saga_steps), (SELECT count(*) FROM outbox.saga_events), "
                "(SELECT count(*) FROM outbox.operations)"
            )
        ).one()
    return (row[0], row[1], row[2], row[3])


def test_a_declared_saga_is_the_saga_its_steps_make(engine: Engine) -> None:
    """The steps in order, the first released and the others held, each with its undo:
    what saga() and step() in one transaction make."""
    done = declare(engine, "d-new", SPECS, requested_by="agent-a")
    assert done.created
    view = done.saga
    assert (view.key, view.state, view.requested_by) == ("d-new", SagaState.RUNNING, "agent-a")
    assert [s.name for s in view.steps] == ["release", "point-lb", "announce"]
    assert [s.held for s in view.steps] == [False, True, True]
    assert view.steps[0].compensate == THREE[0]["compensate"]
    assert view.steps[2].compensate is None

    open_saga(engine, "d-by-steps", THREE, requested_by="agent-a")
    with Session(engine) as session:
        by_steps = outbox.get_saga(session, "d-by-steps", agent="agent-a")
    assert by_steps is not None
    assert [(s.name, s.tool, s.target, s.held, s.state) for s in by_steps.steps] == [
        (s.name, s.tool, s.target, s.held, s.state) for s in view.steps
    ]


def test_the_same_declaration_again_finds_it_and_writes_nothing(engine: Engine) -> None:
    """Retried (a lost answer, a restart): created False, the same operations, no new row."""
    first = declare(engine, "d-again", SPECS, requested_by="agent-a")
    before = counts(engine)
    again = declare(engine, "d-again", SPECS, requested_by="agent-a")
    assert not again.created
    assert [s.operation_id for s in again.saga.steps] == [s.operation_id for s in first.saga.steps]
    assert counts(engine) == before


def test_other_steps_under_the_key_are_refused_naming_what_differs(engine: Engine) -> None:
    """Other names or another number of steps: ``steps``; the same names with a step's
    payload or undo changed: that step's field. Nothing written."""
    declare(engine, "d-conflict", SPECS, requested_by="agent-a")
    before = counts(engine)
    with pytest.raises(IntentConflict) as fewer:
        declare(engine, "d-conflict", SPECS[:2], requested_by="agent-a")
    assert fewer.value.differences == ("steps",)
    changed = [SPECS[0], StepSpec(**{**THREE[1], "payload": {"to": "9.9.9"}}), SPECS[2]]
    with pytest.raises(IntentConflict) as payload:
        declare(engine, "d-conflict", changed, requested_by="agent-a")
    assert payload.value.differences == ("steps[1].payload",)
    assert "steps[1] ('point-lb')" in str(payload.value)
    undo = [SPECS[0], SPECS[1], StepSpec(**{**THREE[2], "pivot": True})]
    with pytest.raises(IntentConflict) as pivot:
        declare(engine, "d-conflict", undo, requested_by="agent-a")
    assert pivot.value.differences == ("steps[2].pivot",)
    assert counts(engine) == before


def test_another_agents_saga_key_is_a_saga_of_its_own(engine: Engine) -> None:
    """The key names a saga another agent declared: this agent's declaration is its own new
    saga, answering nothing of the other's; a new token of the first agent (another
    requested_by, the same agent) finds the first saga."""
    theirs = declare(engine, "d-theirs", SPECS, requested_by="agent-b")
    mine = declare(engine, "d-theirs", SPECS[:1], requested_by="agent-a")
    assert mine.created
    assert (mine.saga.agent, theirs.saga.agent) == ("agent-a", "agent-b")
    assert [s.name for s in mine.saga.steps] == [SPECS[0].name]
    theirs_ids = {str(s.operation_id) for s in theirs.saga.steps}
    assert not theirs_ids & {str(s.operation_id) for s in mine.saga.steps}
    assert not any(i in str(mine.saga.to_dict()) for i in theirs_ids)
    again = declare(engine, "d-theirs", SPECS, requested_by="agent-b-2", agent="agent-b")
    assert not again.created
    assert [s.operation_id for s in again.saga.steps] == [s.operation_id for s in theirs.saga.steps]


@pytest.mark.parametrize(
    ("specs", "error", "field"),
    [
        ([], InvalidSagaRequest, "steps"),
        ([SPECS[0]] * (MAX_DECLARED_STEPS + 1), InvalidSagaRequest, "steps"),
        ([SPECS[0], SPECS[1], SPECS[0]], InvalidIntent, "steps[2].name"),
        ([SPECS[0], StepSpec(**{**THREE[1], "name": ""})], InvalidIntent, "steps[1].name"),
        ([SPECS[0], StepSpec(**{**THREE[1], "tool": "no tool"})], InvalidIntent, "steps[1].tool"),
        (
            [StepSpec(**{**THREE[0], "pivot": True})],
            InvalidIntent,
            "steps[0].compensate",
        ),
        (
            [StepSpec(**{**THREE[0], "compensate": NAN_UNDO})],
            InvalidIntent,
            "steps[0].compensate.payload",
        ),
    ],
)
def test_a_malformed_declaration_names_the_step_and_writes_nothing(
    engine: Engine, specs: list[StepSpec], error: type[Exception], field: str
) -> None:
    """An empty or too long list, a name given twice, a bad step: refused naming it, and no
    saga, step or operation is left."""
    with pytest.raises(error) as caught:
        declare(engine, "d-bad", specs)
    assert getattr(caught.value, "field", None) == field
    assert counts(engine) == (0, 0, 0, 0)


def test_concurrent_declarations_of_one_key_make_one_saga(engine: Engine) -> None:
    """Four callers declare the same saga at once: one creates it, three find it; one set of
    steps and operations."""
    barrier = threading.Barrier(4)
    results: list[DeclaredSaga] = []
    errors: list[BaseException] = []

    def racer() -> None:
        try:
            barrier.wait(timeout=10)
            results.append(declare(engine, "d-race", SPECS, requested_by="agent-a"))
        except BaseException as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=racer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert sorted(done.created for done in results) == [False, False, False, True]
    assert {tuple(s.operation_id for s in done.saga.steps) for done in results} == {
        tuple(s.operation_id for s in results[0].saga.steps)
    }
    assert counts(engine)[1:] == (3, 1, 3)


def test_the_async_twin_declares_the_same_saga(engine: Engine, database_url: str) -> None:
    """outbox.aio.declare_saga, on an AsyncSession, makes the same saga and finds it again."""

    async def twice() -> tuple[DeclaredSaga, DeclaredSaga]:
        async_engine = create_async_engine(database_url)
        try:
            results = []
            for _ in range(2):
                async with AsyncSession(async_engine) as session, session.begin():
                    results.append(
                        await aio.declare_saga(session, "d-aio", SPECS, requested_by="agent-a")
                    )
            return results[0], results[1]
        finally:
            await async_engine.dispose()

    first, second = asyncio.run(twice())
    assert (first.created, second.created) == (True, False)
    assert [s.state for s in second.saga.steps] == [State.PLANNED, State.PLANNED, State.PLANNED]
    assert [s.held for s in second.saga.steps] == [False, True, True]


@pytest.fixture
def lb_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    """lb.point's contract, with its input_schema, known to this process for this test only
    (as it is to a process that loaded its tools)."""
    monkeypatch.setitem(
        CONTRACTS._contracts, "lb.point", ToolContract(name="lb.point", input_schema=LB_SCHEMA)
    )


@pytest.mark.usefixtures("lb_schema")
@pytest.mark.parametrize(
    ("payload", "keyword"),
    [({"to": 2}, "type"), ({"to": ""}, "minLength"), ({}, "required")],
)
def test_a_step_payload_failing_its_tools_schema_names_the_step_and_writes_nothing(
    engine: Engine, payload: dict[str, Any], keyword: str
) -> None:
    """The second step's payload does not match lb.point's input_schema: refused as
    PayloadInvalid naming ``steps[1].payload.to`` and the step, after the first step was
    checked and written in the same transaction: no saga, step or operation is left."""
    specs = [SPECS[0], StepSpec(**{**THREE[1], "payload": payload}), SPECS[2]]
    with pytest.raises(PayloadInvalid) as caught:
        declare(engine, "d-schema", specs, requested_by="agent-a")
    assert (caught.value.field, caught.value.keyword) == ("steps[1].payload.to", keyword)
    assert str(caught.value).startswith("steps[1] ('point-lb'): payload does not match")
    assert "'lb.point'" in str(caught.value)
    assert counts(engine) == (0, 0, 0, 0)
    # The same saga with the payload fixed is declared whole.
    assert declare(engine, "d-schema", SPECS, requested_by="agent-a").created
    assert counts(engine)[1:] == (3, 1, 3)


@pytest.mark.usefixtures("lb_schema")
def test_the_async_twin_refuses_a_step_payload_the_same_way(
    engine: Engine, database_url: str
) -> None:
    """outbox.aio.declare_saga (what outbox_saga over MCP calls) refuses the same payload the
    same way, with nothing written."""
    specs = [SPECS[0], StepSpec(**{**THREE[1], "payload": {"to": 2}})]

    async def refused() -> PayloadInvalid:
        async_engine = create_async_engine(database_url)
        try:
            with pytest.raises(PayloadInvalid) as caught:  # out of the transaction: rolled back
                async with AsyncSession(async_engine) as session, session.begin():
                    await aio.declare_saga(session, "d-schema-aio", specs)
            return caught.value
        finally:
            await aio.close()
            await async_engine.dispose()

    error = asyncio.run(refused())
    assert (error.field, error.keyword) == ("steps[1].payload.to", "type")
    assert counts(engine) == (0, 0, 0, 0)


@pytest.mark.usefixtures("lb_schema")
def test_saga_step_refuses_a_payload_failing_its_tools_schema_and_adds_nothing(
    engine: Engine,
) -> None:
    """Saga.step refuses the payload naming ``payload.to`` and records neither the step nor its
    operation; the saga and the steps before it, in the same transaction, stay the caller's
    to commit, and the step can then be added with a matching payload."""
    with Session(engine) as session, session.begin():
        opened = outbox.saga(session, "s-schema", requested_by="agent-a")
        opened.step(**THREE[0])
        with pytest.raises(PayloadInvalid) as caught:
            opened.step(**{**THREE[1], "payload": {"to": 2}})
    assert (caught.value.field, caught.value.keyword) == ("payload.to", "type")
    assert counts(engine) == (1, 1, 1, 1)
    with Session(engine) as session:
        found = outbox.get_saga(session, "s-schema", agent="agent-a")
    assert found is not None
    assert [s.name for s in found.steps] == ["release"]
    with Session(engine) as session, session.begin():
        outbox.saga(session, "s-schema", agent="agent-a").step(**THREE[1])
    assert counts(engine)[1] == 2


#: The undo tool's schema in the compensation tests: the release to delete must look like one.
UNDO_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["release", "why"],
    "properties": {
        "release": {"type": "string", "pattern": "^rel-"},
        "why": {"type": "string"},
    },
}


@pytest.fixture
def undo_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy.delete_release's contract, with its input_schema, known to this process."""
    monkeypatch.setitem(
        CONTRACTS._contracts,
        "deploy.delete_release",
        ToolContract(name="deploy.delete_release", input_schema=UNDO_SCHEMA),
    )


def _undo(payload: dict[str, Any]) -> StepSpec:
    return StepSpec(
        **{**THREE[0], "compensate": outbox.Compensate("deploy.delete_release", "p", payload)}
    )


@pytest.mark.usefixtures("undo_schema")
@pytest.mark.parametrize(
    ("payload", "field", "keyword"),
    [
        ({"release": "{remote_ref}"}, "steps[0].compensate.payload.why", "required"),
        ({"release": "{remote_ref}", "why": 3}, "steps[0].compensate.payload.why", "type"),
        ({"release": "v1", "why": "undo"}, "steps[0].compensate.payload.release", "pattern"),
    ],
)
def test_an_undo_its_tool_would_refuse_is_refused_when_declared(
    engine: Engine, payload: dict[str, Any], field: str, keyword: str
) -> None:
    """A compensation whose payload fails its tool's input_schema would only be found when a
    later refusal needs it, and leave the saga needing a person: it is refused at once, naming
    the field, with nothing written."""
    with pytest.raises(PayloadInvalid) as caught:
        declare(engine, "d-undo", [_undo(payload), SPECS[1]], requested_by="agent-a")
    assert (caught.value.field, caught.value.keyword) == (field, keyword)
    assert "compensate" in str(caught.value)
    assert counts(engine) == (0, 0, 0, 0)


@pytest.mark.usefixtures("undo_schema")
def test_an_undo_value_waiting_for_the_remote_ref_is_judged_when_substituted(
    engine: Engine,
) -> None:
    """``"{remote_ref}"`` cannot match ``^rel-`` before the step has a remote_ref: that value is
    left for the enqueue of the undo, where it is substituted; the rest is checked now."""
    done = declare(
        engine,
        "d-undo-ok",
        [_undo({"release": "{remote_ref}", "why": "undo"}), SPECS[1]],
        requested_by="agent-a",
    )
    assert done.created
    assert counts(engine)[1:] == (2, 1, 2)


@pytest.mark.usefixtures("undo_schema")
def test_saga_step_refuses_an_undo_its_tool_would_refuse(engine: Engine) -> None:
    """Saga.step checks the undo the same way, naming ``compensate.payload.why``."""
    with Session(engine) as session, session.begin():
        opened = outbox.saga(session, "s-undo", requested_by="agent-a")
        with pytest.raises(PayloadInvalid) as caught:
            opened.step(
                **{**THREE[0], "compensate": _undo({"release": "x", "why": "u"}).compensate}
            )
    assert caught.value.field == "compensate.payload.release"
    assert counts(engine) == (1, 0, 1, 0)
