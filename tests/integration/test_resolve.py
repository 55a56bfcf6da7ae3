"""Operator resolution on a real database: verdicts, refusals, the lock, the CAS and the horizon."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

import outbox
from outbox import sql, transitions
from outbox.approval import approve_command, reject_command
from outbox.contracts import CONTRACTS, ToolContract
from outbox.errors import (
    OperationBusy,
    OperationNotFound,
    ResolutionRefused,
    StaleResolution,
    StaleTransition,
)
from outbox.locks import operation_lock_key
from outbox.models import Operation
from outbox.resolve import RESOLVABLE_STATES, resolve, waiting_reasons
from outbox.states import Actor, State
from tests.factories import (
    age,
    event_count,
    events_of,
    make_operation,
    mark_published,
    move,
    reload,
)

#: A tool registered by the `tool` fixture with a short, known in-flight horizon.
TOOL = "test.resolve"
HORIZON_S = 60.0
NOTE = "checked the remote's console: release 42 exists"


@pytest.fixture(autouse=True)
def tool(monkeypatch: pytest.MonkeyPatch) -> ToolContract:
    """Register TOOL's contract for this test only, and forget it afterwards."""
    contract = ToolContract(name=TOOL, timeout_s=1, send_deadline_s=1, inflight_horizon_s=HORIZON_S)
    # ContractTable has no public way to unregister one tool; setitem restores the table as
    # it was (absent or another contract), whatever other tests registered around us.
    monkeypatch.setitem(CONTRACTS._contracts, TOOL, contract)
    return contract


def committed_resolve(engine: Engine, op_id: uuid.UUID, **arguments: Any) -> Operation:
    """Resolve in a transaction of its own, committed; ``by`` and ``note`` have defaults."""
    arguments = {"by": "alice", "note": NOTE} | arguments
    with Session(engine) as session, session.begin():
        return resolve(session, op_id, **arguments)


def waiting(engine: Engine, state: State = State.NEEDS_HUMAN, *, aged: bool = True) -> Operation:
    """An operation of TOOL in ``state`` after one attempt; ``aged``: its horizon has passed."""
    op = make_operation(engine, state, tool=TOOL)
    if aged:
        # Both by the same amount: the schema checks first_sent_at <= sent_at.
        age(engine, op.id, HORIZON_S + 1, "sent_at", "first_sent_at")
    return reload(engine, op.id)


def assert_untouched(engine: Engine, before: Operation, events_before: int) -> None:
    """The committed row and its audit trail are exactly as they were."""
    assert reload(engine, before.id) == before
    assert event_count(engine, before.id) == events_before


@pytest.mark.parametrize("state", [State.UNKNOWN, State.NEEDS_HUMAN])
def test_applied_confirms_with_the_remote_ref_and_an_operator_event(
    engine: Engine, state: State
) -> None:
    """--applied confirms it with the remote ref; the event names the operator and the note."""
    op = waiting(engine, state, aged=False)
    done = committed_resolve(engine, op.id, applied=True, remote_ref="rel-42")
    assert done.state is State.CONFIRMED
    assert done.remote_ref == "rel-42"
    assert done.resolved_at is not None
    assert reload(engine, op.id) == done
    last = events_of(engine, op.id)[-1]
    assert (last.from_state, last.to_state, last.actor, last.attempt) == (
        state,
        State.CONFIRMED,
        "operator",
        op.attempts,
    )
    assert last.reason == f"resolved by alice: {NOTE}"
    assert last.detail == {
        "by": "alice",
        "note": NOTE,
        "forced": False,
        "applied": True,
        "replay": False,
    }


def test_not_applied_fails_and_clears_maybe_applied(engine: Engine) -> None:
    """--not-applied fails the operation, clears maybe_applied and keeps the note as last error."""
    op = waiting(engine)
    assert op.maybe_applied
    done = committed_resolve(engine, op.id, applied=False, note="no release in the console")
    assert done.state is State.FAILED
    assert done.maybe_applied is False
    assert done.last_error == "no release in the console"
    assert done.resolved_at is not None
    assert done.remote_ref is None
    last = events_of(engine, op.id)[-1]
    assert (last.to_state, last.actor) == (State.FAILED, "operator")
    assert last.detail is not None
    assert (last.detail["applied"], last.detail["replay"]) == (False, False)


def test_replay_plans_the_same_operation_again(engine: Engine) -> None:
    """--not-applied --replay moves it back to planned, unpublished, same key, payload and hash."""
    op = waiting(engine, State.UNKNOWN)
    mark_published(engine, op.id)  # stale from its first trip through the relay
    done = committed_resolve(engine, op.id, applied=False, replay=True)
    assert done.state is State.PLANNED
    assert done.published_at is None
    assert done.maybe_applied is False
    assert done.replay_deadline is None
    assert done.resolved_at is None
    assert (done.id, done.intent_key, done.payload, done.payload_hash, done.attempts) == (
        op.id,
        op.intent_key,
        op.payload,
        op.payload_hash,
        op.attempts,
    )
    with engine.connect() as conn:
        due = conn.execute(
            text("SELECT available_at <= clock_timestamp() FROM outbox.operations WHERE id = :id"),
            {"id": op.id},
        ).scalar_one()
    assert due, "a replay authorised by an operator is due at once"
    last = events_of(engine, op.id)[-1]
    assert (last.from_state, last.to_state, last.actor) == (
        State.UNKNOWN,
        State.PLANNED,
        "operator",
    )
    assert last.detail is not None
    assert last.detail["replay"] is True


#: Every state of outbox/states.py that resolve refuses: a state added there is tested here.
OTHER_STATES = sorted(set(State) - RESOLVABLE_STATES)


@pytest.mark.parametrize("state", OTHER_STATES)
def test_other_states_are_refused_and_nothing_is_written(engine: Engine, state: State) -> None:
    """Every verdict on an operation outside unknown and needs_human is refused, writing nothing."""
    op = make_operation(engine, state, tool=TOOL)
    events_before = event_count(engine, op.id)
    verdicts: list[dict[str, Any]] = [
        {"applied": True, "remote_ref": "rel-1"},
        {"applied": False, "force": True},
        {"applied": False, "replay": True, "force": True},
    ]
    for verdict in verdicts:
        with pytest.raises(ResolutionRefused, match=f"is {state.value} at attempt") as refused:
            committed_resolve(engine, op.id, **verdict)
        assert refused.value.operation_id == op.id
        assert not isinstance(refused.value, StaleResolution)
    assert_untouched(engine, op, events_before)


def test_resolving_an_operation_awaiting_approval_names_the_approve_and_reject_commands(
    engine: Engine,
) -> None:
    """A verdict on an operation awaiting approval is refused with the exact approve and reject
    commands, writing nothing."""
    op = make_operation(engine, State.AWAITING_APPROVAL, tool=TOOL)
    events_before = event_count(engine, op.id)
    with pytest.raises(ResolutionRefused, match="waits for a person's approval") as refused:
        committed_resolve(engine, op.id, applied=True, remote_ref="rel-1")
    message = str(refused.value)
    assert approve_command(op) in message
    assert reject_command(op) in message
    assert (refused.value.field, refused.value.retry_after_s) == (None, None)
    assert_untouched(engine, op, events_before)


def test_a_wrong_payload_hash_is_refused(engine: Engine) -> None:
    """A payload hash other than the stored one is refused naming both, and nothing is written."""
    op = waiting(engine)
    events_before = event_count(engine, op.id)
    approved = "0" * 64
    with pytest.raises(ResolutionRefused, match="payload hash mismatch") as refused:
        committed_resolve(engine, op.id, applied=True, remote_ref="r", payload_hash=approved)
    assert approved in str(refused.value)
    assert op.payload_hash in str(refused.value)
    assert refused.value.field == "payload_hash"
    assert_untouched(engine, op, events_before)


def test_the_attempt_and_hash_the_operator_saw_are_accepted(engine: Engine) -> None:
    """The attempt and payload hash shown by `ops show` let the verdict through."""
    op = waiting(engine)
    done = committed_resolve(
        engine,
        op.id,
        applied=True,
        remote_ref="rel-7",
        expect_attempts=op.attempts,
        payload_hash=op.payload_hash.upper(),
    )
    assert done.state is State.CONFIRMED


def test_a_stale_attempt_is_refused(engine: Engine) -> None:
    """An operator who looked at attempt 1 after the reconciler started attempt 2 is refused."""
    seen = waiting(engine, State.UNKNOWN)
    replanned = move(engine, seen, State.PLANNED, Actor.RECONCILER)
    sent = move(engine, replanned, State.SENT, Actor.DISPATCHER)
    now = move(engine, sent, State.UNKNOWN, Actor.DISPATCHER, last_error="timeout")
    events_before = event_count(engine, seen.id)
    with pytest.raises(StaleResolution, match="moved on to attempt 2") as refused:
        committed_resolve(
            engine, seen.id, applied=True, remote_ref="r", expect_attempts=seen.attempts
        )
    assert isinstance(refused.value, ResolutionRefused)
    assert isinstance(refused.value, StaleTransition)
    assert refused.value.expected == (None, 1)
    assert refused.value.actual == (State.UNKNOWN, 2)
    assert_untouched(engine, now, events_before)


def test_not_applied_before_the_horizon_is_refused_unless_forced(engine: Engine) -> None:
    """Before the tool's horizon --not-applied and --replay are refused; --force lets them by."""
    op = waiting(engine, aged=False)
    events_before = event_count(engine, op.id)
    for replay in (False, True):
        with pytest.raises(ResolutionRefused, match=r"in-flight horizon \(60s\)") as refused:
            committed_resolve(engine, op.id, applied=False, replay=replay)
        retry_after = refused.value.retry_after_s
        assert retry_after is not None
        assert 0 < retry_after <= HORIZON_S
        assert "--force" in str(refused.value)
    assert_untouched(engine, op, events_before)

    done = committed_resolve(engine, op.id, applied=False, force=True)
    assert done.state is State.FAILED
    detail = events_of(engine, op.id)[-1].detail
    assert detail is not None
    assert detail["forced"] is True


def test_the_horizon_passes_by_the_database_clock(engine: Engine) -> None:
    """Once sent_at lies further back than the horizon, --not-applied needs no force."""
    op = waiting(engine, aged=False)
    age(engine, op.id, HORIZON_S - 5, "sent_at", "first_sent_at")
    with pytest.raises(ResolutionRefused, match="horizon"):
        committed_resolve(engine, op.id, applied=False)
    age(engine, op.id, 6, "sent_at", "first_sent_at")
    assert committed_resolve(engine, op.id, applied=False).state is State.FAILED


def test_an_unregistered_tool_gets_the_default_horizon_and_the_message_says_so(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tool this process does not know is judged by the default 600s horizon, said aloud."""
    monkeypatch.setattr(CONTRACTS, "loaded", False)  # let enqueue accept the unknown tool
    op = make_operation(engine, State.NEEDS_HUMAN, tool="test.not_registered")
    with pytest.raises(ResolutionRefused, match=r"default in-flight horizon \(600s") as refused:
        committed_resolve(engine, op.id, applied=False)
    assert "'test.not_registered' is not registered" in str(refused.value)
    age(engine, op.id, 601, "sent_at", "first_sent_at")
    assert committed_resolve(engine, op.id, applied=False).state is State.FAILED


def test_an_operation_never_sent_has_no_horizon_to_wait_for(engine: Engine) -> None:
    """An operation the relay sent to a human before any attempt can be failed at once."""
    planned = make_operation(engine, State.PLANNED, tool=TOOL)
    stuck = move(engine, planned, State.NEEDS_HUMAN, Actor.RELAY, reason="tool not registered")
    assert stuck.sent_at is None
    assert committed_resolve(engine, stuck.id, applied=False).state is State.FAILED


def test_a_held_lock_makes_it_busy_and_nothing_is_written(engine: Engine) -> None:
    """While a dispatcher or the sweep holds the operation's lock, resolve raises OperationBusy."""
    op = waiting(engine)
    events_before = event_count(engine, op.id)
    with engine.connect() as holder:
        assert sql.locks.try_lock(holder, operation_lock_key(op.id))
        holder_pid = holder.execute(text("SELECT pg_backend_pid()")).scalar_one()
        holder.commit()  # a session lock outlives the transaction that took it
        try:
            with pytest.raises(OperationBusy, match="right now; try again") as busy:
                committed_resolve(engine, op.id, applied=True, remote_ref="r")
            assert busy.value.operation_id == op.id
            assert busy.value.holder_pid == holder_pid
            assert_untouched(engine, op, events_before)
        finally:
            sql.locks.unlock_all(holder)
            holder.commit()
    assert committed_resolve(engine, op.id, applied=True, remote_ref="r").state is State.CONFIRMED


def test_the_lock_lasts_until_the_callers_transaction_ends(engine: Engine) -> None:
    """A dispatcher cannot take the lock while a resolution is uncommitted, and can once it is."""
    op = waiting(engine)
    key = operation_lock_key(op.id)
    with engine.connect() as dispatcher:
        with Session(engine) as session, session.begin():
            resolve(session, op.id, applied=True, remote_ref="r", by="alice", note=NOTE)
            assert not sql.locks.try_lock(dispatcher, key)
            dispatcher.commit()
        assert sql.locks.try_lock(dispatcher, key)
        sql.locks.unlock_all(dispatcher)
        dispatcher.commit()


def test_resolve_never_commits(engine: Engine) -> None:
    """A resolution rolled back by its caller leaves the row and its events as they were."""
    op = waiting(engine)
    events_before = event_count(engine, op.id)
    with Session(engine) as session:
        session.begin()
        done = resolve(session, op.id, applied=True, remote_ref="r", by="alice", note=NOTE)
        assert done.state is State.CONFIRMED
        session.rollback()
    assert_untouched(engine, op, events_before)


def test_two_operators_racing_end_with_one_verdict(engine: Engine) -> None:
    """Two operators resolving one operation at once: one verdict is written, the other refused."""
    op = waiting(engine)
    barrier = threading.Barrier(2, timeout=10)
    results: dict[str, Operation | Exception] = {}
    verdicts: dict[str, dict[str, Any]] = {
        "alice": {"applied": True, "remote_ref": "rel-a"},
        "bob": {"applied": False},
    }

    def operator(name: str) -> None:
        with Session(engine) as session, session.begin():
            session.execute(text("SELECT 1"))  # connect first, so the barrier releases both
            barrier.wait()
            try:
                results[name] = resolve(
                    session,
                    op.id,
                    by=name,
                    note=f"{name} checked",
                    expect_attempts=op.attempts,
                    **verdicts[name],
                )
            except (OperationBusy, ResolutionRefused) as exc:
                results[name] = exc

    threads = [threading.Thread(target=operator, args=(name,)) for name in verdicts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    winners = [name for name, result in results.items() if isinstance(result, Operation)]
    assert len(winners) == 1, results
    [winner] = winners
    final = reload(engine, op.id)
    assert final.state is (State.CONFIRMED if winner == "alice" else State.FAILED)
    operator_events = [e for e in events_of(engine, op.id) if e.actor == "operator"]
    assert [e.detail["by"] if e.detail else None for e in operator_events] == [winner]


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"applied": True, "by": ""}, "by"),
        ({"applied": True, "by": "   "}, "by"),
        ({"applied": True, "note": ""}, "note"),
        ({"applied": True, "remote_ref": None}, "remote_ref"),
        ({"applied": True, "remote_ref": " "}, "remote_ref"),
        ({"applied": True, "replay": True}, "replay"),
        ({"applied": False, "remote_ref": "r"}, "remote_ref"),
    ],
    ids=["no-by", "blank-by", "no-note", "applied-no-ref", "blank-ref", "applied-replay", "ref"],
)
def test_contradictory_or_unsigned_verdicts_are_refused_naming_the_argument(
    engine: Engine, arguments: dict[str, Any], field: str
) -> None:
    """A verdict with no operator, no note, or arguments that contradict each other is refused."""
    op = waiting(engine)
    events_before = event_count(engine, op.id)
    arguments = {"remote_ref": "rel-1"} | arguments
    with pytest.raises(ResolutionRefused, match=field.replace("_", "[-_]")) as refused:
        committed_resolve(engine, op.id, **arguments)
    assert refused.value.field == field
    assert_untouched(engine, op, events_before)


def test_an_unknown_or_malformed_id_is_not_found(engine: Engine) -> None:
    """An id naming no operation, or no id at all, raises OperationNotFound."""
    with pytest.raises(OperationNotFound, match="no operation"):
        committed_resolve(engine, uuid.uuid4(), applied=True, remote_ref="r")
    with pytest.raises(OperationNotFound, match="not-an-id"):
        committed_resolve(engine, "not-an-id", applied=True, remote_ref="r")  # type: ignore[arg-type]


def test_resolve_is_exported_at_the_top_level(engine: Engine) -> None:
    """`from outbox import resolve` is the public name of the same function."""
    assert outbox.resolve is resolve
    op = waiting(engine)
    with Session(engine) as session, session.begin():
        done = outbox.resolve(session, str(op.id), applied=True, remote_ref="r", by="a", note="n")
    assert done.state is State.CONFIRMED


def test_waiting_reasons_name_the_move_into_the_current_state(engine: Engine) -> None:
    """A waiting operation's reason is that of its move into its state, not of a later note."""
    planned = make_operation(engine, State.PLANNED, tool=TOOL)
    stuck = move(engine, planned, State.NEEDS_HUMAN, Actor.RELAY, reason="tool not registered")
    with Session(engine) as session, session.begin():
        transitions.note(
            session,
            stuck.id,
            state=State.NEEDS_HUMAN,
            attempt=0,
            actor=Actor.EVIDENCE,
            reason="late outcome of attempt 0: inconclusive",
        )
    other = waiting(engine, State.UNKNOWN)
    with engine.connect() as conn:
        reasons = waiting_reasons(conn, [stuck.id, other.id])
    assert reasons == {stuck.id: "tool not registered", other.id: "factory"}
    with engine.connect() as conn:
        assert waiting_reasons(conn, []) == {}
