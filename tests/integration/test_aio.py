"""The asyncio agent API on a real database: outbox.aio on AsyncSession and AsyncConnection,
and its awaitable wait on one shared listener per event loop."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from outbox import aio, api, listener
from outbox.db import create_async_engine
from outbox.errors import (
    AlreadyDecided,
    ApprovalMismatch,
    IntentConflict,
    InvalidIntent,
    NotCancellable,
    OperationNotFound,
    ResolutionRefused,
    WaitTimeout,
)
from outbox.models import Operation
from outbox.states import Actor, State
from tests.factories import event_count, events_of, make_operation, move, operation_count, reload

T = TypeVar("T")

TOOL = "deploy.create_release"
TARGET = "project-a"
PAYLOAD: dict[str, Any] = {"version": "1.2.3", "notes": ["fix"], "draft": False}


def run(url: str, body: Callable[[AsyncEngine], Awaitable[T]], *, close: bool = True) -> T:
    """``body(engine)`` on a new event loop with an async engine on ``url``; the loop's
    listeners closed (unless ``close`` is False) and the engine disposed at the end."""

    async def main() -> T:
        engine = create_async_engine(url, pool_size=5, max_overflow=0)
        try:
            return await body(engine)
        finally:
            if close:
                await aio.close()
            await engine.dispose()

    return asyncio.run(main())


@asynccontextmanager
async def executor(engine: AsyncEngine, kind: str) -> AsyncIterator[Any]:
    """An AsyncSession or an AsyncConnection on ``engine``, not yet in a transaction."""
    if kind == "session":
        async with AsyncSession(engine) as session:
            yield session
    else:
        async with engine.connect() as conn:
            yield conn


KINDS = pytest.mark.parametrize("kind", ["session", "connection"])


@pytest.fixture
def url(engine: Engine, database_url: str) -> str:
    """The emptied test database's URL (the ``engine`` fixture empties it)."""
    return database_url


async def enqueue_committed(engine: AsyncEngine, **overrides: Any) -> Operation:
    arguments: dict[str, Any] = {"tool": TOOL, "target": TARGET, "payload": PAYLOAD} | overrides
    async with AsyncSession(engine) as session, session.begin():
        return await aio.enqueue(session, **arguments)


# --- enqueue, enqueue_many, get, find, cancel, resolve --------------------------------------


@KINDS
def test_enqueue_joins_the_callers_transaction(url: str, engine: Engine, kind: str) -> None:
    """aio.enqueue writes the planned operation and its first event in the caller's
    transaction, visible to no one else until the caller commits."""

    async def body(aengine: AsyncEngine) -> Operation:
        async with executor(aengine, kind) as db:
            op = await aio.enqueue(
                db, tool=TOOL, target=TARGET, payload=PAYLOAD, intent_key="k", metadata={"r": 1}
            )
            assert await aio.get(db, op.id) == op
            assert operation_count(engine) == 0
            await db.commit()
        return op

    op = run(url, body)
    assert (op.state, op.intent_key, op.payload, op.metadata) == (
        State.PLANNED,
        "k",
        PAYLOAD,
        {"r": 1},
    )
    assert reload(engine, op.id) == op
    [event] = events_of(engine, op.id)
    assert (event.to_state, event.actor, event.reason) == (State.PLANNED, "agent", "enqueued")


@KINDS
def test_a_rolled_back_transaction_leaves_no_row(url: str, engine: Engine, kind: str) -> None:
    """An intent enqueued in an async transaction that rolls back leaves no row and no event."""

    async def body(aengine: AsyncEngine) -> None:
        async with executor(aengine, kind) as db:
            op = await aio.enqueue(db, tool=TOOL, target=TARGET, payload=PAYLOAD)
            many = await aio.enqueue_many(db, [api.Intent(TOOL, TARGET, {"n": 1})])
            assert await aio.get(db, op.id) is not None
            assert await aio.get(db, many[0].id) is not None
            await db.rollback()

    run(url, body)
    assert operation_count(engine) == 0
    assert event_count(engine) == 0


@KINDS
def test_same_key_returns_the_same_operation_and_another_intent_conflicts(
    url: str, engine: Engine, kind: str
) -> None:
    """The same key and intent returns the existing operation; another payload raises
    IntentConflict naming it, writes nothing, and the caller's transaction goes on."""

    async def body(aengine: AsyncEngine) -> tuple[Operation, Operation, Operation]:
        first = await enqueue_committed(aengine, intent_key="release")
        async with executor(aengine, kind) as db:
            again = await aio.enqueue(
                db, tool=TOOL, target=TARGET, payload=PAYLOAD, intent_key="release"
            )
            with pytest.raises(IntentConflict) as caught:
                await aio.enqueue(
                    db, tool=TOOL, target=TARGET, payload={"version": "9"}, intent_key="release"
                )
            assert caught.value.differences == ("payload",)
            assert caught.value.operation_id == first.id
            other = await aio.enqueue(db, tool=TOOL, target=TARGET, payload={}, intent_key="k2")
            await db.commit()
        return first, again, other

    first, again, other = run(url, body)
    assert again == first
    assert operation_count(engine) == 2
    assert reload(engine, other.id).intent_key == "k2"


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"tool": "not a tool"}, "tool"),
        ({"target": ""}, "target"),
        ({"payload": ["not", "an", "object"]}, "payload"),
        ({"intent_key": "k" * 256}, "intent_key"),
        ({"metadata": {"tags": {"a"}}}, "metadata"),
    ],
)
def test_invalid_intent_names_the_field_and_writes_nothing(
    url: str, engine: Engine, arguments: dict[str, Any], field: str
) -> None:
    """Malformed input raises InvalidIntent naming the field, as the sync enqueue does."""

    async def body(aengine: AsyncEngine) -> None:
        async with AsyncSession(aengine) as session:
            with pytest.raises(InvalidIntent) as caught:
                await aio.enqueue(
                    session, **({"tool": TOOL, "target": TARGET, "payload": PAYLOAD} | arguments)
                )
            assert caught.value.field == field
            await session.commit()

    run(url, body)
    assert operation_count(engine) == 0


@KINDS
def test_get_find_and_a_garbage_id(url: str, engine: Engine, kind: str) -> None:
    """get reads by id, find by key; missing ones give None; a non-id raises OperationNotFound."""

    async def body(aengine: AsyncEngine) -> None:
        op = await enqueue_committed(aengine, intent_key="release")
        async with executor(aengine, kind) as db:
            assert await aio.get(db, str(op.id)) == op
            assert await aio.find(db, "release") == op
            assert await aio.get(db, uuid.uuid4()) is None
            assert await aio.find(db, "no-such-key") is None
            with pytest.raises(OperationNotFound, match="not an operation id"):
                await aio.get(db, "not-a-uuid")

    run(url, body)


@KINDS
def test_cancel(url: str, engine: Engine, kind: str) -> None:
    """cancel moves a planned operation to cancelled in the caller's transaction (a rollback
    keeps it planned); past planned it raises NotCancellable."""
    planned = make_operation(engine, State.PLANNED)
    sent = make_operation(engine, State.SENT)

    async def body(aengine: AsyncEngine) -> Operation:
        async with executor(aengine, kind) as db:
            await aio.cancel(db, planned.id)
            await db.rollback()
            with pytest.raises(NotCancellable):
                await aio.cancel(db, sent.id)
            await db.rollback()
            with pytest.raises(OperationNotFound):
                await aio.cancel(db, uuid.uuid4())
            await db.rollback()
            cancelled = await aio.cancel(db, str(planned.id), reason="changed my mind")
            await db.commit()
        return cancelled

    cancelled = run(url, body)
    assert cancelled.state is State.CANCELLED
    assert reload(engine, planned.id) == cancelled
    assert events_of(engine, planned.id)[-1].reason == "changed my mind"
    assert reload(engine, sent.id) == sent


@KINDS
def test_enqueue_many_rolls_back_its_savepoint_on_a_conflict(
    url: str, engine: Engine, kind: str
) -> None:
    """enqueue_many records a batch in input order; a conflicting batch rolls back to its
    savepoint (through the async connection) and the caller's transaction goes on."""

    async def body(aengine: AsyncEngine) -> list[Operation]:
        await enqueue_committed(aengine, intent_key="taken")
        async with executor(aengine, kind) as db:
            ops = await aio.enqueue_many(
                db, (api.Intent(TOOL, TARGET, {"n": i}, intent_key=f"b{i}") for i in range(3))
            )
            with pytest.raises(IntentConflict, match="'taken'"):
                await aio.enqueue_many(
                    db,
                    [
                        api.Intent(TOOL, TARGET, {"v": 1}, intent_key="fresh"),
                        api.Intent(TOOL, TARGET, {"v": 2}, intent_key="taken"),
                    ],
                )
            assert await aio.find(db, "fresh") is None
            await db.commit()
        return ops

    ops = run(url, body)
    assert [op.intent_key for op in ops] == ["b0", "b1", "b2"]
    assert operation_count(engine) == 4


def test_resolve_records_the_operators_verdict(url: str, engine: Engine) -> None:
    """aio.resolve runs the operator's resolution in the caller's transaction, with its checks."""
    unknown = make_operation(engine, State.NEEDS_HUMAN)

    async def body(aengine: AsyncEngine) -> Operation:
        async with AsyncSession(aengine) as session:
            with pytest.raises(ResolutionRefused) as refused:
                await aio.resolve(session, unknown.id, applied=True, by="ana", note="seen")
            assert refused.value.field == "remote_ref"
            await session.rollback()
            async with session.begin():
                return await aio.resolve(
                    session, unknown.id, applied=True, remote_ref="rel-9", by="ana", note="seen"
                )

    resolved = run(url, body)
    assert (resolved.state, resolved.remote_ref) == (State.CONFIRMED, "rel-9")
    assert reload(engine, unknown.id) == resolved


def test_approve_and_reject_decide_in_the_callers_transaction(url: str, engine: Engine) -> None:
    """aio.enqueue(require_approval=True) waits for a person; aio.approve with the stored hash
    plans it, a wrong hash is refused, and aio.reject cancels another, each in the caller's
    transaction."""

    async def body(aengine: AsyncEngine) -> tuple[Operation, Operation, Operation]:
        first = await enqueue_committed(aengine, intent_key="a1", require_approval=True)
        second = await enqueue_committed(aengine, intent_key="a2", require_approval=True)
        async with AsyncSession(aengine) as session:
            with pytest.raises(ApprovalMismatch):
                await aio.approve(session, first.id, by="ana", payload_hash="0" * 64)
            await session.rollback()
            async with session.begin():
                approved = await aio.approve(
                    session, first.id, by="ana", payload_hash=first.payload_hash, note="ok"
                )
                assert reload(engine, first.id).state is State.AWAITING_APPROVAL  # uncommitted
            async with session.begin():
                rejected = await aio.reject(session, second.id, by="ana", reason="not now")
            with pytest.raises(AlreadyDecided):
                await aio.reject(session, first.id, by="bo", reason="late")
        return first, approved, rejected

    first, approved, rejected = run(url, body)
    assert first.state is State.AWAITING_APPROVAL
    assert (approved.state, approved.decided_by) == (State.PLANNED, "ana")
    assert (rejected.state, rejected.decided_by) == (State.CANCELLED, "ana")
    assert reload(engine, approved.id) == approved


def test_wait_returns_awaiting_approval_unless_told_to_wait_through(
    url: str, engine: Engine
) -> None:
    """aio.wait returns an operation awaiting approval at once; with through_approval=True it
    waits on, and times out carrying the operation as last seen."""

    async def body(aengine: AsyncEngine) -> tuple[Operation, WaitTimeout]:
        op = await enqueue_committed(aengine, require_approval=True)
        seen = await aio.wait(op.id, timeout=5, engine=aengine)
        with pytest.raises(WaitTimeout) as timed_out:
            await aio.wait(
                op.id, timeout=0.5, engine=aengine, poll_interval=0.1, through_approval=True
            )
        return seen, timed_out.value

    seen, timed_out = run(url, body)
    assert seen.state is State.AWAITING_APPROVAL
    assert isinstance(timed_out.operation, Operation)
    assert timed_out.operation.state is State.AWAITING_APPROVAL


# --- wait -----------------------------------------------------------------------------------


def _waiter_rows(engine: Engine) -> list[tuple[uuid.UUID, int]]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT operation_id, backend_pid FROM outbox.waiters"))
        return [(row[0], row[1]) for row in rows]


async def _registered(engine: Engine, operation_id: uuid.UUID) -> int:
    """The backend pid under which ``operation_id`` gets registered as waited for."""
    for _ in range(500):
        rows = await asyncio.to_thread(_waiter_rows, engine)
        for op_id, pid in rows:
            if op_id == operation_id:
                return pid
        await asyncio.sleep(0.01)
    raise AssertionError(f"operation {operation_id} was never registered")


def test_wait_returns_settled_operations_and_raises_as_the_sync_one(
    url: str, engine: Engine
) -> None:
    """wait returns a confirmed or needs_human operation at once, raises WaitTimeout with the
    operation as last seen, and OperationNotFound for an unknown or garbage id."""
    confirmed = make_operation(engine, State.CONFIRMED)
    human = make_operation(engine, State.NEEDS_HUMAN)
    unknown = make_operation(engine, State.UNKNOWN)

    async def body(aengine: AsyncEngine) -> None:
        assert await aio.wait(confirmed.id, timeout=5, engine=aengine) == confirmed
        assert (await aio.wait(str(human.id), timeout=5, engine=aengine)).state is State.NEEDS_HUMAN
        with pytest.raises(WaitTimeout) as caught:
            await aio.wait(unknown.id, timeout=0.3, engine=aengine, poll_interval=0.1)
        assert caught.value.operation == unknown
        for missing in (uuid.uuid4(), "garbage"):
            with pytest.raises(OperationNotFound):
                await aio.wait(missing, timeout=5, engine=aengine)

    run(url, body)
    assert _waiter_rows(engine) == []


def test_wait_is_woken_by_the_notify_not_by_polling(url: str, engine: Engine) -> None:
    """A waiter whose poll interval is an hour returns soon after the operation settles: the
    settled move's NOTIFY woke it, and it read the row back only twice."""
    op = make_operation(engine, State.SENT)

    async def body(aengine: AsyncEngine) -> tuple[Operation, int]:
        waiting = asyncio.create_task(
            aio.wait(op.id, timeout=60, engine=aengine, poll_interval=3600)
        )
        # Until its first read found the operation still sent: a condition, not a number of
        # tries (on a loaded machine the first read came after 1000 x 10 ms, the move before
        # it, and the waiter read the row once). pytest-timeout bounds the wait.
        while not (
            (shared := listener.listeners_of_this_loop()) and shared[0].statements["read"] >= 1
        ):
            await asyncio.sleep(0.01)
        await asyncio.to_thread(
            move, engine, op, State.CONFIRMED, Actor.DISPATCHER, remote_ref="rel-7"
        )
        settled = await waiting
        return settled, shared[0].statements["read"]

    started = time.monotonic()
    settled, reads = run(url, body)
    assert (settled.state, settled.remote_ref) == (State.CONFIRMED, "rel-7")
    assert time.monotonic() - started < 30  # far below the hour a poll would have taken
    # The first read, and the one the NOTIFY asked for; or the first read alone, when the move
    # committed before it ran (the count goes up when a read is sent, not when it returns: CI
    # saw it once on a loaded machine). A poll would have taken the hour either way.
    assert reads in (1, 2)
    assert _waiter_rows(engine) == []


@pytest.mark.slow
def test_200_concurrent_enqueue_and_wait_on_one_loop(url: str, engine: Engine) -> None:
    """200 tasks on one loop each enqueue, commit and wait while another thread settles their
    operations: each gets its confirmed operation back, on a handful of connections."""
    settle: queue.Queue[Operation | None] = queue.Queue()
    peak = [0]

    def settler() -> None:
        while (op := settle.get()) is not None:
            sent = move(engine, op, State.SENT, Actor.DISPATCHER)
            move(engine, sent, State.CONFIRMED, Actor.DISPATCHER, remote_ref=f"ref-{op.id}")

    def connections() -> int:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                ).scalar_one()
            )

    async def body(aengine: AsyncEngine) -> list[tuple[Operation, Operation]]:
        done = asyncio.Event()

        async def agent(i: int) -> tuple[Operation, Operation]:
            async with AsyncSession(aengine) as session, session.begin():
                op = await aio.enqueue(session, tool=TOOL, target=f"t{i}", payload={"i": i})
            settle.put(op)
            return op, await aio.wait(op.id, timeout=90, engine=aengine)

        async def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], await asyncio.to_thread(connections))
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        try:
            return await asyncio.gather(*(agent(i) for i in range(200)))
        finally:
            done.set()
            await sampler

    before = connections()
    thread = threading.Thread(target=settler)
    thread.start()
    try:
        pairs = run(url, body)
    finally:
        settle.put(None)
        thread.join(timeout=60)
    for op, settled in pairs:
        assert (settled.id, settled.state, settled.remote_ref) == (
            op.id,
            State.CONFIRMED,
            f"ref-{op.id}",
        )
    # The async engine's pool (5), the shared listener (2), the settler's and sampler's
    # connections of the sync pool: nothing per waiter.
    assert peak[0] - before <= 5 + 2 + 3, (peak[0], before)
    assert _waiter_rows(engine) == []


def test_cancelling_a_waiting_task_removes_its_registration(url: str, engine: Engine) -> None:
    """A waiting task cancelled by its caller removes its outbox.waiters row."""
    op = make_operation(engine, State.SENT)

    async def body(aengine: AsyncEngine) -> None:
        waiting = asyncio.create_task(aio.wait(op.id, timeout=60, engine=aengine))
        await _registered(engine, op.id)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await asyncio.to_thread(_waiter_rows, engine) == []

    run(url, body)


def test_two_waiters_of_one_operation_share_its_registration(url: str, engine: Engine) -> None:
    """Two waiters of one operation: one row while either waits; the first leaving (cancelled)
    keeps it for the other, which still gets the NOTIFY."""
    op = make_operation(engine, State.SENT)

    async def body(aengine: AsyncEngine) -> Operation:
        first = asyncio.create_task(aio.wait(op.id, timeout=60, engine=aengine))
        second = asyncio.create_task(
            aio.wait(op.id, timeout=60, engine=aengine, poll_interval=3600)
        )
        await _registered(engine, op.id)
        await asyncio.sleep(0.1)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert len(await asyncio.to_thread(_waiter_rows, engine)) == 1
        await asyncio.to_thread(move, engine, op, State.CONFIRMED, Actor.DISPATCHER, remote_ref="r")
        return await second

    assert run(url, body).state is State.CONFIRMED
    assert _waiter_rows(engine) == []


def _terminate(engine: Engine, where: str, **params: Any) -> list[int]:
    """pg_terminate_backend the test database's backends matching ``where``; their pids."""
    with engine.connect() as conn:
        pids = [
            int(pid)
            for pid in conn.execute(
                text(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    f"AND pid <> pg_backend_pid() AND {where}"
                ),
                params,
            ).scalars()
        ]
        for pid in pids:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    return pids


def _listening(engine: Engine) -> list[int]:
    """The pids of the test database's backends whose last statement was the LISTEN."""
    with engine.connect() as conn:
        return [
            int(pid)
            for pid in conn.execute(
                text(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND query = 'LISTEN outbox_settled'"
                )
            ).scalars()
        ]


def test_the_listener_reconnects_after_its_backend_is_terminated(url: str, engine: Engine) -> None:
    """Killing the listening backend mid-wait: the listener LISTENs again on a new one and the
    waiter (polling once an hour) still wakes when its operation settles."""
    op = make_operation(engine, State.SENT)

    async def body(aengine: AsyncEngine) -> Operation:
        waiting = asyncio.create_task(
            aio.wait(op.id, timeout=60, engine=aengine, poll_interval=3600)
        )
        await _registered(engine, op.id)
        [killed] = await asyncio.to_thread(
            _terminate, engine, "query = :listen", listen="LISTEN outbox_settled"
        )
        for _ in range(500):  # until a new backend LISTENs
            listening = await asyncio.to_thread(_listening, engine)
            if listening and killed not in listening:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("no backend LISTENs again")
        await asyncio.to_thread(move, engine, op, State.CONFIRMED, Actor.DISPATCHER, remote_ref="r")
        return await waiting

    assert run(url, body).state is State.CONFIRMED


def test_the_waiters_connection_reconnects_and_registers_again(url: str, engine: Engine) -> None:
    """Killing the backend holding the registrations mid-wait: the next read opens a new one
    and registers the operation again under it, and the waiter returns the settled row."""
    op = make_operation(engine, State.SENT)

    async def body(aengine: AsyncEngine) -> Operation:
        waiting = asyncio.create_task(
            aio.wait(op.id, timeout=60, engine=aengine, poll_interval=0.2)
        )
        pid = await _registered(engine, op.id)
        assert await asyncio.to_thread(_terminate, engine, "pid = :pid", pid=pid) == [pid]
        for _ in range(500):
            rows = await asyncio.to_thread(_waiter_rows, engine)
            if any(op_id == op.id and other != pid for op_id, other in rows):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the operation was not registered again")
        await asyncio.to_thread(move, engine, op, State.CONFIRMED, Actor.DISPATCHER, remote_ref="r")
        return await waiting

    assert run(url, body).state is State.CONFIRMED


def test_listeners_do_not_outlive_their_event_loop(url: str, engine: Engine) -> None:
    """Loop after loop without close(): each asyncio.run ends its listener and its
    connections, and the next loop's wait opens its own."""
    confirmed = make_operation(engine, State.CONFIRMED)

    async def body(aengine: AsyncEngine) -> Operation:
        # By URL: the listener opens (and must close) connections of its own.
        return await aio.wait(
            confirmed.id, timeout=5, engine=aengine.url.render_as_string(hide_password=False)
        )

    for _ in range(3):
        assert run(url, body, close=False) == confirmed
    for _ in range(500):  # a closed socket's backend exits a moment later
        if not _listening(engine):
            break
        time.sleep(0.01)
    assert _listening(engine) == []


def test_close_while_waiting_moves_the_waiter_to_a_new_listener(url: str, engine: Engine) -> None:
    """aio.close() under a pending wait closes the shared connections; the waiter registers
    again on the loop's next listener and still gets its operation when it settles."""
    op = make_operation(engine, State.SENT)

    async def body(aengine: AsyncEngine) -> Operation:
        waiting = asyncio.create_task(
            aio.wait(op.id, timeout=60, engine=aengine, poll_interval=3600)
        )
        first = await _registered(engine, op.id)
        await aio.close()
        for _ in range(500):
            rows = await asyncio.to_thread(_waiter_rows, engine)
            if any(op_id == op.id and pid != first for op_id, pid in rows):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the waiter did not register on a new listener")
        await asyncio.to_thread(move, engine, op, State.CONFIRMED, Actor.DISPATCHER, remote_ref="r")
        return await waiting

    assert run(url, body).state is State.CONFIRMED
    assert _waiter_rows(engine) == []
