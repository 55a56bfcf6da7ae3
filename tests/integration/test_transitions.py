"""outbox.transitions on real rows: who commits, the stale answer, and the late-evidence rule."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from uuid import UUID

import pytest
from sqlalchemy import Engine

from outbox import sql, transitions
from outbox.config import get_settings
from outbox.errors import StaleTransition
from outbox.models import Operation, WebhookEvent
from outbox.states import Actor, State
from outbox.transitions import Moved
from tests.factories import event_count, events_of, make_operation, move, reload


def _escalation(op: Operation) -> transitions.Move:
    return transitions.escalate(
        op.id, from_state=State.UNKNOWN, actor=Actor.RECONCILER, attempt=op.attempts, reason="r"
    )


def test_apply_and_commit_commits_the_move(engine: Engine) -> None:
    """The move is visible to another connection when it returns, and no transaction is left."""
    op = make_operation(engine, State.UNKNOWN)
    with engine.connect() as conn:
        moved = transitions.apply_and_commit(conn, _escalation(op))
        assert isinstance(moved, Moved)
        assert (moved.from_state, moved.to_state, moved.actor) == (
            State.UNKNOWN,
            State.NEEDS_HUMAN,
            Actor.RECONCILER,
        )
        assert not conn.in_transaction()
        assert reload(engine, op.id).state is State.NEEDS_HUMAN


def test_apply_and_commit_returns_the_miss_and_writes_nothing(engine: Engine) -> None:
    """A row that moved on: the StaleTransition comes back (not raised), nothing is written."""
    op = make_operation(engine, State.UNKNOWN)
    move(engine, op, State.NEEDS_HUMAN, Actor.RECONCILER)
    events_before = event_count(engine, op.id)
    with engine.connect() as conn:
        missed = transitions.apply_and_commit(conn, _escalation(op))
        assert isinstance(missed, StaleTransition)
        assert missed.actual == (State.NEEDS_HUMAN, op.attempts)
        assert not conn.in_transaction()
    assert event_count(engine, op.id) == events_before


@pytest.fixture
def webhooks_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A webhook URL configured (nothing listens: only the delivery rows matter here)."""
    monkeypatch.setenv("OUTBOX_WEBHOOK_URL", "http://127.0.0.1:9/hook")
    monkeypatch.setenv("OUTBOX_WEBHOOK_SECRET", "whsec_" + base64.b64encode(bytes(32)).decode())
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.mark.usefixtures("webhooks_on")
def test_on_an_autocommit_connection_a_move_and_its_webhook_commit_together(
    engine: Engine,
) -> None:
    """The move with deliveries runs in one real transaction, then AUTOCOMMIT is back."""
    op = make_operation(engine, State.UNKNOWN)
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        assert isinstance(transitions.apply_and_commit(conn, _escalation(op)), Moved)
        assert conn.get_execution_options()["isolation_level"] == "AUTOCOMMIT"
    with engine.connect() as conn:
        deliveries = sql.webhooks.list_deliveries(conn)
    assert [(d.operation_id, d.event) for d in deliveries] == [(op.id, WebhookEvent.NEEDS_HUMAN)]
    assert reload(engine, op.id).state is State.NEEDS_HUMAN


# --- late evidence ---------------------------------------------------------------------------


@pytest.mark.parametrize("waiting", [State.UNKNOWN, State.NEEDS_HUMAN])
def test_late_evidence_confirms_a_row_still_waiting_at_that_attempt(
    engine: Engine, waiting: State
) -> None:
    """Kept as an event by its bringer, then confirmed by `evidence` with the remote's ref."""
    op = make_operation(engine, waiting)
    with engine.connect() as conn:
        kept = transitions.keep_late_evidence_and_commit(
            conn,
            op.id,
            attempt=op.attempts,
            noted_by=Actor.DISPATCHER,
            note_reason="late outcome of attempt 1: applied",
            remote_ref="rel-late",
            result={"id": "rel-late"},
            confirm_reason="late outcome of attempt 1: applied",
        )
    assert kept.confirmed
    assert kept.current is not None
    assert kept.current.state is waiting
    done = reload(engine, op.id)
    assert (done.state, done.remote_ref, done.result) == (
        State.CONFIRMED,
        "rel-late",
        {"id": "rel-late"},
    )
    note, confirmed = events_of(engine, op.id)[-2:]
    assert (note.from_state, note.to_state, note.actor) == (waiting, waiting, "dispatcher")
    assert (confirmed.to_state, confirmed.actor) == (State.CONFIRMED, "evidence")


@pytest.mark.parametrize(
    ("state", "remote_ref"),
    [
        (State.FAILED, "rel-late"),  # decided: a verdict is not overturned by late evidence
        (State.CANCELLED, "rel-late"),
        (State.UNKNOWN, None),  # evidence that it did not apply confirms nothing
    ],
)
def test_late_evidence_is_only_kept_otherwise(
    engine: Engine, state: State, remote_ref: str | None
) -> None:
    """The row stays as it is; the evidence is one event more."""
    op = make_operation(engine, state)
    events_before = event_count(engine, op.id)
    with engine.connect() as conn:
        kept = transitions.keep_late_evidence_and_commit(
            conn,
            op.id,
            attempt=op.attempts,
            noted_by=Actor.RECONCILER,
            note_reason="lookup evidence after the operation moved on",
            remote_ref=remote_ref,
            confirm_reason="lookup: applied",
        )
    assert not kept.confirmed
    assert reload(engine, op.id) == op
    assert event_count(engine, op.id) == events_before + 1
    assert events_of(engine, op.id)[-1].reason == "lookup evidence after the operation moved on"


def test_late_evidence_about_an_older_attempt_never_confirms(engine: Engine) -> None:
    """Attempt 1's evidence on a row waiting at attempt 2: kept, not confirmed."""
    op = make_operation(engine, State.UNKNOWN)
    replay = move(engine, op, State.PLANNED, Actor.RECONCILER)
    sent = move(engine, replay, State.SENT, Actor.DISPATCHER)
    second = move(engine, sent, State.UNKNOWN, Actor.SWEEP)
    assert second.attempts == 2
    with engine.connect() as conn:
        kept = transitions.keep_late_evidence_and_commit(
            conn,
            op.id,
            attempt=1,
            noted_by=Actor.DISPATCHER,
            note_reason="late outcome of attempt 1",
            remote_ref="rel-1",
            confirm_reason="late: applied",
        )
    assert not kept.confirmed
    assert reload(engine, op.id).state is State.UNKNOWN
    assert events_of(engine, op.id)[-1].attempt == 1


def test_late_evidence_for_an_operation_that_is_gone(engine: Engine) -> None:
    """Nothing to keep it on: current is None, nothing written."""
    with engine.connect() as conn:
        kept = transitions.keep_late_evidence_and_commit(
            conn,
            UUID("00000000-0000-7000-8000-000000000000"),
            attempt=1,
            noted_by=Actor.DISPATCHER,
            note_reason="late",
            remote_ref="rel-1",
            confirm_reason="late: applied",
        )
    assert (kept.current, kept.confirmed) == (None, False)
    assert event_count(engine) == 0
