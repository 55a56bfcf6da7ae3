"""The console overview's "decided per second" (:func:`outbox.sql.console.decided_rate`) on a
real database: what counts as decided, over which window, and when the count is a floor."""

from __future__ import annotations

from uuid import UUID

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import approval, transitions
from outbox.resolve import resolve
from outbox.sql.console import DecidedRate, decided_rate
from outbox.states import Actor, State
from tests.factories import make_operation

WINDOW_S = 300.0


def rate(engine: Engine, *, max_events: int = 100_000) -> DecidedRate:
    """The decided rate over WINDOW_S, read on a fresh connection."""
    with engine.connect() as conn:
        return decided_rate(conn, window_s=WINDOW_S, max_events=max_events)


def backdate_events(engine: Engine, operation_id: UUID, seconds: float) -> None:
    """Move one operation's events ``seconds`` into the past, as someone with DDL rights could:
    the append-only trigger disabled for this one transaction, then enabled again."""
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE outbox.events DISABLE TRIGGER events_append_only"))
        conn.execute(
            text(
                "UPDATE outbox.events SET at = at - make_interval(secs => :s)"
                " WHERE operation_id = :id"
            ),
            {"s": seconds, "id": operation_id},
        )
        conn.execute(text("ALTER TABLE outbox.events ENABLE TRIGGER events_append_only"))


def test_operations_decided_in_the_window_count_once_each(engine: Engine) -> None:
    """Operations that reached confirmed, failed or cancelled in the window count once each,
    whoever decided them; live operations, a late outcome noted on a decided one, and
    decisions older than the window do not."""
    assert rate(engine) == DecidedRate(decided=0, window_s=WINDOW_S, capped=False)
    confirmed = make_operation(engine, State.CONFIRMED)  # by the dispatcher
    make_operation(engine, State.FAILED)
    make_operation(engine, State.CANCELLED)  # by its agent
    rejected = make_operation(engine, State.AWAITING_APPROVAL)
    stuck = make_operation(engine, State.NEEDS_HUMAN)
    with Session(engine) as session, session.begin():
        approval.reject(session, rejected.id, by="alice", reason="wrong project")
        resolve(session, stuck.id, applied=True, remote_ref="rel-9", by="alice", note="found it")
    for state in (State.PLANNED, State.SENT, State.UNKNOWN, State.NEEDS_HUMAN):
        make_operation(engine, state)
    make_operation(engine, State.AWAITING_APPROVAL)
    with Session(engine) as session, session.begin():
        transitions.note(
            session,
            confirmed.id,
            state=State.CONFIRMED,
            attempt=confirmed.attempts,
            actor=Actor.EVIDENCE,
            reason="late outcome of attempt 1: applied",
        )
    old = make_operation(engine, State.CANCELLED)
    backdate_events(engine, old.id, WINDOW_S + 60)
    found = rate(engine)
    assert found == DecidedRate(decided=5, window_s=WINDOW_S, capped=False)
    assert found.per_second == 5 / WINDOW_S


def test_a_window_holding_more_events_than_it_scans_is_a_floor(engine: Engine) -> None:
    """When every event scanned lies inside the window, more may lie beyond the scan: the
    count is over the newest ``max_events`` events and marked capped (at least)."""
    for _ in range(3):
        make_operation(engine, State.CANCELLED)  # two events each: planned, then cancelled
    assert rate(engine, max_events=4) == DecidedRate(decided=2, window_s=WINDOW_S, capped=True)
    assert rate(engine, max_events=7) == DecidedRate(decided=3, window_s=WINDOW_S, capped=False)
