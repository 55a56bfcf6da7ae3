"""Operations in any state, built through the real state machine so every column agrees."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from uuid import UUID

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api, sql, transitions
from outbox.models import Event, Executor, Operation
from outbox.states import Actor, State

_counter = itertools.count()

# The real moves that lead from `planned` to each state.
_PATHS: dict[State, list[tuple[State, State, Actor, dict[str, Any]]]] = {
    State.PLANNED: [],
    State.SENT: [(State.PLANNED, State.SENT, Actor.DISPATCHER, {})],
    State.CONFIRMED: [
        (State.PLANNED, State.SENT, Actor.DISPATCHER, {}),
        (State.SENT, State.CONFIRMED, Actor.DISPATCHER, {"remote_ref": "rel-1"}),
    ],
    State.FAILED: [
        (State.PLANNED, State.SENT, Actor.DISPATCHER, {}),
        (State.SENT, State.FAILED, Actor.DISPATCHER, {"last_error": "422 refused"}),
    ],
    State.UNKNOWN: [
        (State.PLANNED, State.SENT, Actor.DISPATCHER, {}),
        (State.SENT, State.UNKNOWN, Actor.DISPATCHER, {"last_error": "read timeout"}),
    ],
    State.NEEDS_HUMAN: [
        (State.PLANNED, State.SENT, Actor.DISPATCHER, {}),
        (State.SENT, State.UNKNOWN, Actor.DISPATCHER, {"last_error": "read timeout"}),
        (State.UNKNOWN, State.NEEDS_HUMAN, Actor.RECONCILER, {}),
    ],
    State.CANCELLED: [(State.PLANNED, State.CANCELLED, Actor.AGENT, {})],
    # Enqueued so (require_approval=True): no move leads there from `planned` but the
    # dispatcher's re-check.
    State.AWAITING_APPROVAL: [],
}


def make_operation(
    engine: Engine,
    state: State = State.PLANNED,
    *,
    tool: str = "deploy.create_release",
    target: str = "project-a",
    payload: dict[str, Any] | None = None,
    intent_key: str | None = None,
    agent: str | None = None,
) -> Operation:
    """A committed operation in ``state``, reached by the moves a real run would make."""
    with Session(engine) as session, session.begin():
        op = api.enqueue(
            session,
            tool=tool,
            target=target,
            payload=payload if payload is not None else {"n": next(_counter)},
            intent_key=intent_key,
            require_approval=state is State.AWAITING_APPROVAL,
            agent=agent,
        )
        for from_state, to_state, actor, columns in _PATHS[state]:
            op = apply_move(
                session,
                op.id,
                from_state=from_state,
                to_state=to_state,
                actor=actor,
                reason="factory",
                **columns,
            )
    return op


def age(engine: Engine, operation_id: UUID, seconds: float, *columns: str) -> None:
    """Move the given timestamp columns of one operation ``seconds`` into the past."""
    assignments = ", ".join(
        f"{column} = {column} - make_interval(secs => :s)" for column in columns
    )
    with engine.begin() as conn:
        conn.execute(
            text(f"UPDATE outbox.operations SET {assignments} WHERE id = :id"),
            {"s": seconds, "id": operation_id},
        )


def tamper(engine: Engine, operation_id: UUID, assignments: str, **params: Any) -> None:
    """Change an operation's immutable columns as someone with DDL rights could: the trigger
    that refuses it (migration 0010) disabled for this one transaction, then enabled again."""
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE outbox.operations DISABLE TRIGGER operations_immutable"))
        conn.execute(
            text(f"UPDATE outbox.operations SET {assignments} WHERE id = :id"),
            {"id": operation_id, **params},
        )
        conn.execute(text("ALTER TABLE outbox.operations ENABLE TRIGGER operations_immutable"))


def event_count(engine: Engine, operation_id: UUID | None = None) -> int:
    """How many audit rows exist (for one operation, or in all)."""
    query = "SELECT count(*) FROM outbox.events"
    params: dict[str, Any] = {}
    if operation_id is not None:
        query += " WHERE operation_id = :id"
        params["id"] = operation_id
    with engine.connect() as conn:
        return int(conn.execute(text(query), params).scalar_one())


def move(
    engine: Engine,
    operation: Operation,
    to_state: State,
    actor: Actor,
    *,
    reason: str = "test",
    **columns: Any,
) -> Operation:
    """Commit one real transition of ``operation`` from the state it was read in, writing
    ``columns`` (those of :class:`outbox.transitions.Move` the move takes)."""
    with Session(engine) as session, session.begin():
        return apply_move(
            session,
            operation.id,
            from_state=operation.state,
            to_state=to_state,
            actor=actor,
            reason=reason,
            attempt=operation.attempts,
            **columns,
        )


def reload(engine: Engine, operation_id: UUID) -> Operation:
    """The committed row of one operation, read on a fresh connection."""
    with engine.connect() as conn:
        found = api.get(conn, operation_id)
    assert found is not None, f"operation {operation_id} vanished"
    return found


def events_of(engine: Engine, operation_id: UUID) -> list[Event]:
    """One operation's committed audit trail, oldest first."""
    with engine.connect() as conn:
        return sql.intents.list_events(conn, operation_id)


def operation_count(engine: Engine) -> int:
    """How many operations are committed."""
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM outbox.operations")).scalar_one())


def mark_published(engine: Engine, operation_id: UUID) -> None:
    """Stamp ``published_at`` as the relay does when it hands a planned row to the broker."""
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox.operations SET published_at = clock_timestamp() WHERE id = :id"),
            {"id": operation_id},
        )


@contextmanager
def poisoned_updates(engine: Engine, when: str) -> Iterator[None]:
    """While the block runs, any update that leaves an operation row matching ``when`` (an SQL
    condition on ``NEW``) raises "poisoned row": a write that fails for a reason of its own,
    as a broken row, a CHECK or a too-long value would."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE OR REPLACE FUNCTION public.outbox_test_poison() RETURNS trigger "
                "LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'poisoned row'; END $$"
            )
        )
        conn.execute(
            text(
                "CREATE TRIGGER outbox_test_poison BEFORE UPDATE ON outbox.operations "
                f"FOR EACH ROW WHEN ({when}) EXECUTE FUNCTION public.outbox_test_poison()"
            )
        )
    try:
        yield
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TRIGGER outbox_test_poison ON outbox.operations"))
            conn.execute(text("DROP FUNCTION public.outbox_test_poison()"))


def apply_move(
    executor: Executor,
    operation_id: UUID,
    *,
    from_state: State,
    to_state: State,
    actor: Actor,
    reason: str,
    attempt: int | None = None,
    detail: Mapping[str, Any] | None = None,
    **columns: Any,
) -> Operation:
    """Make any move, named by its states, in the caller's transaction (as the named functions
    of :mod:`outbox.transitions` do; a column the move does not take raises ``ValueError``)."""
    move = transitions.Move(
        operation_id=operation_id,
        from_state=from_state,
        to_state=to_state,
        actor=actor,
        reason=reason,
        attempt=attempt,
        detail=detail,
        **columns,
    )
    return transitions.apply(executor, move).operation


@contextmanager
def cancelled_meanwhile(
    engine: Engine, operation_id: UUID, *, after_s: float = 0.5
) -> Iterator[None]:
    """Inside the block, another thread cancels the ``planned`` operation (the agent's move,
    committed) ``after_s`` seconds in: for a statement that runs longer than that."""

    def cancel_later() -> None:
        time.sleep(after_s)
        with Session(engine) as session, session.begin():
            apply_move(
                session,
                operation_id,
                from_state=State.PLANNED,
                to_state=State.CANCELLED,
                actor=Actor.AGENT,
                reason="cancelled while the statement ran",
            )

    mover = threading.Thread(target=cancel_later)
    mover.start()
    try:
        yield
    finally:
        mover.join()
