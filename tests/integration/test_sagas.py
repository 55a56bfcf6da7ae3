"""Sagas on a real database: held and released steps, the driver's compensation in reverse
order and exactly once, unknown steps holding it, pivots, failed compensations, idempotent
steps, conflicts, approvals of held steps, webhooks and cancel_saga."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from uuid import UUID

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

import outbox
from outbox import aio, approval, sagas, sql, transitions
from outbox.config import get_settings
from outbox.contracts import ContractTable
from outbox.db import create_async_engine
from outbox.errors import IntentConflict, InvalidIntent, SagaNotRunning
from outbox.metrics import OutboxCollector
from outbox.models import Operation, SagaRef, iso_utc
from outbox.reconcilers.sagas import (
    advance_due_sagas_and_commit,
    advance_saga_and_commit,
    nudge_sagas_of_and_commit,
)
from outbox.sagas import Compensate, SagaState, SagaView
from outbox.sql.columns import HELD_UNTIL
from outbox.states import Actor, State
from outbox.tools import Applied, ToolCall, ToolRegistry, tool
from outbox.workers.dispatch import Outcome, dispatch
from tests.factories import reload

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()

#: The three steps of the issue's example: a release, the load balancer, the announcement.
THREE: list[dict[str, Any]] = [
    {
        "name": "release",
        "tool": "deploy.create_release",
        "target": "project-a",
        "payload": {"version": "1.2.3"},
        "compensate": Compensate(
            "deploy.delete_release", "project-a", {"release": "{remote_ref}", "why": "undo"}
        ),
    },
    {
        "name": "point-lb",
        "tool": "lb.point",
        "target": "lb-1",
        "payload": {"to": "1.2.3"},
        "compensate": Compensate("lb.point", "lb-1", {"to": "previous", "undo": "{remote_ref}"}),
    },
    {
        "name": "announce",
        "tool": "chat.post",
        "target": "#releases",
        "payload": {"text": "1.2.3 is out"},
    },
]


@pytest.fixture
def webhooks_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Webhooks configured with the default events."""
    monkeypatch.setenv("OUTBOX_WEBHOOK_URL", "https://hooks.example.com/outbox")
    monkeypatch.setenv("OUTBOX_WEBHOOK_SECRET", SECRET)
    monkeypatch.delenv("OUTBOX_WEBHOOK_EVENTS", raising=False)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def open_saga(
    engine: Engine, key: str, steps: list[dict[str, Any]], **options: Any
) -> list[Operation]:
    """Open saga ``key`` and add ``steps`` in one committed transaction."""
    with Session(engine) as session, session.begin():
        opened = outbox.saga(session, key, **options)
        return [opened.step(**step) for step in steps]


def ref_of(engine: Engine, key: str) -> SagaRef:
    """The one saga under ``key``, whichever agent it was opened for (a test opens one)."""
    with Session(engine) as session:
        agents = sagas.agents_of_saga_key(session, key)
    assert len(agents) <= 1, agents
    return SagaRef(key, agents[0] if agents else "")


def view(engine: Engine, key: str) -> SagaView:
    """The saga as read now."""
    with Session(engine) as session:
        found = outbox.get_saga(session, key, agent=ref_of(engine, key).agent)
    assert found is not None
    return found


def state_of(engine: Engine, key: str) -> SagaState:
    """The saga's state now."""
    return view(engine, key).state


def send(engine: Engine, op_id: UUID) -> Operation:
    """The dispatcher's ``planned -> sent``, committed."""
    current = reload(engine, op_id)
    with engine.connect() as conn:
        moved = transitions.apply_and_commit(
            conn, transitions.mark_sent(op_id, attempt=current.attempts, reason="sending")
        )
    assert isinstance(moved, transitions.Moved)
    return moved.operation


def finish(engine: Engine, op_id: UUID, outcome: State, remote_ref: str = "") -> Operation:
    """Send the operation and commit ``outcome`` for its attempt, as a dispatcher would."""
    sent = send(engine, op_id)
    attempt = sent.attempts
    move: transitions.Move
    if outcome is State.CONFIRMED:
        move = transitions.confirm(
            op_id,
            from_state=State.SENT,
            actor=Actor.DISPATCHER,
            attempt=attempt,
            reason="201",
            remote_ref=remote_ref or f"ref-{op_id.hex[:8]}",
        )
    elif outcome is State.FAILED:
        move = transitions.fail(
            op_id, from_state=State.SENT, actor=Actor.DISPATCHER, attempt=attempt, reason="422"
        )
    else:
        move = transitions.mark_unknown(
            op_id, actor=Actor.DISPATCHER, attempt=attempt, reason="read timeout"
        )
    with engine.connect() as conn:
        moved = transitions.apply_and_commit(conn, move)
    assert isinstance(moved, transitions.Moved)
    if outcome is State.NEEDS_HUMAN:
        with engine.connect() as conn:
            escalated = transitions.apply_and_commit(
                conn,
                transitions.escalate(
                    op_id,
                    from_state=State.UNKNOWN,
                    actor=Actor.RECONCILER,
                    attempt=attempt,
                    reason="no lookup",
                ),
            )
        assert isinstance(escalated, transitions.Moved)
        return escalated.operation
    return moved.operation


def decide_unknown(engine: Engine, op_id: UUID, *, applied: bool) -> Operation:
    """An operator's verdict on an ``unknown`` or ``needs_human`` operation, committed."""
    current = reload(engine, op_id)
    move = (
        transitions.confirm(
            op_id,
            from_state=current.state,
            actor=Actor.OPERATOR,
            attempt=current.attempts,
            reason="checked: applied",
            remote_ref="ref-by-hand",
        )
        if applied
        else transitions.fail(
            op_id,
            from_state=current.state,
            actor=Actor.OPERATOR,
            attempt=current.attempts,
            reason="checked: not applied",
        )
    )
    with engine.connect() as conn:
        moved = transitions.apply_and_commit(conn, move)
    assert isinstance(moved, transitions.Moved)
    return moved.operation


def advance(engine: Engine, key: str) -> SagaState:
    """One driver pass over the saga, committed; its state after."""
    advanced = advance_saga_and_commit(engine, ref_of(engine, key))
    assert advanced is not None
    return advanced.state


def compensations(engine: Engine, key: str) -> list[Operation]:
    """The saga's compensation operations, in the order they were recorded."""
    with engine.connect() as conn:
        ids = conn.execute(
            text(
                "SELECT id FROM outbox.operations WHERE metadata->>'saga' = :key"
                " AND metadata ? 'saga_compensates' ORDER BY id"
            ),
            {"key": key},
        ).scalars()
        return [reload(engine, op_id) for op_id in ids]


def saga_deliveries(engine: Engine, key: str) -> list[tuple[str, dict[str, Any]]]:
    """The webhook rows written about the saga: (event, body), oldest first."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT event, payload FROM outbox.webhook_deliveries WHERE subject = :subject"
                " ORDER BY created_at, id"
            ),
            {"subject": f"saga:{key}"},
        )
        return [(row[0], row[1]) for row in rows]


def is_held(engine: Engine, op_id: UUID) -> bool:
    """Whether the saga still holds the operation (far-future ``available_at``)."""
    return reload(engine, op_id).available_at >= HELD_UNTIL


# --- the agent's side ------------------------------------------------------------------------


def test_only_the_first_step_is_due_the_later_ones_are_held(engine: Engine) -> None:
    """A new saga's first step is due at once; the steps after it are held (never due)."""
    release, point, announce = open_saga(engine, "s-held", THREE, requested_by="agent-7")
    assert not is_held(engine, release.id)
    assert is_held(engine, point.id)
    assert is_held(engine, announce.id)
    assert point.available_at >= HELD_UNTIL  # the returned operation says so too
    saga = view(engine, "s-held")
    assert saga.state is SagaState.RUNNING
    assert [(s.name, s.held, s.state) for s in saga.steps] == [
        ("release", False, State.PLANNED),
        ("point-lb", True, State.PLANNED),
        ("announce", True, State.PLANNED),
    ]
    assert release.intent_key == "saga:6:s-held:step:release"
    assert release.metadata == {"saga": "s-held", "saga_step": "release"}
    assert release.requested_by == "agent-7"
    with engine.connect() as conn, conn.begin() as tx:  # the relay publishes only the due step
        claimed = sql.relay.claim_and_mark_due(conn, limit=10, republish_after_s=60)
        tx.rollback()
    assert [c.id for c in claimed] == [release.id]


def test_the_same_steps_again_return_the_same_operations(engine: Engine) -> None:
    """Re-running the agent's code after a crash returns the recorded operations, writing none."""
    first = open_saga(engine, "s-again", THREE)
    again = open_saga(engine, "s-again", THREE)
    assert [op.id for op in again] == [op.id for op in first]
    assert len(view(engine, "s-again").steps) == 3


@pytest.mark.parametrize(
    ("change", "difference"),
    [
        ({"payload": {"version": "9.9.9"}}, "payload"),
        ({"target": "project-b"}, "target"),
        ({"compensate": None}, "compensate"),
        ({"compensate": Compensate("deploy.delete_release", "project-a", {"x": 1})}, "compensate"),
        ({"group": "g"}, "group"),
    ],
)
def test_the_same_step_name_with_other_input_is_a_conflict(
    engine: Engine, change: dict[str, Any], difference: str
) -> None:
    """The same step name with a different input raises IntentConflict naming the field."""
    open_saga(engine, "s-conflict", THREE[:1])
    with pytest.raises(IntentConflict) as raised:
        open_saga(engine, "s-conflict", [THREE[0] | change])
    assert raised.value.differences == (difference,)
    assert len(view(engine, "s-conflict").steps) == 1


def test_malformed_steps_name_the_field(engine: Engine) -> None:
    """A pivot with a compensation, a bad compensation tool, a reopened group: InvalidIntent."""
    with pytest.raises(InvalidIntent) as pivot:
        open_saga(engine, "s-bad", [THREE[0] | {"pivot": True}])
    assert pivot.value.field == "compensate"
    bad_tool = Compensate("not a tool", "t", {})
    with pytest.raises(InvalidIntent) as tool:
        open_saga(engine, "s-bad", [THREE[0] | {"compensate": bad_tool}])
    assert tool.value.field == "compensate.tool"
    grouped = [
        {"name": "a", "tool": "x.a", "target": "t", "payload": {}, "group": "g"},
        {"name": "b", "tool": "x.b", "target": "t", "payload": {}},
        {"name": "c", "tool": "x.c", "target": "t", "payload": {}, "group": "g"},
    ]
    with pytest.raises(InvalidIntent) as group:
        open_saga(engine, "s-bad", grouped)
    assert group.value.field == "group"
    with Session(engine) as session:
        assert outbox.get_saga(session, "s-bad") is None  # rolled back with the caller


def test_a_new_step_on_a_finished_saga_is_refused_an_old_one_is_returned(engine: Engine) -> None:
    """A completed saga refuses a new step (SagaNotRunning) but returns a recorded one."""
    (only,) = open_saga(engine, "s-done", THREE[:1])
    finish(engine, only.id, State.CONFIRMED)
    assert advance(engine, "s-done") is SagaState.COMPLETED
    assert [op.id for op in open_saga(engine, "s-done", THREE[:1])] == [only.id]
    with pytest.raises(SagaNotRunning) as refused:
        open_saga(engine, "s-done", THREE[:2])
    assert (refused.value.state, refused.value.step) == (SagaState.COMPLETED, "point-lb")


# --- the driver: order, release, completion ------------------------------------------------


def test_each_step_is_released_when_the_one_before_is_confirmed(engine: Engine) -> None:
    """Step k+1 is released only once step k is confirmed; all confirmed: completed."""
    release, point, announce = open_saga(engine, "s-order", THREE)
    assert advance(engine, "s-order") is SagaState.RUNNING
    assert is_held(engine, point.id)
    send(engine, release.id)
    assert advance(engine, "s-order") is SagaState.RUNNING
    assert is_held(engine, point.id)  # in flight is not confirmed
    finish_sent = transitions.confirm(
        release.id,
        from_state=State.SENT,
        actor=Actor.DISPATCHER,
        attempt=1,
        reason="201",
        remote_ref="rel-1",
    )
    with engine.connect() as conn:
        assert isinstance(transitions.apply_and_commit(conn, finish_sent), transitions.Moved)
    assert advance(engine, "s-order") is SagaState.RUNNING
    assert not is_held(engine, point.id)
    assert is_held(engine, announce.id)
    finish(engine, point.id, State.CONFIRMED)
    advance(engine, "s-order")
    assert not is_held(engine, announce.id)
    finish(engine, announce.id, State.CONFIRMED)
    assert advance(engine, "s-order") is SagaState.COMPLETED
    saga = view(engine, "s-order")
    assert [(e.from_state, e.to_state) for e in saga.events if e.from_state != e.to_state] == [
        (None, SagaState.RUNNING),
        (SagaState.RUNNING, SagaState.COMPLETED),
    ]
    assert [e.reason for e in saga.events if "released" in e.reason] == [
        "step point-lb released",
        "step announce released",
    ]
    assert compensations(engine, "s-order") == []


def test_a_parallel_group_is_released_together_and_waited_for(engine: Engine) -> None:
    """Consecutive steps sharing a group are released together; the next waits for all."""
    steps = [
        {"name": "a", "tool": "x.a", "target": "t", "payload": {}},
        {"name": "b1", "tool": "x.b", "target": "t1", "payload": {}, "group": "b"},
        {"name": "b2", "tool": "x.b", "target": "t2", "payload": {}, "group": "b"},
        {"name": "c", "tool": "x.c", "target": "t", "payload": {}},
    ]
    a, b1, b2, c = open_saga(engine, "s-group", steps)
    finish(engine, a.id, State.CONFIRMED)
    advance(engine, "s-group")
    assert not is_held(engine, b1.id)
    assert not is_held(engine, b2.id)
    assert is_held(engine, c.id)
    finish(engine, b1.id, State.CONFIRMED)
    advance(engine, "s-group")
    assert is_held(engine, c.id)
    finish(engine, b2.id, State.CONFIRMED)
    advance(engine, "s-group")
    assert not is_held(engine, c.id)


def test_a_step_added_after_the_earlier_ones_confirmed_is_due_at_once(engine: Engine) -> None:
    """A step added while every step before it is confirmed is not held."""
    (release,) = open_saga(engine, "s-late", THREE[:1])
    send(engine, release.id)
    with Session(engine) as session, session.begin():  # the saga row lock holds the driver off
        opened = outbox.saga(session, "s-late")
        held = opened.step(**THREE[1])
    assert is_held(engine, held.id)
    finish_move = transitions.confirm(
        release.id,
        from_state=State.SENT,
        actor=Actor.DISPATCHER,
        attempt=1,
        reason="201",
        remote_ref="rel-1",
    )
    with engine.connect() as conn:
        transitions.apply_and_commit(conn, finish_move)
    with Session(engine) as session, session.begin():
        due = outbox.saga(session, "s-late").step(**THREE[2])
    assert is_held(engine, held.id)
    assert is_held(engine, due.id)
    advance(engine, "s-late")
    assert not is_held(engine, held.id)


# --- compensation ---------------------------------------------------------------------------


def test_a_refusal_compensates_the_confirmed_steps_in_reverse_order_once(
    engine: Engine, webhooks_on: None
) -> None:
    """Step 3 refused: step 2 then step 1 are compensated, one at a time, each exactly once."""
    release, point, announce = open_saga(engine, "s-undo", THREE)
    finish(engine, release.id, State.CONFIRMED, remote_ref="rel-42")
    advance(engine, "s-undo")
    finish(engine, point.id, State.CONFIRMED, remote_ref="lb-change-7")
    advance(engine, "s-undo")
    finish(engine, announce.id, State.FAILED)
    assert advance(engine, "s-undo") is SagaState.COMPENSATING
    (undo_point,) = compensations(engine, "s-undo")
    assert (undo_point.tool, undo_point.target) == ("lb.point", "lb-1")
    assert undo_point.payload == {"to": "previous", "undo": "lb-change-7"}
    assert undo_point.intent_key == "saga:6:s-undo:undo:point-lb"
    assert undo_point.state is State.PLANNED
    assert not is_held(engine, undo_point.id)
    assert advance(engine, "s-undo") is SagaState.COMPENSATING
    assert len(compensations(engine, "s-undo")) == 1  # one at a time, never twice
    finish(engine, undo_point.id, State.CONFIRMED)
    advance(engine, "s-undo")
    undo_point_again, undo_release = compensations(engine, "s-undo")
    assert undo_point_again.id == undo_point.id
    assert undo_release.payload == {"release": "rel-42", "why": "undo"}
    finish(engine, undo_release.id, State.CONFIRMED)
    assert advance(engine, "s-undo") is SagaState.COMPENSATED
    assert advance(engine, "s-undo") is SagaState.COMPENSATED
    assert len(compensations(engine, "s-undo")) == 2
    saga = view(engine, "s-undo")
    assert saga.reason is not None
    assert "announce" in saga.reason
    assert [s.compensation_state for s in saga.steps] == [State.CONFIRMED, State.CONFIRMED, None]
    ((event, body),) = saga_deliveries(engine, "s-undo")
    assert event == "saga_compensated"
    assert body["type"] == "saga.compensated"
    assert body["data"]["saga_key"] == "s-undo"
    assert [s["state"] for s in body["data"]["steps"]] == ["confirmed", "confirmed", "failed"]


def test_a_refusal_with_nothing_confirmed_ends_compensated_at_once(engine: Engine) -> None:
    """The first step refused: nothing to undo, the held steps are cancelled, compensated."""
    release, point, announce = open_saga(engine, "s-first", THREE)
    finish(engine, release.id, State.FAILED)
    assert advance(engine, "s-first") is SagaState.COMPENSATED
    assert reload(engine, point.id).state is State.CANCELLED
    assert reload(engine, announce.id).state is State.CANCELLED
    assert compensations(engine, "s-first") == []


def test_an_unknown_step_holds_the_compensation_until_it_is_decided(engine: Engine) -> None:
    """A step in doubt beside a refused one holds every compensation; decided applied, it is
    undone first."""
    steps = [
        THREE[0],
        {
            "name": "b",
            "tool": "x.b",
            "target": "t",
            "payload": {},
            "group": "g",
            "compensate": Compensate("x.unb", "t", {"ref": "{remote_ref}"}),
        },
        {"name": "c", "tool": "x.c", "target": "t", "payload": {}, "group": "g"},
    ]
    release, b, c = open_saga(engine, "s-doubt", steps)
    finish(engine, release.id, State.CONFIRMED)
    advance(engine, "s-doubt")
    finish(engine, b.id, State.UNKNOWN)
    finish(engine, c.id, State.FAILED)
    assert advance(engine, "s-doubt") is SagaState.COMPENSATING
    assert compensations(engine, "s-doubt") == []
    assert "waiting for step b (unknown)" in (view(engine, "s-doubt").reason or "")
    decide_unknown(engine, b.id, applied=True)
    assert advance(engine, "s-doubt") is SagaState.COMPENSATING
    (undo_b,) = compensations(engine, "s-doubt")
    assert undo_b.payload == {"ref": "ref-by-hand"}
    finish(engine, undo_b.id, State.CONFIRMED)
    advance(engine, "s-doubt")
    assert [op.intent_key for op in compensations(engine, "s-doubt")] == [
        "saga:7:s-doubt:undo:b",
        "saga:7:s-doubt:undo:release",
    ]


def _due_now(engine: Engine, key: str) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text("SELECT next_check_at <= clock_timestamp() FROM outbox.sagas WHERE key = :k"),
                {"k": key},
            ).scalar_one()
        )


def test_an_operators_word_on_a_step_makes_its_saga_due_at_once(engine: Engine) -> None:
    """An operator's verdict on a saga's step makes the saga due for the next pass at once,
    where a pass that found it waiting had put its next look 10 s out."""
    release, point, _ = open_saga(engine, "s-due", THREE)
    finish(engine, release.id, State.CONFIRMED)
    advance(engine, "s-due")
    finish(engine, point.id, State.NEEDS_HUMAN)
    assert advance(engine, "s-due") is SagaState.RUNNING
    assert not _due_now(engine, "s-due")
    decide_unknown(engine, point.id, applied=True)
    assert _due_now(engine, "s-due")


def test_a_step_resolved_not_applied_is_not_compensated(engine: Engine) -> None:
    """A step in needs_human resolved "not applied" is a refusal: only the steps before it
    are undone."""
    release, point, announce = open_saga(engine, "s-not-applied", THREE)
    finish(engine, release.id, State.CONFIRMED)
    advance(engine, "s-not-applied")
    finish(engine, point.id, State.NEEDS_HUMAN)
    assert advance(engine, "s-not-applied") is SagaState.RUNNING
    assert compensations(engine, "s-not-applied") == []
    decide_unknown(engine, point.id, applied=False)
    assert advance(engine, "s-not-applied") is SagaState.COMPENSATING
    assert [op.intent_key for op in compensations(engine, "s-not-applied")] == [
        "saga:13:s-not-applied:undo:release"
    ]
    assert reload(engine, announce.id).state is State.CANCELLED


def test_a_refusal_after_a_confirmed_pivot_needs_a_human_and_undoes_nothing(
    engine: Engine, webhooks_on: None
) -> None:
    """A confirmed pivot followed by a refusal: needs_human, nothing compensated."""
    steps = [THREE[0], THREE[1] | {"compensate": None, "pivot": True}, THREE[2]]
    release, point, announce = open_saga(engine, "s-pivot", steps)
    finish(engine, release.id, State.CONFIRMED)
    advance(engine, "s-pivot")
    finish(engine, point.id, State.CONFIRMED)
    advance(engine, "s-pivot")
    finish(engine, announce.id, State.FAILED)
    assert advance(engine, "s-pivot") is SagaState.NEEDS_HUMAN
    assert advance(engine, "s-pivot") is SagaState.NEEDS_HUMAN
    assert compensations(engine, "s-pivot") == []
    saga = view(engine, "s-pivot")
    assert saga.reason == "step announce refused after pivot point-lb: nothing is compensated"
    assert [e.to_state for e in saga.events].count(SagaState.NEEDS_HUMAN) == 1
    ((event, body),) = saga_deliveries(engine, "s-pivot")
    assert (event, body["type"]) == ("saga_needs_human", "saga.needs_human")
    assert body["data"]["reason"] == saga.reason


def test_a_failed_compensation_leaves_the_saga_needing_a_human(
    engine: Engine, webhooks_on: None
) -> None:
    """A compensation refused by its remote: needs_human with the reason, nothing more undone."""
    release, point, announce = open_saga(engine, "s-comp-fails", THREE)
    finish(engine, release.id, State.CONFIRMED)
    advance(engine, "s-comp-fails")
    finish(engine, point.id, State.CONFIRMED)
    advance(engine, "s-comp-fails")
    finish(engine, announce.id, State.FAILED)
    advance(engine, "s-comp-fails")
    (undo_point,) = compensations(engine, "s-comp-fails")
    finish(engine, undo_point.id, State.FAILED)
    assert advance(engine, "s-comp-fails") is SagaState.NEEDS_HUMAN
    assert advance(engine, "s-comp-fails") is SagaState.NEEDS_HUMAN
    assert len(compensations(engine, "s-comp-fails")) == 1  # release is not undone past it
    reason = view(engine, "s-comp-fails").reason or ""
    assert "the compensation of step point-lb was refused" in reason
    assert [e for e, _ in saga_deliveries(engine, "s-comp-fails")] == ["saga_needs_human"]


def test_a_compensation_a_person_decides_lets_the_saga_carry_on(engine: Engine) -> None:
    """A compensation in needs_human makes the saga needs_human; resolved applied, it resumes."""
    release, point = open_saga(engine, "s-comp-human", THREE[:2])
    finish(engine, release.id, State.CONFIRMED)
    advance(engine, "s-comp-human")
    finish(engine, point.id, State.FAILED)
    advance(engine, "s-comp-human")
    (undo_release,) = compensations(engine, "s-comp-human")
    finish(engine, undo_release.id, State.NEEDS_HUMAN)
    assert advance(engine, "s-comp-human") is SagaState.NEEDS_HUMAN
    decide_unknown(engine, undo_release.id, applied=True)
    assert advance(engine, "s-comp-human") is SagaState.COMPENSATED
    moves = [(e.from_state, e.to_state) for e in view(engine, "s-comp-human").events]
    assert (SagaState.COMPENSATING, SagaState.NEEDS_HUMAN) in moves
    assert (SagaState.NEEDS_HUMAN, SagaState.COMPENSATED) in moves


def test_a_compensation_its_checks_refuse_needs_a_human(engine: Engine) -> None:
    """A compensation that cannot be recorded (an unknown tool) makes the saga needs_human."""
    steps = [THREE[0] | {"compensate": Compensate("x.undo", "t", {"n": 1})}, THREE[2]]
    release, announce = open_saga(engine, "s-comp-bad", steps)
    finish(engine, release.id, State.CONFIRMED)
    advance(engine, "s-comp-bad")
    finish(engine, announce.id, State.FAILED)
    with engine.begin() as conn:  # a conflicting intent already holds the compensation's key
        outbox.enqueue(
            conn,
            tool="x.other",
            target="t",
            payload={},
            intent_key="saga:10:s-comp-bad:undo:release",
        )
    assert advance(engine, "s-comp-bad") is SagaState.NEEDS_HUMAN
    reason = view(engine, "s-comp-bad").reason or ""
    assert "could not be recorded" in reason
    assert "IntentConflict" in reason


# --- approval -------------------------------------------------------------------------------


def require_approval(engine: Engine, tool: str, ttl_s: float = 3600) -> None:
    """Record the sagas' tools' policies, ``tool``'s requiring approval (as a starting worker
    would: it publishes every tool it loads, and an unpublished one is then refused)."""
    tools = {"deploy.create_release", "deploy.delete_release", "lb.point", "chat.post", tool}
    with engine.begin() as conn:
        for name in sorted(tools):
            conn.execute(
                text(
                    "INSERT INTO outbox.tool_policies (tool, approval_required, approval_ttl_s)"
                    " VALUES (:tool, :required, :ttl)"
                ),
                {"tool": name, "required": name == tool, "ttl": ttl_s},
            )


def test_a_held_step_approved_early_stays_held(engine: Engine) -> None:
    """Approving a held step moves it to planned but keeps it held until the saga releases it."""
    require_approval(engine, "lb.point", ttl_s=600)
    release, point, _ = open_saga(engine, "s-approve", THREE)
    assert point.state is State.AWAITING_APPROVAL
    assert point.approval_expires_at is not None
    assert point.approval_expires_at >= HELD_UNTIL
    with Session(engine) as session, session.begin():
        approved = outbox.approve(session, point.id, by="alice", payload_hash=point.payload_hash)
    assert approved.state is State.PLANNED
    assert approved.available_at >= HELD_UNTIL
    with engine.connect() as conn, conn.begin() as tx:
        claimed = sql.relay.claim_and_mark_due(conn, limit=10, republish_after_s=60)
        tx.rollback()
    assert [c.id for c in claimed] == [release.id]
    advance(engine, "s-approve")
    assert is_held(engine, point.id)
    finish(engine, release.id, State.CONFIRMED)
    advance(engine, "s-approve")
    assert not is_held(engine, point.id)


def test_a_held_step_awaiting_approval_gets_its_ttl_when_released(
    engine: Engine, webhooks_on: None
) -> None:
    """A held step awaiting approval never expires while held; released, its TTL starts and
    its approval is requested then, with that expiry."""
    require_approval(engine, "lb.point", ttl_s=600)
    release, point, _ = open_saga(engine, "s-ttl", THREE)
    with engine.begin() as conn:  # far past its TTL: still not expired, since it is held
        conn.execute(
            text(
                "UPDATE outbox.operations SET created_at = created_at - interval '2 days'"
                " WHERE id = :id"
            ),
            {"id": point.id},
        )
    with engine.connect() as conn:
        assert approval.expire_due_and_commit(conn).expired == 0
    assert reload(engine, point.id).state is State.AWAITING_APPROVAL
    finish(engine, release.id, State.CONFIRMED)
    advance(engine, "s-ttl")
    released = reload(engine, point.id)
    assert released.state is State.AWAITING_APPROVAL
    assert released.approval_expires_at is not None
    assert released.approval_expires_at - released.available_at == timedelta(seconds=600)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT event, payload FROM outbox.webhook_deliveries"
                " WHERE operation_id = :id ORDER BY created_at"
            ),
            {"id": point.id},
        ).all()
    assert [row[0] for row in rows] == ["approval_requested"]
    assert rows[0][1]["data"]["approval_expires_at"] == iso_utc(released.approval_expires_at)


# --- cancel_saga ----------------------------------------------------------------------------


def test_cancel_saga_undoes_the_confirmed_steps_and_cancels_the_rest(engine: Engine) -> None:
    """Cancelling: held steps cancelled, confirmed ones undone, then compensated."""
    release, point, announce = open_saga(engine, "s-cancel", THREE)
    finish(engine, release.id, State.CONFIRMED)
    advance(engine, "s-cancel")
    with Session(engine) as session, session.begin():
        cancelled = outbox.cancel_saga(session, "s-cancel", by="bob", reason="wrong version")
    assert cancelled.state is SagaState.COMPENSATING
    assert cancelled.cancelled_by == "bob"
    assert reload(engine, point.id).state is State.CANCELLED  # released, never sent
    assert reload(engine, announce.id).state is State.CANCELLED  # held
    (undo,) = compensations(engine, "s-cancel")
    finish(engine, undo.id, State.CONFIRMED)
    assert advance(engine, "s-cancel") is SagaState.COMPENSATED
    with Session(engine) as session, pytest.raises(SagaNotRunning):
        outbox.cancel_saga(session, "s-cancel", by="bob", reason="again")


def test_cancel_saga_with_nothing_applied_ends_cancelled(engine: Engine) -> None:
    """Cancelling a saga nothing of which was sent ends it cancelled at once."""
    ops = open_saga(engine, "s-cancel-early", THREE)
    with Session(engine) as session, session.begin():
        cancelled = outbox.cancel_saga(session, "s-cancel-early", by="bob", reason="not now")
    assert cancelled.state is SagaState.CANCELLED
    assert [reload(engine, op.id).state for op in ops] == [State.CANCELLED] * 3


def test_cancel_saga_waits_for_a_step_in_flight(engine: Engine) -> None:
    """A step in flight at the cancel is waited for, then undone if it was applied."""
    release, _, _ = open_saga(engine, "s-cancel-flight", THREE)
    send(engine, release.id)
    with Session(engine) as session, session.begin():
        cancelled = outbox.cancel_saga(session, "s-cancel-flight", by="bob", reason="stop")
    assert cancelled.state is SagaState.COMPENSATING
    assert compensations(engine, "s-cancel-flight") == []
    confirm = transitions.confirm(
        release.id,
        from_state=State.SENT,
        actor=Actor.DISPATCHER,
        attempt=1,
        reason="201",
        remote_ref="rel-1",
    )
    with engine.connect() as conn:
        transitions.apply_and_commit(conn, confirm)
    advance(engine, "s-cancel-flight")
    assert [op.payload for op in compensations(engine, "s-cancel-flight")] == [
        {"release": "rel-1", "why": "undo"}
    ]


# --- the periodic pass, the nudge, the reads ------------------------------------------------


def test_the_periodic_pass_advances_due_sagas_and_the_nudge_finds_them(engine: Engine) -> None:
    """The periodic pass advances every due live saga; a nudge by operation finds its saga."""
    first, _, _ = open_saga(engine, "s-due-1", THREE)
    second, _, _ = open_saga(engine, "s-due-2", THREE)
    finish(engine, first.id, State.CONFIRMED)
    finish(engine, second.id, State.FAILED)
    done = advance_due_sagas_and_commit(engine)
    assert (done.advanced, done.failed) == (2, 0)
    assert done.moves == {"compensating": 1, "compensated": 1}
    assert advance_due_sagas_and_commit(engine).advanced == 0  # looked at again later
    nudged = nudge_sagas_of_and_commit(engine, [first.id])
    assert nudged.advanced == 1


def test_list_sagas_filters_by_state(engine: Engine) -> None:
    """list_sagas lists newest first, filtered by state; a bad state names the field."""
    open_saga(engine, "s-list-1", THREE[:1])
    (only,) = open_saga(engine, "s-list-2", THREE[:1])
    finish(engine, only.id, State.FAILED)
    advance(engine, "s-list-2")
    with Session(engine) as session:
        everything = outbox.list_sagas(session)
        compensated = outbox.list_sagas(session, state="compensated")
        with pytest.raises(outbox.InvalidSagaRequest) as bad:
            outbox.list_sagas(session, state="done")
    assert [s.key for s in everything] == ["s-list-2", "s-list-1"]
    assert [(s.key, s.steps) for s in compensated] == [("s-list-2", 1)]
    assert bad.value.field == "state"
    shown = json.loads(json.dumps(view(engine, "s-list-2").to_dict()))  # the --json shape
    assert shown["state"] == "compensated"
    assert shown["steps"][0]["state"] == "failed"
    assert shown["steps"][0]["compensate"]["payload"] == {"release": "{remote_ref}", "why": "undo"}
    assert [e["to_state"] for e in shown["events"]] == ["running", "compensating", "compensated"]
    assert json.loads(json.dumps([s.to_dict() for s in everything]))[0]["key"] == "s-list-2"


def test_list_sagas_pages_after_a_position(engine: Engine) -> None:
    """``after=`` a page's last position gives the next page: each saga once, in order, the
    sagas of one instant ordered by key."""
    for key in ("s-at-b", "s-at-a", "s-at-c"):
        open_saga(engine, key, THREE[:1])
    with engine.begin() as conn:  # three sagas opened in the same microsecond
        conn.execute(
            text(
                "UPDATE outbox.sagas SET created_at = (SELECT created_at FROM outbox.sagas"
                " WHERE key = 's-at-b') WHERE key LIKE 's-at-%'"
            )
        )
    open_saga(engine, "s-later", THREE[:1])
    pages: list[list[str]] = []
    with Session(engine) as session:
        after = None
        while True:
            page = outbox.list_sagas(session, limit=2, after=after)
            if not page:
                break
            pages.append([s.key for s in page])
            after = page[-1].position
    assert pages == [["s-later", "s-at-a"], ["s-at-b", "s-at-c"]]


def test_the_async_api_runs_the_same_saga(database_url: str, engine: Engine) -> None:
    """outbox.aio's saga, step, get_saga, list_sagas and cancel_saga run the sync rules."""

    async def main() -> tuple[list[Operation], SagaView | None]:
        async_engine = create_async_engine(database_url)
        try:
            async with async_engine.begin() as conn:
                opened = await aio.saga(conn, "s-aio")
                ops = [await opened.step(**step) for step in THREE]
                again = await opened.step(**THREE[0])
                assert again.id == ops[0].id
            async with async_engine.begin() as conn:
                assert [s.key for s in await aio.list_sagas(conn)] == ["s-aio"]
                await aio.cancel_saga(conn, "s-aio", by="bob", reason="test")
            async with async_engine.connect() as conn:
                return ops, await aio.get_saga(conn, "s-aio")
        finally:
            await async_engine.dispose()

    ops, saga = asyncio.run(main())
    assert saga is not None
    assert saga.state is SagaState.CANCELLED
    assert [s.operation_id for s in saga.steps] == [op.id for op in ops]


def test_the_dispatcher_sends_only_released_steps_and_reports_saga_outcomes(
    engine: Engine,
) -> None:
    """A held step is not due for the dispatcher; a step's outcome is flagged for the nudge."""
    calls: list[str] = []
    registry = ToolRegistry(ContractTable())

    def send(call: ToolCall) -> Applied:
        calls.append(call.tool)
        return Applied(f"ref-{call.operation_id}")

    for name in ("x.a", "x.b"):
        tool(name, timeout=2, send_deadline=2, inflight_horizon=60, registry=registry)(send)
    steps = [
        {"name": "a", "tool": "x.a", "target": "t", "payload": {}},
        {"name": "b", "tool": "x.b", "target": "t", "payload": {}},
    ]
    a, b = open_saga(engine, "s-dispatch", steps)
    assert dispatch(b.id, engine=engine, registry=registry).outcome is Outcome.NOT_DUE
    report = dispatch(a.id, engine=engine, registry=registry)
    assert (report.outcome, report.saga) == (Outcome.CONFIRMED, True)
    assert nudge_sagas_of_and_commit(engine, [a.id]).advanced == 1
    assert dispatch(b.id, engine=engine, registry=registry).outcome is Outcome.CONFIRMED
    assert calls == ["x.a", "x.b"]
    assert advance(engine, "s-dispatch") is SagaState.COMPLETED
    with engine.begin() as conn:
        plain = outbox.enqueue(conn, tool="x.a", target="t", payload={"plain": True})
    assert dispatch(plain.id, engine=engine, registry=registry).saga is False


def test_retention_keeps_a_live_sagas_operations_and_prunes_a_finished_ones(
    engine: Engine,
) -> None:
    """Prune skips the operations of a live saga; a finished saga's step keeps its row."""
    windows = sql.retention.DedupWindows(dict.fromkeys(("x.a", "x.b", "x.c")))
    steps = [
        {"name": "a", "tool": "x.a", "target": "t", "payload": {}},
        {"name": "b", "tool": "x.b", "target": "t", "payload": {}},
    ]
    a, b = open_saga(engine, "s-prune", steps)
    finish(engine, a.id, State.CONFIRMED)
    advance(engine, "s-prune")

    def prune() -> int:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE outbox.operations SET resolved_at = now() - interval '1 day'"
                    " WHERE resolved_at IS NOT NULL"
                )
            )
            return sql.retention.prune_terminal(conn, older_than_s=60, limit=100, windows=windows)

    assert prune() == 0
    finish(engine, b.id, State.CONFIRMED)
    assert advance(engine, "s-prune") is SagaState.COMPLETED
    assert prune() == 2
    saga = view(engine, "s-prune")
    assert [(s.name, s.operation_id, s.state) for s in saga.steps] == [
        ("a", None, None),
        ("b", None, None),
    ]


def test_the_metrics_count_sagas_by_state(engine: Engine) -> None:
    """outbox_sagas reads every saga state, 0 for the empty ones."""
    open_saga(engine, "s-metric-1", THREE[:1])
    (only,) = open_saga(engine, "s-metric-2", THREE[:1])
    finish(engine, only.id, State.FAILED)
    advance(engine, "s-metric-2")
    samples = {
        sample.labels["state"]: sample.value
        for family in OutboxCollector(engine).collect()
        if family.name == "outbox_sagas"
        for sample in family.samples
    }
    assert samples == {
        "running": 1.0,
        "compensating": 0.0,
        "completed": 0.0,
        "compensated": 1.0,
        "needs_human": 0.0,
        "cancelled": 0.0,
    }


def test_a_saga_held_by_another_transaction_is_skipped_not_waited_for(engine: Engine) -> None:
    """While an agent's transaction adding a step holds the saga, a driver pass skips it."""
    release, _, _ = open_saga(engine, "s-busy", THREE)
    finish(engine, release.id, State.CONFIRMED)
    with Session(engine) as session, session.begin():
        outbox.saga(session, "s-busy").step(**THREE[0])  # takes the saga's row lock
        assert advance_saga_and_commit(engine, SagaRef("s-busy")) is None
        assert advance_due_sagas_and_commit(engine).busy == 1
    assert advance(engine, "s-busy") is SagaState.RUNNING
    assert [s.held for s in view(engine, "s-busy").steps] == [False, False, True]


def test_a_pass_that_dies_before_its_commit_leaves_nothing_and_the_next_resumes(
    engine: Engine,
) -> None:
    """A driver pass rolled back (its process killed before the commit) records nothing; the
    next pass records the compensation once, and further passes never again."""
    release, point = open_saga(engine, "s-crash", THREE[:2])
    finish(engine, release.id, State.CONFIRMED)
    advance(engine, "s-crash")
    finish(engine, point.id, State.FAILED)
    with engine.connect() as conn:
        conn.begin()
        done = sagas.advance(conn, "s-crash")
        assert done is not None
        assert done.state is SagaState.COMPENSATING
        conn.rollback()  # what a SIGKILL before the commit leaves
    assert compensations(engine, "s-crash") == []
    assert state_of(engine, "s-crash") is SagaState.RUNNING
    advance(engine, "s-crash")
    nudge_sagas_of_and_commit(engine, [point.id])
    advance_due_sagas_and_commit(engine)
    (undo,) = compensations(engine, "s-crash")
    assert undo.intent_key == "saga:7:s-crash:undo:release"


def test_agents_racing_on_one_saga_end_with_one_saga_and_one_operation_per_step(
    engine: Engine,
) -> None:
    """Several agents opening one saga and adding the same steps at once: one of each."""
    results: list[list[UUID]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def agent() -> None:
        try:
            start.wait(timeout=10)
            results.append([op.id for op in open_saga(engine, "s-race", THREE)])
        except BaseException as exc:  # noqa: BLE001 -- reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=agent) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert len({tuple(ids) for ids in results}) == 1
    assert len(view(engine, "s-race").steps) == 3
    with engine.connect() as conn:
        count = conn.execute(
            text("SELECT count(*) FROM outbox.operations WHERE metadata->>'saga' = 's-race'")
        ).scalar_one()
    assert count == 3
