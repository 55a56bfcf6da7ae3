"""Retention never forgets an intent (migration 0011): a pruned operation's key cannot be
enqueued into a second operation, and prune keeps what is inside its tool's dedup window."""

from __future__ import annotations

from uuid import UUID

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api, sql
from outbox.api import Intent
from outbox.cli.db import prune_batches
from outbox.errors import IntentAlreadyDone, IntentConflict
from outbox.models import IntentKey
from outbox.sql.retention import DedupWindows
from outbox.states import State
from tests.factories import age, make_operation

DAY = 86400
MONTH = 30 * DAY
TOOL = "deploy.create_release"
NO_WINDOW = DedupWindows({TOOL: None})
PAYLOAD = {"version": "1.2.3"}


def _prune(engine: Engine, windows: DedupWindows = NO_WINDOW) -> int:
    return sum(prune_batches(engine, older_than_s=MONTH, batch_size=100, windows=windows))


def _pruned(engine: Engine, state: State = State.CONFIRMED, key: str = "conv-1/step-3") -> UUID:
    """An operation under ``key`` that ended 40 days ago, pruned."""
    op = make_operation(engine, state, intent_key=key, payload=PAYLOAD)
    age(engine, op.id, 40 * DAY, "resolved_at", "updated_at", "created_at")
    assert _prune(engine) == 1
    return op.id


def _operation_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM outbox.operations")).scalar_one())


def test_a_pruned_intent_enqueued_again_is_already_done(engine: Engine) -> None:
    """Prune, then the same key, tool, target and payload: no new operation, the old identity
    (id, final state, remote_ref) back in IntentAlreadyDone."""
    op_id = _pruned(engine)
    with (
        pytest.raises(IntentAlreadyDone) as caught,
        Session(engine) as session,
        session.begin(),
    ):
        api.enqueue(
            session, tool=TOOL, target="project-a", payload=PAYLOAD, intent_key="conv-1/step-3"
        )
    done = caught.value
    assert (done.operation_id, done.state, done.remote_ref) == (op_id, State.CONFIRMED, "rel-1")
    assert str(op_id) in str(done)
    assert "already done" in str(done)
    assert _operation_count(engine) == 0


@pytest.mark.parametrize(
    ("changes", "differences"),
    [
        ({"payload": {"version": "9.9.9"}}, ("payload",)),
        ({"target": "project-b"}, ("target",)),
        ({"tool": "deploy.delete_release"}, ("tool",)),
    ],
)
def test_a_pruned_key_with_another_intent_is_a_conflict(
    engine: Engine, changes: dict[str, object], differences: tuple[str, ...]
) -> None:
    """The same key with a different tool, target or payload is IntentConflict, pruned or not."""
    op_id = _pruned(engine)
    intent = {"tool": TOOL, "target": "project-a", "payload": PAYLOAD} | changes
    with pytest.raises(IntentConflict) as caught, Session(engine) as session, session.begin():
        api.enqueue(session, intent_key="conv-1/step-3", **intent)  # type: ignore[arg-type]
    assert (caught.value.operation_id, caught.value.differences) == (op_id, differences)
    assert _operation_count(engine) == 0


def test_enqueue_many_refuses_a_pruned_intent_and_writes_nothing(engine: Engine) -> None:
    """A batch holding a pruned intent raises IntentAlreadyDone and inserts none of the batch."""
    op_id = _pruned(engine, State.FAILED)
    batch = [
        Intent(TOOL, "project-a", {"n": 1}, intent_key="fresh"),
        Intent(TOOL, "project-a", PAYLOAD, intent_key="conv-1/step-3"),
    ]
    with (
        pytest.raises(IntentAlreadyDone) as caught,
        Session(engine) as session,
        session.begin(),
    ):
        api.enqueue_many(session, batch)
    assert (caught.value.operation_id, caught.value.state) == (op_id, State.FAILED)
    assert _operation_count(engine) == 0


def test_the_pruned_intent_keeps_what_identifies_it(engine: Engine) -> None:
    """The trigger writes the key, id, tool, target, payload hash, outcome and times."""
    op = make_operation(engine, State.CONFIRMED, intent_key="k-1", payload=PAYLOAD)
    age(engine, op.id, 40 * DAY, "resolved_at")
    assert _prune(engine) == 1
    with engine.connect() as conn:
        [kept] = sql.intents.find_pruned_intents(conn, [IntentKey("", "k-1")])
    assert (kept.operation_id, kept.tool, kept.target, kept.payload_hash) == (
        op.id,
        TOOL,
        "project-a",
        op.payload_hash,
    )
    assert (kept.state, kept.remote_ref, kept.attempts) == (State.CONFIRMED, "rel-1", 1)
    assert kept.first_sent_at is not None


def test_an_operation_inside_its_dedup_window_is_not_pruned(engine: Engine) -> None:
    """A finished operation whose first send + the tool's dedup window is still ahead (by the
    database clock) stays; once the window has passed it is pruned."""
    windows = DedupWindows({TOOL: 60 * DAY})
    op = make_operation(engine, State.CONFIRMED)
    age(engine, op.id, 40 * DAY, "resolved_at", "updated_at", "created_at")
    age(engine, op.id, 40 * DAY, "first_sent_at", "sent_at")
    with engine.connect() as conn:
        count = sql.retention.count_prunable(conn, older_than_s=MONTH, windows=windows)
    assert (count.prunable, count.in_window) == (0, 1)
    assert _prune(engine, windows) == 0
    age(engine, op.id, 21 * DAY, "first_sent_at", "sent_at", "resolved_at", "created_at")
    assert _prune(engine, windows) == 1


def test_an_operation_of_an_unregistered_tool_is_kept(engine: Engine) -> None:
    """Without the tool's contract its dedup window is unknown: the operation stays, counted."""
    op = make_operation(engine, State.CANCELLED, tool="legacy.tool")
    age(engine, op.id, 40 * DAY, "resolved_at")
    with engine.connect() as conn:
        count = sql.retention.count_prunable(conn, older_than_s=MONTH, windows=NO_WINDOW)
    assert (count.prunable, count.unknown_tool) == (0, 1)
    assert _prune(engine) == 0
    assert _prune(engine, DedupWindows({TOOL: None, "legacy.tool": None})) == 1


def test_forgotten_intents_can_be_enqueued_anew(engine: Engine) -> None:
    """forget_pruned_intents removes old pruned intents only; their keys are free again."""
    _pruned(engine)
    with engine.begin() as conn:
        assert sql.retention.forget_pruned_intents(conn, older_than_s=50 * DAY, limit=10) == 0
        assert sql.retention.forget_pruned_intents(conn, older_than_s=MONTH, limit=10) == 1
    with Session(engine) as session, session.begin():
        again = api.enqueue(
            session, tool=TOOL, target="project-a", payload=PAYLOAD, intent_key="conv-1/step-3"
        )
    assert again.state is State.PLANNED
