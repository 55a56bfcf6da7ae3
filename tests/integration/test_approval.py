"""Approval before send on a real database: enqueue, the invariant, approve, reject, expiry,
cancel, races, the relay, the dispatcher's re-check and the webhooks."""

from __future__ import annotations

import base64
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

import outbox
from outbox import approval
from outbox.config import get_settings
from outbox.contracts import ContractTable, ToolContract
from outbox.errors import (
    AlreadyDecided,
    ApprovalMismatch,
    ApprovalRefused,
    NotCancellable,
    WaitTimeout,
)
from outbox.models import Operation
from outbox.relay import Relay, RelayConfig
from outbox.states import Actor, State
from outbox.tools import Applied, ToolCall, ToolRegistry, tool
from outbox.workers.dispatch import Outcome, dispatch
from outbox.workers.publish import CeleryPublisher
from tests.factories import event_count, events_of, reload

TOOL = "deploy.create_release"
SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()


def enqueue(engine: Engine, **arguments: Any) -> Operation:
    """Enqueue in a transaction of its own, committed."""
    arguments = {"tool": TOOL, "target": "project-a", "payload": {"release": 42}} | arguments
    with Session(engine) as session, session.begin():
        return outbox.enqueue(session, **arguments)


def awaiting(engine: Engine, **arguments: Any) -> Operation:
    """A committed operation that requires approval (asked for by the call)."""
    return enqueue(engine, require_approval=True, **arguments)


def approve(engine: Engine, op: Operation, **arguments: Any) -> Operation:
    """Approve in a transaction of its own, committed; ``by`` and the right hash by default."""
    arguments = {"by": "alice", "payload_hash": op.payload_hash} | arguments
    with Session(engine) as session, session.begin():
        return outbox.approve(session, op.id, **arguments)


def expire(engine: Engine, op: Operation) -> None:
    """Move the operation's approval expiry into the past (database clock)."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox.operations SET approval_expires_at = now() - interval '1 second'"
                " WHERE id = :id"
            ),
            {"id": op.id},
        )


def deliveries(engine: Engine, op: Operation) -> list[tuple[str, dict[str, Any]]]:
    """The webhook deliveries written for ``op``: (event, body), oldest first."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT event, payload FROM outbox.webhook_deliveries WHERE operation_id = :id"
                " ORDER BY created_at, id"
            ),
            {"id": op.id},
        )
        return [(row[0], row[1]) for row in rows]


@pytest.fixture
def webhooks_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Webhooks configured with the default events."""
    monkeypatch.setenv("OUTBOX_WEBHOOK_URL", "https://hooks.example.com/outbox")
    monkeypatch.setenv("OUTBOX_WEBHOOK_SECRET", SECRET)
    monkeypatch.delenv("OUTBOX_WEBHOOK_EVENTS", raising=False)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


# --- enqueue ---------------------------------------------------------------------------------


def test_a_call_that_requires_approval_is_created_awaiting_it(engine: Engine) -> None:
    """require_approval=True creates the operation awaiting_approval, expiring in 24 h."""
    op = awaiting(engine)
    assert op.state is State.AWAITING_APPROVAL
    stored = reload(engine, op.id)
    assert stored.state is State.AWAITING_APPROVAL
    assert stored.approval_required
    assert stored.approval_expires_at is not None
    assert stored.created_at is not None
    hours = (stored.approval_expires_at - stored.created_at).total_seconds() / 3600
    assert 23.9 < hours < 24.1
    assert [(e.from_state, e.to_state) for e in events_of(engine, op.id)] == [
        (None, State.AWAITING_APPROVAL)
    ]


def test_the_tools_policy_in_the_database_makes_enqueue_require_approval(engine: Engine) -> None:
    """A tool whose published policy requires approval gets it without the call asking, with
    the tool's TTL, and a call cannot loosen it."""
    contract = ToolContract(name=TOOL, approval_required=True, approval_ttl_s=600)
    approval.publish_policies_committed(engine, [contract, ToolContract(name="deploy.other")])
    op = enqueue(engine, require_approval=False)
    stored = reload(engine, op.id)
    assert stored.state is State.AWAITING_APPROVAL
    assert stored.approval_expires_at is not None
    assert (stored.approval_expires_at - stored.created_at).total_seconds() == pytest.approx(
        600, abs=5
    )
    other = enqueue(engine, tool="deploy.other", target="b")
    assert other.state is State.PLANNED


def test_enqueue_many_reads_each_tools_policy(engine: Engine) -> None:
    """In a batch, each intent waits for approval if its tool or its call requires it."""
    approval.publish_policies_committed(
        engine, [ToolContract(name=TOOL, approval_required=True), ToolContract(name="deploy.other")]
    )
    with Session(engine) as session, session.begin():
        ops = outbox.enqueue_many(
            session,
            [
                outbox.Intent(TOOL, "a", {"n": 1}),
                outbox.Intent("deploy.other", "b", {"n": 2}),
                outbox.Intent("deploy.other", "c", {"n": 3}, require_approval=True),
            ],
        )
    assert [op.state for op in ops] == [
        State.AWAITING_APPROVAL,
        State.PLANNED,
        State.AWAITING_APPROVAL,
    ]


def test_re_enqueue_while_awaiting_returns_the_same_operation_and_one_request(
    engine: Engine, webhooks_on: None
) -> None:
    """The same intent again returns the same operation and writes no second approval request."""
    first = awaiting(engine, intent_key="deploy-42")
    again = awaiting(engine, intent_key="deploy-42")
    assert again.id == first.id
    assert [event for event, _ in deliveries(engine, first)] == ["approval_requested"]


def test_the_approval_request_webhook_carries_what_the_approver_needs(
    engine: Engine, webhooks_on: None
) -> None:
    """approval_requested names the tool, target, payload, its hash, the key, the requester and
    the exact approve and reject commands."""
    op = awaiting(engine, intent_key="deploy-43", requested_by="agent-7")
    ((event, body),) = deliveries(engine, op)
    data = body["data"]
    assert (event, body["type"]) == ("approval_requested", "operation.approval_requested")
    assert (data["tool"], data["target"], data["payload"]) == (TOOL, "project-a", {"release": 42})
    assert (data["payload_hash"], data["intent_key"]) == (op.payload_hash, "deploy-43")
    assert data["requested_by"] == "agent-7"
    assert data["approval_expires_at"] is not None
    assert data["approve_command"] == (
        f"outbox ops approve {op.id} --by NAME --payload-hash {op.payload_hash}"
    )
    assert data["reject_command"] == f"outbox ops reject {op.id} --by NAME --reason TEXT"


# --- the invariant ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("assignments", "constraint"),
    [
        (
            "state = 'sent', attempts = 1, sent_at = now(), first_sent_at = now()",
            "ck_operations_approval_before_send",
        ),
        ("state = 'planned'", "ck_operations_approval_before_send"),
        ("approved_payload_hash = payload_hash", "ck_operations_awaiting_approval_unsent"),
        ("decided_by = 'mallory', decided_at = now()", "ck_operations_awaiting_approval_unsent"),
        ("decided_by = 'mallory'", "ck_operations_decision_recorded"),
    ],
)
def test_the_database_refuses_an_unapproved_operation_past_approval(
    engine: Engine, assignments: str, constraint: str
) -> None:
    """A raw UPDATE that would send (or plan) an unapproved operation fails, naming the rule."""
    op = awaiting(engine)
    with pytest.raises(IntegrityError, match=constraint), engine.begin() as conn:
        conn.execute(
            text(f"UPDATE outbox.operations SET {assignments} WHERE id = :id"), {"id": op.id}
        )
    assert reload(engine, op.id).state is State.AWAITING_APPROVAL


def test_the_database_refuses_an_approval_of_another_payload(engine: Engine) -> None:
    """An approval recorded for another hash does not let the operation be sent."""
    op = approve(engine, awaiting(engine))
    refused = pytest.raises(IntegrityError, match="ck_operations_approval_before_send")
    with refused, engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox.operations SET approved_payload_hash = repeat('0', 64),"
                " state = 'sent', attempts = 1, sent_at = now(), first_sent_at = now()"
                " WHERE id = :id"
            ),
            {"id": op.id},
        )


# --- approve and reject --------------------------------------------------------------------------


def test_approval_with_the_right_hash_plans_it_due_now_with_the_approver_recorded(
    engine: Engine,
) -> None:
    """approve moves it to planned, due at once, with who, when and the hash in row and event."""
    op = awaiting(engine)
    approved = approve(engine, op, note="looks right")
    assert approved.state is State.PLANNED
    stored = reload(engine, op.id)
    assert (stored.decided_by, stored.approved_payload_hash) == ("alice", op.payload_hash)
    assert stored.decided_at is not None
    assert stored.available_at <= stored.decided_at
    last = events_of(engine, op.id)[-1]
    assert (last.from_state, last.to_state, last.actor) == (
        State.AWAITING_APPROVAL,
        State.PLANNED,
        Actor.OPERATOR.value,
    )
    assert last.detail == {"by": "alice", "note": "looks right", "payload_hash": op.payload_hash}


def test_a_wrong_hash_is_refused_and_nothing_is_written(engine: Engine) -> None:
    """ApprovalMismatch names both hashes' prefixes; the row and its events are untouched."""
    op = awaiting(engine)
    before, events = reload(engine, op.id), event_count(engine, op.id)
    wrong = "f" * 64
    with pytest.raises(ApprovalMismatch, match=rf"{wrong[:12]}.*{op.payload_hash[:12]}") as caught:
        approve(engine, op, payload_hash=wrong)
    assert (caught.value.given, caught.value.expected) == (wrong, op.payload_hash)
    assert reload(engine, op.id) == before
    assert event_count(engine, op.id) == events


@pytest.mark.parametrize("field", ["by", "payload_hash"])
def test_an_approval_without_who_or_hash_is_refused_naming_the_field(
    engine: Engine, field: str
) -> None:
    """An empty ``by`` or ``payload_hash`` raises ApprovalRefused naming it."""
    op = awaiting(engine)
    with pytest.raises(ApprovalRefused) as caught:
        approve(engine, op, **{field: "  "})
    assert caught.value.field == field
    assert reload(engine, op.id).state is State.AWAITING_APPROVAL


def test_an_approval_is_single_use(engine: Engine) -> None:
    """A second approval is refused as already decided, naming the first approver."""
    op = awaiting(engine)
    approve(engine, op)
    with pytest.raises(AlreadyDecided, match="already decided by alice at ") as caught:
        approve(engine, op, by="bob")
    assert caught.value.decided_by == "alice"
    assert caught.value.state is State.PLANNED


def test_two_approvers_racing_one_wins_the_other_is_told_who(engine: Engine) -> None:
    """Of two uncommitted approvals, the second waits for the first and gets AlreadyDecided."""
    op = awaiting(engine)
    outcome: dict[str, BaseException | Operation] = {}
    with Session(engine) as first:
        first.begin()
        outbox.approve(first, op.id, by="alice", payload_hash=op.payload_hash)

        def second() -> None:
            try:
                outcome["bob"] = approve(engine, op, by="bob")
            except BaseException as exc:  # noqa: BLE001 -- handed to the test's thread
                outcome["bob"] = exc

        racer = threading.Thread(target=second)
        racer.start()
        racer.join(timeout=1)
        assert racer.is_alive()  # waiting for alice's row lock
        first.commit()
    racer.join(timeout=10)
    refused = outcome["bob"]
    assert isinstance(refused, AlreadyDecided)
    assert "already decided by alice" in str(refused)
    assert reload(engine, op.id).decided_by == "alice"


def test_reject_cancels_it_with_the_reason_and_wait_returns_it(engine: Engine) -> None:
    """reject moves it to cancelled with who and why; wait returns it at once."""
    op = awaiting(engine)
    with Session(engine) as session, session.begin():
        rejected = outbox.reject(session, op.id, by="carol", reason="wrong project")
    assert rejected.state is State.CANCELLED
    assert outbox.wait(op.id, timeout=5, engine=engine).state is State.CANCELLED
    stored = reload(engine, op.id)
    assert (stored.decided_by, stored.approved_payload_hash) == ("carol", None)
    assert events_of(engine, op.id)[-1].reason == "rejected by carol: wrong project"
    with pytest.raises(AlreadyDecided, match="already decided by carol"):
        approve(engine, op)


def test_a_rejection_without_a_reason_is_refused(engine: Engine) -> None:
    """reject with an empty reason raises ApprovalRefused naming ``reason``."""
    op = awaiting(engine)
    with pytest.raises(ApprovalRefused) as caught, Session(engine) as session, session.begin():
        outbox.reject(session, op.id, by="carol", reason="")
    assert caught.value.field == "reason"


def test_wait_returns_an_operation_awaiting_approval(engine: Engine) -> None:
    """wait() returns an operation awaiting approval, like one that needs a human."""
    op = awaiting(engine)
    assert outbox.wait(op.id, timeout=5, engine=engine).state is State.AWAITING_APPROVAL


def test_wait_through_approval_waits_on_for_the_outcome(engine: Engine) -> None:
    """wait(through_approval=True) keeps waiting while the operation awaits approval."""
    op = awaiting(engine)
    with pytest.raises(WaitTimeout) as caught:
        outbox.wait(op.id, timeout=0.5, engine=engine, poll_interval=0.1, through_approval=True)
    last_seen = caught.value.operation
    assert isinstance(last_seen, Operation)
    assert last_seen.state is State.AWAITING_APPROVAL


def test_the_agent_can_cancel_an_operation_awaiting_approval(engine: Engine) -> None:
    """outbox.cancel works from awaiting_approval; a later approval is refused."""
    op = awaiting(engine)
    with Session(engine) as session, session.begin():
        assert outbox.cancel(session, op.id).state is State.CANCELLED
    with pytest.raises(AlreadyDecided, match="cancelled, not awaiting approval"):
        approve(engine, op)


def test_an_approved_and_sent_operation_cannot_be_cancelled(engine: Engine) -> None:
    """Cancel still refuses an operation past planned, approved or not."""
    op = approve(engine, awaiting(engine))
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox.operations SET state = 'sent', attempts = 1, sent_at = now(),"
                " first_sent_at = now() WHERE id = :id"
            ),
            {"id": op.id},
        )
    with pytest.raises(NotCancellable), Session(engine) as session, session.begin():
        outbox.cancel(session, op.id)


# --- expiry -----------------------------------------------------------------------------------


def test_an_expired_approval_is_refused_then_cancelled_by_the_sweep(
    engine: Engine, webhooks_on: None
) -> None:
    """Past its TTL an approval is refused; the sweep cancels it ("approval expired", with its
    webhook); it stays refused."""
    op = awaiting(engine)
    expire(engine, op)
    with pytest.raises(AlreadyDecided, match=r"expired at .*the sweep cancels it") as caught:
        approve(engine, op)
    assert caught.value.expired_at is not None
    assert reload(engine, op.id).state is State.AWAITING_APPROVAL
    with engine.connect() as conn:
        assert approval.expire_due_and_commit(conn) == approval.ExpiryResult(expired=1, missed=0)
    stored = reload(engine, op.id)
    assert stored.state is State.CANCELLED
    last = events_of(engine, op.id)[-1]
    assert (last.actor, last.reason) == (Actor.SWEEP.value, "approval expired")
    assert [event for event, _ in deliveries(engine, op)] == [
        "approval_requested",
        "approval_expired",
    ]
    with pytest.raises(AlreadyDecided, match=r"expired at .* and it is cancelled"):
        approve(engine, op)


def test_the_sweep_leaves_approvals_that_have_not_expired(engine: Engine) -> None:
    """Only an approval past its expiry is cancelled."""
    op = awaiting(engine)
    with engine.connect() as conn:
        assert approval.expire_due_and_commit(conn).expired == 0
    assert reload(engine, op.id).state is State.AWAITING_APPROVAL


# --- relay and dispatcher ---------------------------------------------------------------------


def test_the_relay_never_publishes_an_operation_awaiting_approval(
    engine: Engine, database_url: str
) -> None:
    """A relay pass claims the planned operation and leaves the one awaiting approval alone
    until it is approved."""
    from outbox.config import load_settings  # noqa: PLC0415 -- as tests/integration/test_relay.py
    from outbox.deployment import deployment_name  # noqa: PLC0415
    from outbox.workers.app import celery_settings  # noqa: PLC0415

    settings = load_settings(database_url=database_url, broker_url=None)
    app = Celery("outbox-test-approval")
    app.conf.update(celery_settings(settings, deployment=deployment_name(settings)))
    held = awaiting(engine)
    free = enqueue(engine, target="project-b")
    publisher = CeleryPublisher(app, ops_per_message=1, spread=16)
    try:
        relay = Relay(engine, publisher, RelayConfig())
        assert relay.run_once().claimed == 1
        assert reload(engine, free.id).published_at is not None
        assert reload(engine, held.id).published_at is None
        assert relay.run_once().claimed == 0
        approve(engine, held)
        assert relay.run_once().claimed == 1
    finally:
        publisher.close()


def test_the_dispatcher_holds_back_an_unapproved_operation_of_a_tool_requiring_approval(
    engine: Engine, webhooks_on: None
) -> None:
    """An operation enqueued before its tool's policy reached the database goes back to
    awaiting_approval at dispatch, unsent, with its approval request; once approved it is sent."""
    calls: list[ToolCall] = []
    registry = ToolRegistry(ContractTable())

    def send(call: ToolCall) -> Applied:
        calls.append(call)
        return Applied(f"ref-{call.operation_id}")

    tool(
        TOOL,
        timeout=2,
        send_deadline=2,
        inflight_horizon=60,
        approval="required",
        approval_ttl_s=300,
        registry=registry,
    )(send)
    op = enqueue(engine)
    assert op.state is State.PLANNED
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.AWAITING_APPROVAL
    assert calls == []
    stored = reload(engine, op.id)
    assert (stored.state, stored.approval_required) == (State.AWAITING_APPROVAL, True)
    assert [event for event, _ in deliveries(engine, op)] == ["approval_requested"]
    approve(engine, stored)
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.CONFIRMED
    assert len(calls) == 1


def test_metrics_show_what_waits_for_approval_and_count_the_decisions(engine: Engine) -> None:
    """The exporter reports operations awaiting approval, the oldest's age, and counts
    approvals, rejections and expiries."""
    from outbox.metrics import OutboxCollector  # noqa: PLC0415 -- as tests/integration/test_metrics.py
    from tests.integration.test_metrics import scrape  # noqa: PLC0415

    collector = OutboxCollector(engine)
    assert collector.baseline()
    approved, rejected, expired, waiting = (awaiting(engine, target=t) for t in "abcd")
    approve(engine, approved)
    with Session(engine) as session, session.begin():
        outbox.reject(session, rejected.id, by="carol", reason="no")
    expire(engine, expired)
    with engine.connect() as conn:
        approval.expire_due_and_commit(conn)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox.operations SET updated_at = now() - interval '90 seconds'"
                " WHERE id = :id"
            ),
            {"id": waiting.id},
        )
    samples = scrape(collector)
    assert samples("outbox_operations", state="awaiting_approval", tool=TOOL) == 1
    assert samples("outbox_oldest_age_seconds", state="awaiting_approval") >= 90
    for decision in ("approved", "rejected", "expired"):
        assert samples("outbox_approval_decisions_total", decision=decision) == 1


def test_an_unknown_operation_id_is_not_found(engine: Engine) -> None:
    """approve of an id with no operation raises OperationNotFound."""
    with pytest.raises(outbox.OperationNotFound), Session(engine) as session, session.begin():
        outbox.approve(session, uuid.uuid4(), by="alice", payload_hash="0" * 64)
