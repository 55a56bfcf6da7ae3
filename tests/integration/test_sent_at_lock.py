"""The `sent` move made by the statement that takes the dispatcher's lock (change 45).

One statement takes the operation's advisory lock, and only once it is held moves the row
``planned -> sent`` if every check a dispatcher makes before a send passes, committed
durably: each check is tested here refusing on its own, with nothing written and the lock
kept for the dispatcher's own read; then the dispatcher's use of it, where the one check the
database cannot make (the payload against its hashes) comes after that commit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any
from uuid import UUID

import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import DBAPIError

from outbox import sql, transitions
from outbox.contracts import ContractTable
from outbox.guards import Rate
from outbox.locks import operation_lock_key
from outbox.states import Actor, State
from outbox.tools import ToolRegistry, tool
from outbox.transitions import LockedSend, SendTerms
from outbox.workers.dispatch import DispatchConfig, Outcome, dispatch
from outbox.workers.locking import DispatchLocks, SentAtLock
from tests.factories import (
    age,
    cancelled_meanwhile,
    events_of,
    make_operation,
    reload,
    tamper,
)
from tests.integration.test_dispatch import Remote

TOOL = "deploy.create_release"
TERMS = SendTerms((TOOL,), (3,), (False,))


@pytest.fixture
def conn(engine: Engine) -> Iterator[Connection]:
    """An autocommit connection whose session starts with ``synchronous_commit = off``, as
    a dispatcher's lock connection might come from a pool with another default."""
    with engine.connect() as connection:
        connection.execution_options(isolation_level="AUTOCOMMIT")
        connection.execute(text("SET synchronous_commit = off"))
        yield connection
        connection.execute(text("SELECT pg_advisory_unlock_all()"))


def _send(
    conn: Connection, op_id: UUID, terms: SendTerms = TERMS, *, unlock_first: bool = False
) -> LockedSend:
    locked = transitions.lock_and_mark_sent_and_commit(
        conn, op_id, lock_key=operation_lock_key(op_id), unlock_first=unlock_first, terms=terms
    )
    conn.commit()  # SQLAlchemy's own marker (autocommit: nothing is sent)
    return locked


def _holds_lock(conn: Connection, op_id: UUID) -> bool:
    key = operation_lock_key(op_id) & 0xFFFFFFFFFFFFFFFF
    held = conn.execute(
        text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND pid = pg_backend_pid() AND classid = :hi AND objid = :lo AND objsubid = 1"
        ),
        {"hi": key >> 32, "lo": key & 0xFFFFFFFF},
    ).scalar_one()
    return bool(held)


def test_a_due_planned_row_is_locked_and_sent_in_one_durable_statement(
    engine: Engine, conn: Connection
) -> None:
    op = make_operation(engine)
    locked = _send(conn, op.id)
    assert locked.taken
    assert locked.moved is not None
    sent = locked.moved.operation
    assert (sent.state, sent.attempts) == (State.SENT, 1)
    assert sent.sent_at is not None
    assert sent.first_sent_at == sent.sent_at
    assert _holds_lock(conn, op.id)
    # Committed: another session sees it, with its event, while the lock is still held.
    stored = reload(engine, op.id)
    assert (stored.state, stored.attempts) == (State.SENT, 1)
    last = events_of(engine, op.id)[-1]
    assert (last.from_state, last.to_state, last.actor, last.attempt) == (
        State.PLANNED,
        State.SENT,
        Actor.DISPATCHER,
        1,
    )
    assert last.reason == "dispatching attempt 1"
    # The session's commits wait for the disk from this statement on, its own included.
    assert locked.synchronous_commit == "on"
    assert conn.execute(text("SHOW synchronous_commit")).scalar_one() == "on"


def _refused(engine: Engine, conn: Connection, op_id: UUID, terms: SendTerms = TERMS) -> None:
    """The statement took the lock and moved nothing: no event, the row as it was."""
    before = reload(engine, op_id)
    events_before = len(events_of(engine, op_id))
    locked = _send(conn, op_id, terms)
    assert locked.taken
    assert locked.moved is None
    assert _holds_lock(conn, op_id)
    after = reload(engine, op_id)
    assert (after.state, after.attempts, after.updated_at) == (
        before.state,
        before.attempts,
        before.updated_at,
    )
    assert len(events_of(engine, op_id)) == events_before


@pytest.mark.parametrize("state", [State.SENT, State.UNKNOWN, State.CONFIRMED])
def test_a_row_not_planned_is_not_moved(engine: Engine, conn: Connection, state: State) -> None:
    _refused(engine, conn, make_operation(engine, state).id)


def test_a_row_not_due_is_not_moved(engine: Engine, conn: Connection) -> None:
    op = make_operation(engine)
    age(engine, op.id, -60, "available_at")
    _refused(engine, conn, op.id)


def test_a_replay_past_its_deadline_is_not_moved(engine: Engine, conn: Connection) -> None:
    op = make_operation(engine)
    with engine.begin() as admin:
        admin.execute(
            text(
                "UPDATE outbox.operations SET replay_deadline = now() - interval '1 s' "
                "WHERE id = :id"
            ),
            {"id": op.id},
        )
    _refused(engine, conn, op.id)


def test_a_tool_outside_the_terms_is_not_moved(engine: Engine, conn: Connection) -> None:
    op = make_operation(engine, tool="deploy.unregistered")
    _refused(engine, conn, op.id)
    other = make_operation(engine)
    _refused(engine, conn, other.id, SendTerms(("deploy.delete_release",), (3,), (False,)))


def test_max_attempts_counts_from_the_budget_base(engine: Engine, conn: Connection) -> None:
    op = make_operation(engine)
    for attempt in (1, 2, 3):  # three attempts, each provably not delivered
        assert _send(conn, op.id).moved is not None
        back = transitions.replan(
            op.id,
            from_state=State.SENT,
            actor=Actor.DISPATCHER,
            attempt=attempt,
            reason="not delivered",
            last_error="not delivered",
        )
        assert isinstance(transitions.apply_and_commit(conn, back), transitions.Moved)
    _refused(engine, conn, op.id)  # 3 of 3 used
    with engine.begin() as admin:  # as an operator's replay: a fresh budget from attempt 3
        admin.execute(
            text("UPDATE outbox.operations SET attempt_budget_base = 3 WHERE id = :id"),
            {"id": op.id},
        )
    locked = _send(conn, op.id)
    assert locked.moved is not None
    assert locked.moved.operation.attempts == 4


def test_a_tool_requiring_approval_moves_only_an_approved_first_attempt(
    engine: Engine, conn: Connection
) -> None:
    needs_approval = SendTerms((TOOL,), (3,), (True,))
    op = make_operation(engine)  # enqueued before the tool's policy said so: not approved
    _refused(engine, conn, op.id, needs_approval)
    approved = make_operation(engine)
    with engine.begin() as admin:
        admin.execute(
            text(
                "UPDATE outbox.operations SET approved_payload_hash = payload_hash, "
                "decided_by = 'an approver', decided_at = now() WHERE id = :id"
            ),
            {"id": approved.id},
        )
    assert _send(conn, approved.id, needs_approval).moved is not None


def test_another_holder_s_lock_means_nothing_is_read_or_moved(
    engine: Engine, conn: Connection
) -> None:
    """The lock is a one-time filter before the row: with it busy, the row is not even
    asked for (a transaction holding the row would otherwise make the statement fail)."""
    op = make_operation(engine)
    with engine.connect() as holder, engine.connect() as row_holder:
        assert sql.locks.try_lock(holder, operation_lock_key(op.id))
        holder.commit()
        row_holder.execute(
            text("SELECT 1 FROM outbox.operations WHERE id = :id FOR UPDATE"), {"id": op.id}
        )
        locked = _send(conn, op.id)
        row_holder.rollback()
        sql.locks.unlock_all(holder)
        holder.commit()
    assert (locked.taken, locked.moved) == (False, None)
    assert not _holds_lock(conn, op.id)
    assert reload(engine, op.id).state is State.PLANNED


def test_a_row_held_by_another_transaction_fails_at_once_with_the_lock_kept(
    engine: Engine, conn: Connection
) -> None:
    """A relay's claim not yet committed: the statement does not wait (the send deadline
    runs from its start); it fails, nothing written, and the lock it took stays held for
    the dispatcher, which waits for the row outside the attempt."""
    op = make_operation(engine)
    with engine.connect() as row_holder:
        row_holder.execute(
            text("SELECT 1 FROM outbox.operations WHERE id = :id FOR UPDATE"), {"id": op.id}
        )
        started = time.monotonic()
        with pytest.raises(DBAPIError) as failed:
            _send(conn, op.id)
        assert time.monotonic() - started < 2
        assert sql.locks.is_row_lock_busy(failed.value)
        row_holder.rollback()
    conn.rollback()
    assert _holds_lock(conn, op.id)
    assert reload(engine, op.id).state is State.PLANNED


def test_unlock_first_releases_the_previous_operation_s_lock(
    engine: Engine, conn: Connection
) -> None:
    first, second = make_operation(engine), make_operation(engine)
    assert _send(conn, first.id).moved is not None
    assert _holds_lock(conn, first.id)
    assert _send(conn, second.id, unlock_first=True).moved is not None
    assert not _holds_lock(conn, first.id)
    assert _holds_lock(conn, second.id)


def test_it_refuses_a_connection_in_a_transaction(engine: Engine) -> None:
    op = make_operation(engine)
    with engine.connect() as plain, pytest.raises(ValueError, match="AUTOCOMMIT"):
        _send(plain, op.id)
    assert reload(engine, op.id).state is State.PLANNED


def test_a_move_committed_after_the_statement_began_is_tested_at_its_newest_version(
    engine: Engine,
) -> None:
    """The statement's snapshot is older than its lock (taken in the statement): a move the
    lock's previous holder committed in between is not in that snapshot. The compare-and-set
    still tests the newest version (READ COMMITTED re-reads a row updated since, and checks
    the conditions again), so a row cancelled meanwhile is not sent. The CTE stands for the
    lock, and takes a second."""
    op = make_operation(engine)
    with cancelled_meanwhile(engine, op.id), engine.begin() as conn:
        moved = conn.execute(
            text(
                "WITH lk AS MATERIALIZED (SELECT true AS taken FROM pg_sleep(1)) "
                "UPDATE outbox.operations SET updated_at = statement_timestamp() "
                "WHERE (SELECT taken FROM lk) AND id = :id AND state = 'planned' "
                "RETURNING id"
            ),
            {"id": op.id},
        ).all()
    assert moved == []
    assert reload(engine, op.id).state is State.CANCELLED


# --- the dispatcher ---------------------------------------------------------------------------


@pytest.fixture
def registry() -> ToolRegistry:
    return ToolRegistry(ContractTable())


@pytest.fixture
def remote(registry: ToolRegistry) -> Remote:
    target = Remote()
    tool(TOOL, timeout=2, send_deadline=2, inflight_horizon=60, max_attempts=3, registry=registry)(
        target
    )
    return target


def _found_at_lock(engine: Engine, op_id: UUID, terms: SendTerms | None) -> Any:
    with DispatchLocks(engine) as locks, locks.lock(op_id, send=terms) as locked:
        assert locked is not None
        return locked[1]


def test_the_dispatcher_s_lock_step_sends_an_unguarded_tool_s_operation(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    op = make_operation(engine)
    found = _found_at_lock(engine, op.id, TERMS)
    assert isinstance(found, SentAtLock)
    assert found.operation.state is State.SENT
    assert reload(engine, op.id).state is State.SENT


def test_a_refused_check_leaves_the_row_read_with_the_lock_held(engine: Engine) -> None:
    op = make_operation(engine)
    age(engine, op.id, -60, "available_at")
    with DispatchLocks(engine) as locks, locks.lock(op.id, send=TERMS) as locked:
        assert locked is not None
        conn, found = locked
        assert isinstance(found, sql.locks.DispatchView)
        assert (found.operation.state, found.due) == (State.PLANNED, False)
        assert _holds_lock(conn, op.id)
    with engine.connect() as other:  # released with the block
        assert sql.locks.try_lock(other, operation_lock_key(op.id))
        sql.locks.unlock_all(other)
        other.commit()


def test_a_dispatch_is_one_statement_to_sent_and_calls_once(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    op = make_operation(engine)
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.CONFIRMED
    assert len(remote.calls) == 1
    assert [(e.from_state, e.to_state) for e in events_of(engine, op.id)][-2:] == [
        (State.PLANNED, State.SENT),
        (State.SENT, State.CONFIRMED),
    ]
    assert remote.calls[0].attempt == 1


def test_a_tampered_payload_found_after_the_sent_commit_is_never_sent(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """The payload's hash is computed in Python: it is checked after the lock step's `sent`
    commit, before any byte leaves. A row that fails goes back to `planned` with the
    evidence that this attempt never left, then to a person."""
    op = make_operation(engine, payload={"version": "1.0.0"})
    tamper(engine, op.id, """payload = '{"version": "6.6.6"}'""")
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.NEEDS_HUMAN
    assert remote.calls == []
    trail = [(e.from_state, e.to_state, e.actor) for e in events_of(engine, op.id)][-3:]
    assert trail == [
        (State.PLANNED, State.SENT, Actor.DISPATCHER),
        (State.SENT, State.PLANNED, Actor.DISPATCHER),
        (State.PLANNED, State.NEEDS_HUMAN, Actor.DISPATCHER),
    ]
    events = events_of(engine, op.id)
    assert events[-2].reason.startswith("not sent: the stored payload no longer matches")
    done = reload(engine, op.id)
    assert done.state is State.NEEDS_HUMAN
    assert not done.maybe_applied  # never sent: nothing may have applied


def test_a_guarded_tool_and_the_switch_off_take_the_two_statement_path(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    tool(
        "deploy.rate_limited",
        timeout=2,
        send_deadline=2,
        inflight_horizon=60,
        max_attempts=3,
        rate=Rate(per_second=100),
        registry=registry,
    )(remote)
    guarded = make_operation(engine, tool="deploy.rate_limited")
    plain = make_operation(engine)
    reports = [
        dispatch(guarded.id, engine=engine, registry=registry),
        dispatch(
            plain.id, engine=engine, registry=registry, config=DispatchConfig(send_at_lock=False)
        ),
    ]
    assert [r.outcome for r in reports] == [Outcome.CONFIRMED, Outcome.CONFIRMED]
    assert len(remote.calls) == 2


def test_a_tool_whose_attempt_would_not_fit_the_message_is_deferred_unwritten(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    op = make_operation(engine)
    report = dispatch(op.id, engine=engine, registry=registry, finish_by=time.monotonic() + 1)
    assert report.outcome is Outcome.DEFERRED
    assert reload(engine, op.id).state is State.PLANNED
    assert remote.calls == []
