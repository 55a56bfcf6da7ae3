"""A worker's take claims, locks and reads an operation in one statement and hands that
connection to its own task (issue 35, ``outbox.workers.handoff``). Real PostgreSQL: the
locks are read back from ``pg_locks`` through another connection."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any
from uuid import UUID

import pytest
from celery import Celery
from sqlalchemy import Connection, Engine, text
from sqlalchemy.orm import Session

from outbox import api, sql, transitions
from outbox.contracts import ContractTable
from outbox.driver import DriverStatement
from outbox.locks import SESSION_LOCKS_INFO, operation_lock_key
from outbox.sql.relay import _CLAIM_AND_MARK_DUE, DueTake
from outbox.states import Actor, State
from outbox.tools import Applied, ToolCall, ToolRegistry, tool
from outbox.transitions import SendTerms
from outbox.workers import dbbroker, handoff
from outbox.workers.direct import DirectDispatch, dispatch_queue
from outbox.workers.dispatch import Outcome, dispatch
from outbox.workers.handoff import Handoffs
from outbox.workers.locking import DispatchLocks, Handed, SentAtLock
from tests.integration.test_direct_take import _app

REPUBLISH_AFTER_S = 30.0


def _enqueue(engine: Engine, count: int) -> list[UUID]:
    with Session(engine) as session, session.begin():
        return [
            api.enqueue(session, tool="deploy.create", target=f"t{i}", payload={"i": i}).id
            for i in range(count)
        ]


@pytest.fixture
def taker(engine: Engine) -> Iterator[Connection]:
    """An autocommit connection of the engine's pool, as a worker's take uses one."""
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        yield conn


def _take(conn: Connection) -> DueTake:
    return sql.relay.take_due(
        conn, limit=1, republish_after_s=REPUBLISH_AFTER_S, flush=False, lock=True
    )


def _holder(engine: Engine, operation_id: UUID) -> int | None:
    """The backend holding ``operation_id``'s lock, read from another connection."""
    with engine.connect() as conn:
        return sql.locks.lock_holder_pid(conn, operation_lock_key(operation_id))


def _pid(conn: Connection) -> int:
    return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def _advisory_locks(conn: Connection) -> int:
    return int(
        conn.execute(
            text(
                "SELECT count(*) FROM pg_locks "
                "WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
            )
        ).scalar_one()
    )


def test_enqueue_stores_each_operation_s_lock_key(engine: Engine) -> None:
    """The key in the row is the one every holder of the lock computes from the id."""
    ids = _enqueue(engine, 2)
    with Session(engine) as session, session.begin():
        ids.append(
            api.enqueue_many(
                session,
                [api.Intent(tool="deploy.create", target="many", payload={"n": 1})],
            )[0].id
        )
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, lock_key FROM outbox.operations")).all()
    assert {row.id: row.lock_key for row in rows} == {one: operation_lock_key(one) for one in ids}


def test_a_take_claims_locks_and_reads_one_operation_in_one_statement(
    engine: Engine, taker: Connection
) -> None:
    first, second = _enqueue(engine, 2)
    taken = _take(taker)
    assert [c.id for c in taken.claimed] == [first]
    assert taken.more  # the second was due too: looked at, not claimed
    assert taken.locked
    assert taken.found is not None
    assert taken.found.operation.id == first
    assert taken.found.operation.state.value == "planned"
    assert taken.found.due
    assert taken.found.operation.published_at is not None  # as the take stamped it
    assert _holder(engine, first) == _pid(taker)
    assert _advisory_locks(taker) == 1
    assert taker.info.get(SESSION_LOCKS_INFO)  # the pool's reset would release it
    sql.locks.unlock_all(taker)
    again = _take(taker)
    assert [c.id for c in again.claimed] == [second]
    assert not again.more


def test_a_take_s_own_commit_does_not_change_the_session_s_durability(
    taker: Connection, engine: Engine
) -> None:
    """``flush=False`` holds for the take's transaction only: the attempt's commits on the
    same connection stay durable."""
    _enqueue(engine, 1)
    sql.locks.set_synchronous_commit(taker)
    assert _take(taker).locked
    setting = taker.execute(text("SHOW synchronous_commit")).scalar_one()
    assert setting == "on"


def test_a_row_without_a_lock_key_is_claimed_and_left_for_its_task_to_lock(
    engine: Engine, taker: Connection
) -> None:
    """A row enqueued before migration 0027 (no key): claimed, not locked, nothing held."""
    [op_id] = _enqueue(engine, 1)
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox.operations SET lock_key = NULL"))
    taken = _take(taker)
    assert [c.id for c in taken.claimed] == [op_id]
    assert (taken.locked, taken.found) == (False, None)
    assert _advisory_locks(taker) == 0
    assert not taker.info.get(SESSION_LOCKS_INFO)  # no unlock owed when it goes back


def test_a_wrong_lock_key_is_released_and_not_trusted(engine: Engine, taker: Connection) -> None:
    """A key that is not the id's (written by hand, or a bug) locks nothing anyone else
    would see: the take lets it go at once and reports the row not locked."""
    [op_id] = _enqueue(engine, 1)
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox.operations SET lock_key = 42"))
    taken = _take(taker)
    assert [c.id for c in taken.claimed] == [op_id]
    assert (taken.locked, taken.found) == (False, None)
    assert _advisory_locks(taker) == 0


def test_a_lock_another_holder_has_is_not_taken(engine: Engine, taker: Connection) -> None:
    [op_id] = _enqueue(engine, 1)
    with engine.connect() as other:
        assert sql.locks.try_lock(other, operation_lock_key(op_id))
        taken = _take(taker)
        assert [c.id for c in taken.claimed] == [op_id]
        assert not taken.locked
        assert _advisory_locks(taker) == 0
        sql.locks.unlock_all(other)


def test_a_take_that_locks_claims_one_row(taker: Connection) -> None:
    with pytest.raises(ValueError, match="one row, not 2"):
        sql.relay.take_due(taker, limit=2, republish_after_s=1.0, lock=True)


def test_the_relay_s_claim_never_reads_through_the_lock(engine: Engine) -> None:
    """The relay runs the same statement without locking: the locked read is never called."""
    _enqueue(engine, 3)
    with engine.connect() as conn, conn.begin() as tx:
        plan = conn.execute(
            text(f"EXPLAIN (ANALYZE, FORMAT JSON) {_CLAIM_AND_MARK_DUE.clause}"),
            {
                "limit": 3,
                "look": 3,
                "republish_after": 30,
                "hold_back": 0,
                # The relay's: a look at RabbitMQ workers taking directly (none here).
                "defer": 0.2,
                "fresh": 30,
                "without_flush": False,
                "lock": False,
                "send": False,
                "send_tools": [],
                "send_max_attempts": [],
                "send_approval": [],
            },
        ).scalar_one()
        tx.rollback()
    # The locked read's function (the look at the workers' flags scans a function too).
    calls = [n for n in _nodes(plan[0]["Plan"]) if n.get("Function Name") == "operation_if_locked"]
    assert [n["Actual Loops"] for n in calls] == [0]


def _nodes(node: dict[str, object]) -> Iterator[dict[str, object]]:
    yield node
    for child in node.get("Plans", []):  # type: ignore[attr-defined]
        yield from _nodes(child)


# --- the hand-off -------------------------------------------------------------------------


def _hand(engine: Engine, handoffs: Handoffs) -> UUID:
    """Enqueue one operation and take it as a worker does: claimed, locked and read on a
    connection of ``engine``'s pool, which waits in ``handoffs`` for its task."""
    [op_id] = _enqueue(engine, 1)
    source = DirectDispatch(
        Celery(set_as_current=False), "q", REPUBLISH_AFTER_S, engine=lambda: engine
    )
    taken = source._take_and_lock(handoffs)
    assert [c.id for c in taken.claimed] == [op_id]
    assert taken.locked
    return op_id


def test_a_task_adopts_the_lock_its_take_handed_over_and_attempts_on_it(
    engine: Engine,
) -> None:
    """The task's lock is the take's (the same session), and the attempt runs on it: one
    call, confirmed, the lock released with the message's locks."""
    registry = ToolRegistry(ContractTable())
    calls: list[str] = []

    def create(call: ToolCall) -> Applied:
        calls.append(call.operation_id)
        return Applied(f"ref-{call.operation_id}")

    tool("deploy.create", timeout=2, send_deadline=2, inflight_horizon=60, registry=registry)(
        create
    )
    handoffs = Handoffs()
    op_id = _hand(engine, handoffs)
    holder = _holder(engine, op_id)
    assert holder is not None
    assert len(handoffs) == 1
    with DispatchLocks(engine, adopt=handoffs.adopt) as locks:
        with locks.lock(op_id) as locked:
            assert locked is not None
            conn, found = locked
            assert found is not None
            assert found.operation.id == op_id
            assert _pid(conn) == holder  # the same session: no second lock taken
            assert len(handoffs) == 0
        report = dispatch(op_id, engine=engine, registry=registry, locks=locks)
    assert report.outcome is Outcome.CONFIRMED
    assert calls == [str(op_id)]
    assert _holder(engine, op_id) is None


def test_a_task_with_nothing_handed_takes_the_lock_itself(engine: Engine) -> None:
    handoffs = Handoffs()
    [op_id] = _enqueue(engine, 1)
    with DispatchLocks(engine, adopt=handoffs.adopt) as locks, locks.lock(op_id) as locked:
        assert locked is not None
        assert _holder(engine, op_id) == _pid(locked[0])
    assert _holder(engine, op_id) is None


def test_a_lock_no_task_adopts_is_released(engine: Engine) -> None:
    """By the task that ran for other operations, by the reaper after its wait, by close."""
    handoffs = Handoffs(max_wait_s=0.2)
    kept, reaped, closed = (_hand(engine, handoffs) for _ in range(3))
    handoffs.release([kept])
    assert _holder(engine, kept) is None
    assert handoffs.reap() == 0  # too young
    time.sleep(0.3)
    assert handoffs.reap() == 2
    assert _holder(engine, reaped) is None
    assert _holder(engine, closed) is None
    again = _hand(engine, handoffs)
    handoffs.close()
    assert _holder(engine, again) is None
    assert len(handoffs) == 0


def test_a_second_hand_off_for_an_operation_releases_the_first(engine: Engine) -> None:
    """An operation claimed again (its message was lost) while its first hand-off still
    waits: the first connection and its lock go."""
    handoffs = Handoffs()
    op_id = _hand(engine, handoffs)
    assert _holder(engine, op_id) is not None
    handoffs.give(op_id, engine.connect(), None)
    assert _holder(engine, op_id) is None
    assert len(handoffs) == 1
    handoffs.close()


def test_room_for_hand_offs_is_limited(engine: Engine) -> None:
    handoffs = Handoffs(max_waiting=2)
    assert handoffs.has_room()
    _hand(engine, handoffs)
    _hand(engine, handoffs)
    assert not handoffs.has_room()
    handoffs.close()
    assert handoffs.has_room()


# --- the worker's take --------------------------------------------------------------------


def test_a_worker_hands_its_lock_over_only_while_it_keeps_up(
    database_url: str, engine: Engine
) -> None:
    """A real kombu channel on the database broker: once idle (its flag up), the take that
    finds one operation hands its lock; through a backlog (each take leaving more due) the
    takes after the first do not, and the consumer's take stays its cheapest; once it keeps
    up again it hands again. (No task runs here: the hand-offs wait, so they can be seen.)"""
    app = _app(database_url)
    handoffs = Handoffs()
    handoff.start(handoffs)
    dbbroker.take_directly(
        DirectDispatch(app, dispatch_queue(app), REPUBLISH_AFTER_S, engine=lambda: engine)
    )
    got: list[str] = []

    def on_message(body: list[Any], message: Any) -> None:
        got.append(body[1]["operation_id"])
        message.ack()

    def drain(count: int, timeout: float = 2.0) -> list[str]:
        del got[:]
        while len(got) < count:
            try:
                conn.drain_events(timeout=timeout)
            except TimeoutError:
                break
        return list(got)

    queues = [q for q in app.conf.task_queues if q.alias == "dispatch"]
    try:
        with (
            app.connection_for_read() as conn,
            conn.Consumer(queues, callbacks=[on_message], prefetch_count=8),
        ):
            assert drain(1, timeout=0.5) == []  # nothing due: its flag goes up
            backlog = _enqueue(engine, 5)
            assert drain(5) == [str(one) for one in backlog]
            assert len(handoffs) == 1
            assert handoffs.adopt(backlog[0]) is not None  # the first take's, before it knew
            [alone] = _enqueue(engine, 1)
            assert drain(1) == [str(alone)]
            assert handoffs.adopt(alone) is not None
            assert len(handoffs) == 0
    finally:
        dbbroker.take_directly(None)
        handoff.start(None)


# --- the take that sends (change 46) ------------------------------------------------------

TERMS = SendTerms(("deploy.create",), (3,), (False,))


def _take_and_send(conn: Connection, terms: SendTerms = TERMS) -> DueTake:
    taken = transitions.take_and_mark_sent(conn, republish_after_s=REPUBLISH_AFTER_S, terms=terms)
    conn.commit()  # SQLAlchemy's own marker (autocommit: nothing is sent)
    return taken


def _trail(engine: Engine, op_id: UUID) -> list[tuple[str, str, str]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT from_state, to_state, reason FROM outbox.events "
                "WHERE operation_id = :id ORDER BY id"
            ),
            {"id": op_id},
        ).all()
    return [(row.from_state, row.to_state, row.reason) for row in rows]


def test_a_take_that_sends_claims_locks_and_moves_to_sent_in_one_statement(
    engine: Engine, taker: Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the lock is held the row goes `planned -> sent` with its event, in the take's
    own statement, and that statement's commit waits for the disk."""
    seen: list[bool] = []
    run = DriverStatement.fetch_all

    def spy(self: DriverStatement, executor: Any, params: Any) -> Any:
        if self is _CLAIM_AND_MARK_DUE:
            seen.append(params["without_flush"])
        return run(self, executor, params)

    monkeypatch.setattr(DriverStatement, "fetch_all", spy)
    [op_id] = _enqueue(engine, 1)
    taken = _take_and_send(taker)
    assert seen == [False]
    assert (taken.locked, taken.sent) == (True, True)
    assert taken.found is not None
    sent = taken.found.operation
    assert (sent.id, sent.state.value, sent.attempts) == (op_id, "sent", 1)
    assert sent.sent_at is not None
    assert sent.published_at is None  # moved, not stamped: one statement updates a row once
    assert _holder(engine, op_id) == _pid(taker)
    assert _trail(engine, op_id)[-1] == ("planned", "sent", "dispatching attempt 1")


@pytest.mark.parametrize(
    ("change", "terms"),
    [
        ("", SendTerms(("deploy.other",), (3,), (False,))),  # not a tool this worker sends
        ("", SendTerms(("deploy.create",), (3,), (True,))),  # an approval it lacks
        ("replay_deadline = now() - interval '1 s'", TERMS),
    ],
    ids=["tool", "approval", "replay deadline"],
)
def test_a_take_whose_check_refuses_claims_locks_and_reads_as_before(
    engine: Engine, taker: Connection, change: str, terms: SendTerms
) -> None:
    [op_id] = _enqueue(engine, 1)
    if change:
        with engine.begin() as conn:
            conn.execute(text(f"UPDATE outbox.operations SET {change}"))
    taken = _take_and_send(taker, terms)
    assert (taken.locked, taken.sent) == (True, False)
    assert taken.found is not None
    assert taken.found.operation.state.value == "planned"
    assert taken.found.operation.published_at is not None  # stamped, as a take does
    assert _holder(engine, op_id) == _pid(taker)
    assert [t[1] for t in _trail(engine, op_id)] == ["planned"]


def test_a_take_counts_max_attempts_from_the_budget_base(engine: Engine, taker: Connection) -> None:
    [op_id] = _enqueue(engine, 1)
    one = SendTerms(("deploy.create",), (1,), (False,))
    first = _take_and_send(taker, one)
    assert first.sent
    back = transitions.replan(
        op_id,
        from_state=State.SENT,
        actor=Actor.DISPATCHER,
        attempt=1,
        reason="not delivered",
        last_error="not delivered",
    )
    assert isinstance(transitions.apply_and_commit(taker, back), transitions.Moved)
    sql.locks.unlock_all(taker)
    taker.commit()
    again = _take_and_send(taker, one)  # 1 of 1 used: taken and read, not sent
    assert (again.locked, again.sent) == (True, False)


def test_a_take_that_finds_the_lock_held_moves_nothing(engine: Engine, taker: Connection) -> None:
    [op_id] = _enqueue(engine, 1)
    with engine.connect() as other:
        assert sql.locks.try_lock(other, operation_lock_key(op_id))
        taken = _take_and_send(taker)
        sql.locks.unlock_all(other)
        other.commit()
    assert (taken.locked, taken.sent) == (False, False)
    assert [t[1] for t in _trail(engine, op_id)] == ["planned"]


def _source(engine: Engine, registry: ToolRegistry) -> DirectDispatch:
    return DirectDispatch(
        Celery(set_as_current=False),
        "q",
        REPUBLISH_AFTER_S,
        engine=lambda: engine,
        registry=registry,
    )


@pytest.fixture
def registry() -> tuple[ToolRegistry, list[str]]:
    """deploy.create, a Python tool that applies every call and remembers it."""
    tools = ToolRegistry(ContractTable())
    calls: list[str] = []

    def create(call: ToolCall) -> Applied:
        calls.append(call.operation_id)
        return Applied(f"ref-{call.operation_id}")

    tool("deploy.create", timeout=2, send_deadline=2, inflight_horizon=60, registry=tools)(create)
    return tools, calls


def test_a_task_adopting_a_take_that_sent_goes_straight_to_the_call(
    engine: Engine, registry: tuple[ToolRegistry, list[str]]
) -> None:
    tools, calls = registry
    handoffs = Handoffs()
    [op_id] = _enqueue(engine, 1)
    taken = _source(engine, tools)._take_and_lock(handoffs)
    assert (taken.locked, taken.sent) == (True, True)
    adopted: list[Handed | None] = []

    def adopt(one: UUID) -> Handed | None:
        adopted.append(handoffs.adopt(one))
        return adopted[-1]

    with DispatchLocks(engine, adopt=adopt) as locks:
        report = dispatch(op_id, engine=engine, registry=tools, locks=locks)
    [handed] = adopted
    assert handed is not None
    assert isinstance(handed.found, SentAtLock)
    assert report.outcome is Outcome.CONFIRMED
    assert report.attempt == 1
    assert calls == [str(op_id)]
    assert [t[:2] for t in _trail(engine, op_id)][-2:] == [
        ("planned", "sent"),
        ("sent", "confirmed"),
    ]
    assert _holder(engine, op_id) is None


def test_a_sent_hand_off_no_task_adopts_goes_back_to_planned_as_never_sent(
    engine: Engine, registry: tuple[ToolRegistry, list[str]]
) -> None:
    """Released by the task that ran for other operations, the reaper, or close: each
    under the lock still held, so nothing can have been sent; due again at once."""
    tools, calls = registry
    handoffs = Handoffs(max_wait_s=0.2)
    source = _source(engine, tools)
    ids = []
    for _ in range(3):
        [op_id] = _enqueue(engine, 1)
        assert source._take_and_lock(handoffs).sent
        ids.append(op_id)
    handoffs.release([ids[0]])
    time.sleep(0.3)
    assert handoffs.reap() == 2
    for op_id in ids:
        assert _holder(engine, op_id) is None
        assert _trail(engine, op_id)[-1] == (
            "sent",
            "planned",
            "not sent: no task took the operation its take handed over",
        )
    with engine.connect() as conn:
        states = conn.execute(
            text("SELECT DISTINCT state, available_at <= now() FROM outbox.operations")
        ).all()
    assert [tuple(row) for row in states] == [("planned", True)]
    assert calls == []


def test_a_take_that_sent_under_a_wrong_lock_key_sends_it_to_a_person_unsent(
    engine: Engine, registry: tuple[ToolRegistry, list[str]]
) -> None:
    """The stored key cannot be checked in SQL: a row moved under a key that is not its own
    is held by a lock no other dispatcher takes. Back to `planned` as never sent, then to a
    person; no lock kept, nothing handed."""
    tools, calls = registry
    [op_id] = _enqueue(engine, 1)
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox.operations SET lock_key = 42"))
    handoffs = Handoffs()
    taken = _source(engine, tools)._take_and_lock(handoffs)
    assert (taken.locked, taken.sent) == (False, True)
    assert len(handoffs) == 0
    assert [t[:2] for t in _trail(engine, op_id)][-3:] == [
        ("planned", "sent"),
        ("sent", "planned"),
        ("planned", "needs_human"),
    ]
    assert "lock key is not its own" in _trail(engine, op_id)[-1][2]
    assert calls == []
