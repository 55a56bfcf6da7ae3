"""The agent-facing API on a real database: enqueue, get, find, cancel and wait."""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session

from outbox import api, sql
from outbox.config import get_settings
from outbox.errors import (
    IntentConflict,
    InvalidIntent,
    NotCancellable,
    OperationNotFound,
    WaitTimeout,
)
from outbox.models import Operation
from outbox.states import Actor, State
from tests.factories import (
    event_count,
    events_of,
    make_operation,
    move,
    operation_count,
    reload,
)

TOOL = "deploy.create_release"
TARGET = "project-a"
PAYLOAD: dict[str, Any] = {"version": "1.2.3", "notes": ["fix"], "draft": False}


def enqueue_committed(engine: Engine, **overrides: Any) -> Operation:
    """Enqueue one intent in its own committed transaction."""
    arguments: dict[str, Any] = {"tool": TOOL, "target": TARGET, "payload": PAYLOAD} | overrides
    with Session(engine) as session, session.begin():
        return api.enqueue(session, **arguments)


@pytest.fixture
def fresh_settings() -> Iterator[None]:
    """Settings re-read from the environment for this test, and again afterwards."""
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_enqueue_records_a_planned_operation(engine: Engine) -> None:
    """enqueue writes a planned operation with its payload, hash and a first event by the agent."""
    op = enqueue_committed(engine, intent_key="release-1.2.3", metadata={"run": 7})
    assert op.state is State.PLANNED
    assert (op.tool, op.target, op.intent_key) == (TOOL, TARGET, "release-1.2.3")
    assert op.payload == PAYLOAD
    assert len(op.payload_hash) == 64
    assert op.metadata == {"run": 7}
    assert (op.attempts, op.maybe_applied, op.published_at, op.resolved_at) == (
        0,
        False,
        None,
        None,
    )
    assert reload(engine, op.id) == op
    [event] = events_of(engine, op.id)
    assert (event.from_state, event.to_state, event.actor, event.reason) == (
        None,
        State.PLANNED,
        "agent",
        "enqueued",
    )


def test_enqueue_in_a_rolled_back_transaction_leaves_nothing(engine: Engine) -> None:
    """An intent enqueued in a transaction that rolls back leaves no row and no event."""
    with Session(engine) as session:
        op = api.enqueue(session, tool=TOOL, target=TARGET, payload=PAYLOAD, intent_key="k")
        assert api.get(session, op.id) is not None
        session.rollback()
    assert operation_count(engine) == 0
    assert event_count(engine) == 0


def test_enqueue_never_commits(engine: Engine) -> None:
    """The new row is invisible to other connections until the caller commits."""
    with Session(engine) as session:
        op = api.enqueue(session, tool=TOOL, target=TARGET, payload=PAYLOAD)
        with engine.connect() as other:
            assert api.get(other, op.id) is None
        assert operation_count(engine) == 0
        session.commit()
    assert reload(engine, op.id) == op


def test_enqueue_joins_a_connection_transaction(engine: Engine) -> None:
    """enqueue also works on a Core Connection, inside the caller's transaction."""
    with engine.begin() as conn:
        op = api.enqueue(conn, tool=TOOL, target=TARGET, payload=PAYLOAD)
        conn.execute(text("SELECT 1"))
    assert reload(engine, op.id) == op


def test_same_key_and_intent_returns_the_same_operation(engine: Engine) -> None:
    """Enqueueing the same key, tool, target and payload again returns the existing operation."""
    first = enqueue_committed(engine, intent_key="release-1.2.3")
    again = enqueue_committed(
        engine, intent_key="release-1.2.3", payload=dict(reversed(PAYLOAD.items()))
    )
    assert again == first
    assert operation_count(engine) == 1
    assert event_count(engine) == 1


@pytest.mark.parametrize("state", list(State))
def test_same_intent_returns_the_operation_in_any_state(engine: Engine, state: State) -> None:
    """A retried enqueue returns the existing operation whatever state it has reached since."""
    op = make_operation(engine, state, tool=TOOL, target=TARGET, payload=PAYLOAD, intent_key="k")
    events_before = event_count(engine)
    again = enqueue_committed(engine, intent_key="k")
    assert (again.id, again.state) == (op.id, state)
    assert event_count(engine) == events_before


def test_payload_read_back_is_the_same_intent(engine: Engine) -> None:
    """The payload as stored (JSONB) and read back re-enqueues as the same intent."""
    payload = {"f": 0.1, "tiny": 1e-7, "big": 2**53 - 1, "s": "é😀", "n": None, "l": [{"b": 1}]}
    op = enqueue_committed(engine, intent_key="k", payload=payload)
    stored = reload(engine, op.id).payload
    assert enqueue_committed(engine, intent_key="k", payload=stored).id == op.id


def test_integer_and_equal_float_are_the_same_intent(engine: Engine) -> None:
    """A payload with 1.0 where the first had 1 is the same intent (RFC 8785 numbers)."""
    op = enqueue_committed(engine, intent_key="k", payload={"amount": 1})
    assert enqueue_committed(engine, intent_key="k", payload={"amount": 1.0}).id == op.id


@pytest.mark.parametrize(
    ("overrides", "differences"),
    [
        ({"payload": {"version": "9.9.9"}}, ("payload",)),
        ({"tool": "deploy.delete_release"}, ("tool",)),
        ({"target": "project-b"}, ("target",)),
        ({"tool": "mail.send", "target": "x@example.com"}, ("tool", "target")),
        ({"tool": "mail.send", "target": "b", "payload": {}}, ("tool", "target", "payload")),
    ],
    ids=["payload", "tool", "target", "tool+target", "all"],
)
def test_same_key_with_another_intent_conflicts(
    engine: Engine, overrides: dict[str, Any], differences: tuple[str, ...]
) -> None:
    """Reusing a key with another tool, target or payload raises IntentConflict naming them."""
    first = enqueue_committed(engine, intent_key="release-1.2.3")
    with Session(engine) as session:
        with pytest.raises(IntentConflict) as caught:
            api.enqueue(
                session,
                **({"tool": TOOL, "target": TARGET, "payload": PAYLOAD} | overrides),
                intent_key="release-1.2.3",
            )
        assert caught.value.differences == differences
        assert caught.value.intent_key == "release-1.2.3"
        assert caught.value.operation_id == first.id
        for name in differences:
            assert name in str(caught.value)
        # The caller's transaction is still usable: it can record another intent and commit.
        other = api.enqueue(session, tool=TOOL, target=TARGET, payload=PAYLOAD, intent_key="k2")
        session.commit()
    assert operation_count(engine) == 2
    assert event_count(engine) == 2
    assert reload(engine, first.id) == first
    assert reload(engine, other.id).intent_key == "k2"


def test_no_key_uses_the_operation_id(engine: Engine) -> None:
    """Without an intent key the operation's id is its key, so two calls make two operations."""
    one = enqueue_committed(engine)
    two = enqueue_committed(engine)
    assert one.intent_key == str(one.id)
    assert two.intent_key == str(two.id)
    assert one.id != two.id
    assert operation_count(engine) == 2


def test_ids_are_uuid_v7_in_creation_order(engine: Engine) -> None:
    """Operation ids are version-7 UUIDs that sort in creation order."""
    ops = [enqueue_committed(engine) for _ in range(3)]
    assert all(op.id.version == 7 for op in ops)
    assert [op.id for op in ops] == sorted(op.id for op in ops)


def test_concurrent_enqueues_of_one_key_make_one_operation(engine: Engine) -> None:
    """Eight agents enqueueing one key at once end with one row, all holding its id."""
    barrier = threading.Barrier(8)
    ids: list[uuid.UUID] = []
    errors: list[BaseException] = []

    def agent() -> None:
        try:
            with Session(engine) as session, session.begin():
                barrier.wait(timeout=10)
                ids.append(
                    api.enqueue(
                        session, tool=TOOL, target=TARGET, payload=PAYLOAD, intent_key="k"
                    ).id
                )
        except BaseException as exc:  # noqa: BLE001 -- reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=agent) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert errors == []
    assert len(ids) == 8
    assert len(set(ids)) == 1
    assert operation_count(engine) == 1
    assert event_count(engine) == 1


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"tool": ""}, "tool"),
        ({"tool": "1deploy"}, "tool"),
        ({"tool": "deploy..create"}, "tool"),
        ({"tool": "deploy."}, "tool"),
        ({"tool": ".deploy"}, "tool"),
        ({"tool": "deploy release"}, "tool"),
        ({"tool": "deploy/release"}, "tool"),
        ({"tool": "a" * 129}, "tool"),
        ({"tool": None}, "tool"),
        ({"target": ""}, "target"),
        ({"target": "   "}, "target"),
        ({"target": None}, "target"),
        ({"target": "t" * 1025}, "target"),
        ({"payload": [1, 2]}, "payload"),
        ({"payload": "text"}, "payload"),
        ({"payload": None}, "payload"),
        ({"payload": 3}, "payload"),
        ({"payload": {"when": datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)}}, "payload"),
        ({"payload": {"n": float("nan")}}, "payload"),
        ({"payload": {"n": 2**53}}, "payload"),
        ({"payload": {1: "x"}}, "payload"),
        ({"intent_key": "k" * 256}, "intent_key"),
        ({"intent_key": ""}, "intent_key"),
        ({"intent_key": "  "}, "intent_key"),
        ({"intent_key": 42}, "intent_key"),
        ({"metadata": {"at": datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)}}, "metadata"),
        ({"metadata": {"tags": {"a", "b"}}}, "metadata"),
        ({"metadata": ["not", "an", "object"]}, "metadata"),
    ],
)
def test_invalid_intent_names_the_field_and_writes_nothing(
    session: Session, engine: Engine, arguments: dict[str, Any], field: str
) -> None:
    """Malformed input raises InvalidIntent naming the field, and nothing is written."""
    with pytest.raises(InvalidIntent) as caught:
        api.enqueue(session, **({"tool": TOOL, "target": TARGET, "payload": PAYLOAD} | arguments))
    assert caught.value.field == field
    session.commit()
    assert operation_count(engine) == 0
    assert event_count(engine) == 0


def test_longest_valid_names_are_accepted(engine: Engine) -> None:
    """A 128-character tool, 1024-character target and 255-character key are accepted."""
    op = enqueue_committed(
        engine, tool="t" * 128, target="x" * 1024, intent_key="k" * 255, payload={}
    )
    assert (len(op.tool), len(op.target), len(op.intent_key)) == (128, 1024, 255)


@pytest.mark.usefixtures("fresh_settings")
def test_payload_size_limit(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> None:
    """A canonical payload at OUTBOX_MAX_PAYLOAD_BYTES is accepted; one byte more is refused."""
    monkeypatch.setenv("OUTBOX_MAX_PAYLOAD_BYTES", "100")
    get_settings.cache_clear()
    envelope = len(b'{"a":""}')
    at_limit = enqueue_committed(engine, payload={"a": "x" * (100 - envelope)})
    assert at_limit.state is State.PLANNED

    with pytest.raises(InvalidIntent, match="OUTBOX_MAX_PAYLOAD_BYTES") as caught:
        enqueue_committed(engine, payload={"a": "x" * (101 - envelope)})
    assert caught.value.field == "payload"
    assert operation_count(engine) == 1


def test_get_and_find(engine: Engine) -> None:
    """get reads by id (UUID or string) and find by intent key; missing ones give None."""
    op = enqueue_committed(engine, intent_key="release-1.2.3")
    with engine.connect() as conn:
        assert api.get(conn, op.id) == op
        assert api.get(conn, str(op.id)) == op
        assert api.find(conn, "release-1.2.3") == op
        assert api.get(conn, uuid.uuid4()) is None
        assert api.find(conn, "no-such-key") is None


def test_get_with_a_garbage_id_raises_not_found(session: Session) -> None:
    """A string that is not a UUID raises OperationNotFound, never a driver error."""
    with pytest.raises(OperationNotFound, match="not an operation id"):
        api.get(session, "not-a-uuid")


def test_cancel_a_planned_operation(engine: Engine) -> None:
    """cancel moves a planned operation to cancelled with an event by the agent."""
    op = enqueue_committed(engine)
    with Session(engine) as session, session.begin():
        cancelled = api.cancel(session, str(op.id), reason="user changed their mind")
    assert cancelled.state is State.CANCELLED
    assert cancelled.resolved_at is not None
    last = events_of(engine, op.id)[-1]
    assert (last.from_state, last.to_state, last.actor, last.reason) == (
        State.PLANNED,
        State.CANCELLED,
        Actor.AGENT.value,
        "user changed their mind",
    )


def test_cancel_does_not_commit(engine: Engine) -> None:
    """cancel joins the caller's transaction: rolling back keeps the operation planned."""
    op = enqueue_committed(engine)
    with Session(engine) as session:
        api.cancel(session, op.id)
        session.rollback()
    assert reload(engine, op.id) == op


@pytest.mark.parametrize(
    "state",
    [State.SENT, State.UNKNOWN, State.NEEDS_HUMAN, State.CONFIRMED, State.FAILED, State.CANCELLED],
)
def test_cancel_past_planned_is_refused(engine: Engine, state: State) -> None:
    """cancel of an operation that is no longer planned raises NotCancellable and writes nothing."""
    op = make_operation(engine, state)
    events_before = event_count(engine, op.id)
    with Session(engine) as session, session.begin(), pytest.raises(NotCancellable):
        api.cancel(session, op.id)
    assert reload(engine, op.id) == op
    assert event_count(engine, op.id) == events_before


@pytest.mark.parametrize("operation_id", [uuid.uuid4(), "garbage", ""])
def test_cancel_of_a_missing_operation_raises_not_found(
    session: Session, operation_id: uuid.UUID | str
) -> None:
    """cancel of an unknown id or a string that is not an id raises OperationNotFound."""
    with pytest.raises(OperationNotFound):
        api.cancel(session, operation_id)


def test_wait_returns_a_settled_operation_at_once(engine: Engine) -> None:
    """wait returns immediately for an operation that is already settled."""
    op = make_operation(engine, State.CONFIRMED)
    started = time.monotonic()
    assert api.wait(op.id, timeout=5, engine=engine) == op
    assert time.monotonic() - started < 1


def test_wait_treats_needs_human_as_settled(engine: Engine) -> None:
    """wait returns an operation waiting for a person: no component will move it on its own."""
    op = make_operation(engine, State.NEEDS_HUMAN)
    assert api.wait(str(op.id), timeout=5, engine=engine).state is State.NEEDS_HUMAN


def test_wait_wakes_when_another_thread_settles_the_operation(engine: Engine) -> None:
    """wait wakes on the NOTIFY of a settling move, well before its next poll."""
    op = make_operation(engine, State.SENT)

    def confirm_later() -> None:
        time.sleep(0.3)
        move(engine, op, State.CONFIRMED, Actor.DISPATCHER, remote_ref="rel-7")

    settler = threading.Thread(target=confirm_later)
    started = time.monotonic()
    settler.start()
    try:
        settled = api.wait(op.id, timeout=10, engine=engine, poll_interval=5)
    finally:
        settler.join(timeout=10)
    elapsed = time.monotonic() - started
    assert (settled.state, settled.remote_ref) == (State.CONFIRMED, "rel-7")
    assert 0.3 <= elapsed < 3


def test_wait_times_out_with_the_last_seen_operation(engine: Engine) -> None:
    """wait raises WaitTimeout carrying the operation when it does not settle in time."""
    op = make_operation(engine, State.UNKNOWN)
    started = time.monotonic()
    with pytest.raises(WaitTimeout) as caught:
        api.wait(op.id, timeout=0.5, engine=engine, poll_interval=0.2)
    assert 0.5 <= time.monotonic() - started < 3
    assert caught.value.operation == op


def test_wait_gives_its_connection_back_without_a_stale_notification(
    engine: Engine, database_url: str
) -> None:
    """A NOTIFY that reaches wait's connection before its UNLISTEN (kept by psycopg for the
    connection's next notifies()) is drained: the pooled connection's next user hears none."""
    one = create_engine(database_url, pool_size=1, max_overflow=0)
    try:
        op = make_operation(one, State.CONFIRMED)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as other:

            @event.listens_for(one, "before_cursor_execute")
            def ring(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
                # Rung just before wait reads the row: the bell arrives with that answer.
                if statement.lstrip().upper().startswith("SELECT") and "operations" in statement:
                    other.execute(text(f"NOTIFY {sql.notify.SETTLED_CHANNEL}, 'stale'"))

            api.wait(op.id, timeout=5, engine=one)
            event.remove(one, "before_cursor_execute", ring)
        with one.connect() as conn:
            driver = conn.connection.driver_connection
            assert [n.payload for n in driver.notifies(timeout=0)] == []  # type: ignore[union-attr]
    finally:
        one.dispose()


def _notifications(engine: Engine, act: Callable[[], object]) -> list[str]:
    """Payloads on the settled channel while ``act()`` runs (and 0.3 s after)."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"LISTEN {sql.notify.SETTLED_CHANNEL}"))
        act()
        listener = conn.connection.driver_connection
        payloads = [n.payload for n in listener.notifies(timeout=0.3)]  # type: ignore[union-attr]
        # Back to the pool listening on nothing and holding nothing: a later test's
        # listener drawing this connection would hear settled moves it never asked for.
        conn.execute(text("UNLISTEN *"))
        for _ in listener.notifies(timeout=0):  # type: ignore[union-attr]
            pass
        return payloads


def test_a_settled_move_notifies_only_while_someone_waits(engine: Engine) -> None:
    """No waiter, no NOTIFY (it would serialise commits); a registered waiter gets its own."""
    unwatched = make_operation(engine, State.SENT)
    watched = make_operation(engine, State.SENT)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as waiter:
        sql.intents.register_waiter(waiter, watched.id)
        payloads = _notifications(
            engine,
            lambda: [
                move(engine, op, State.CONFIRMED, Actor.DISPATCHER, remote_ref="r")
                for op in (unwatched, watched)
            ],
        )
        assert payloads == [str(watched.id)]
        sql.intents.forget_waiter(waiter, watched.id)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.waiters")).scalar_one() == 0


def test_wait_leaves_no_registration_and_clears_a_dead_sessions_row(engine: Engine) -> None:
    """wait registers while it waits and removes its row; rows of ended sessions are dropped."""
    op = make_operation(engine, State.UNKNOWN)
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO outbox.waiters (operation_id, backend_pid) VALUES (:id, -1)"),
            {"id": op.id},
        )

    def settle_later() -> None:
        time.sleep(0.3)
        move(engine, op, State.CONFIRMED, Actor.RECONCILER, remote_ref="rel-8")

    settler = threading.Thread(target=settle_later)
    settler.start()
    try:
        assert api.wait(op.id, timeout=10, engine=engine, poll_interval=5).remote_ref == "rel-8"
    finally:
        settler.join(timeout=10)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.waiters")).scalar_one() == 0


@pytest.mark.parametrize("operation_id", [uuid.uuid4(), "garbage"])
def test_wait_for_a_missing_operation_raises_not_found(
    engine: Engine, operation_id: uuid.UUID | str
) -> None:
    """wait for an unknown id or a garbage string raises OperationNotFound at once."""
    with pytest.raises(OperationNotFound):
        api.wait(operation_id, timeout=5, engine=engine)


# --- enqueue_many ---------------------------------------------------------------------------


def test_enqueue_many_records_every_intent_in_input_order(engine: Engine) -> None:
    """One call, the caller's transaction: planned operations in input order, each with its
    first event, exactly as enqueue would have written them."""
    intents = [
        api.Intent(TOOL, TARGET, {"version": f"1.0.{i}"}, intent_key=f"batch-{i}") for i in range(5)
    ]
    intents.insert(2, api.Intent(TOOL, "project-b", PAYLOAD, metadata={"run": 3}))
    with Session(engine) as session, session.begin():
        ops = api.enqueue_many(session, intents)
    assert [op.target for op in ops] == [i.target for i in intents]
    assert [op.intent_key for op in ops if op.target == TARGET] == [f"batch-{i}" for i in range(5)]
    unnamed = ops[2]
    assert unnamed.intent_key == str(unnamed.id)
    assert unnamed.metadata == {"run": 3}
    for op in ops:
        assert op.state is State.PLANNED
        assert reload(engine, op.id) == op
        [event] = events_of(engine, op.id)
        assert (event.to_state, event.actor, event.reason) == (State.PLANNED, "agent", "enqueued")
    single = enqueue_committed(engine, intent_key="single", payload={"version": "1.0.0"})
    assert single.payload_hash == ops[0].payload_hash


def test_enqueue_many_returns_existing_operations_for_known_keys(engine: Engine) -> None:
    """A key already recorded (or repeated in the batch) with the same intent gives back its
    operation: no second row."""
    first = enqueue_committed(engine, intent_key="known")
    with Session(engine) as session, session.begin():
        ops = api.enqueue_many(
            session,
            [
                api.Intent(TOOL, TARGET, PAYLOAD, intent_key="known"),
                api.Intent(TOOL, TARGET, {"v": 1}, intent_key="new"),
                api.Intent(TOOL, TARGET, {"v": 1}, intent_key="new"),
            ],
        )
    assert ops[0] == first
    assert ops[1] == ops[2]
    assert operation_count(engine) == 2


def test_enqueue_many_conflict_writes_nothing(engine: Engine) -> None:
    """A known key with another payload raises IntentConflict naming it; the rest of the
    batch is rolled back to the savepoint and the caller's transaction goes on."""
    enqueue_committed(engine, intent_key="taken")
    with Session(engine) as session, session.begin():
        mine = api.enqueue(session, tool=TOOL, target=TARGET, payload=PAYLOAD, intent_key="mine")
        with pytest.raises(IntentConflict, match="'taken'") as raised:
            api.enqueue_many(
                session,
                [
                    api.Intent(TOOL, TARGET, {"v": 1}, intent_key="fresh"),
                    api.Intent(TOOL, TARGET, {"v": 2}, intent_key="taken"),
                ],
            )
        assert raised.value.differences == ("payload",)
    assert reload(engine, mine.id).state is State.PLANNED
    with Session(engine) as session:
        assert api.find(session, "fresh") is None
    assert operation_count(engine) == 2


def test_enqueue_many_refuses_one_key_for_two_intents_in_a_batch(engine: Engine) -> None:
    """The same key twice with different targets is refused before anything is written."""
    with Session(engine) as session, session.begin(), pytest.raises(IntentConflict, match="twice"):
        api.enqueue_many(
            session,
            [
                api.Intent(TOOL, "a", PAYLOAD, intent_key="k"),
                api.Intent(TOOL, "b", PAYLOAD, intent_key="k"),
            ],
        )
    assert operation_count(engine) == 0


def test_enqueue_many_names_the_bad_intent(engine: Engine) -> None:
    """A malformed intent is named by its position and field; nothing is written."""
    with Session(engine) as session, session.begin(), pytest.raises(InvalidIntent) as raised:
        api.enqueue_many(
            session,
            [api.Intent(TOOL, TARGET, PAYLOAD), api.Intent(TOOL, TARGET, ["not", "an", "object"])],
        )
    assert raised.value.field == "payload"
    assert str(raised.value).startswith("intent #1: ")
    with Session(engine) as session, session.begin(), pytest.raises(InvalidIntent, match="#0"):
        api.enqueue_many(session, [{"tool": TOOL}])  # type: ignore[list-item]
    assert operation_count(engine) == 0
    with Session(engine) as session, session.begin():
        assert api.enqueue_many(session, []) == []
