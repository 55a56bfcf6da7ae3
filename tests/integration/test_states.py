"""The state machine on real rows: allowed moves, refusals, CAS, fencing and the schema's checks."""

from __future__ import annotations

import importlib
import itertools
import threading
import time
from collections.abc import Iterable
from typing import Any
from uuid import UUID

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session

from outbox import api, sql
from outbox.errors import (
    NotCancellable,
    OperationNotFound,
    ReplayDeadlinePassed,
    StaleTransition,
    TransitionNotAllowed,
)
from outbox.models import Operation
from outbox.states import ALLOWED, TERMINAL_STATES, Actor, State
from tests.factories import (
    age,
    apply_move,
    event_count,
    events_of,
    make_operation,
    mark_published,
    move,
    reload,
)

ALLOWED_MOVES = [
    pytest.param(from_state, to_state, actor, id=f"{from_state}->{to_state}-by-{actor}")
    for (from_state, to_state), actors in ALLOWED.items()
    for actor in sorted(actors)
]
REFUSED_PAIRS = [
    pytest.param(from_state, to_state, id=f"{from_state}->{to_state}")
    for from_state, to_state in itertools.product(State, State)
    if {actor for actor in Actor if actor not in ALLOWED.get((from_state, to_state), ())}
]


def columns_for(to_state: State, op: Operation | None = None) -> dict[str, Any]:
    """The columns a real caller passes for a move into ``to_state`` (of ``op``, whose
    approval needs its payload hash)."""
    if to_state is State.CONFIRMED:
        return {"remote_ref": "ref-42"}
    if to_state is State.AWAITING_APPROVAL:
        return {"approval_ttl_s": 60.0}
    if op is not None and op.state is State.AWAITING_APPROVAL and to_state is State.PLANNED:
        return {"decided_by": "alice", "approved_payload_hash": op.payload_hash}
    return {}


def commit_transition(engine: Engine, operation_id: UUID, **arguments: Any) -> Operation:
    """Run one transition in its own committed transaction."""
    with Session(engine) as session, session.begin():
        return apply_move(session, operation_id, **arguments)


def assert_nothing_written(engine: Engine, before: Operation, events_before: int) -> None:
    """The row is exactly as it was and no event was appended."""
    assert reload(engine, before.id) == before
    assert event_count(engine, before.id) == events_before


@pytest.mark.parametrize(("from_state", "to_state", "actor"), ALLOWED_MOVES)
def test_allowed_move_succeeds_and_appends_one_event(
    engine: Engine, from_state: State, to_state: State, actor: Actor
) -> None:
    """An allowed move changes the state and appends one event naming from, to, actor and reason."""
    op = make_operation(engine, from_state)
    if from_state is State.AWAITING_APPROVAL and actor is Actor.SWEEP:
        age(engine, op.id, 86400 + 1, "approval_expires_at")  # the sweep cancels only past it
    events_before = events_of(engine, op.id)

    moved = commit_transition(
        engine,
        op.id,
        from_state=from_state,
        to_state=to_state,
        actor=actor,
        reason="because the test says so",
        attempt=op.attempts,
        **columns_for(to_state, op),
        detail={"step": 1},
    )

    assert moved.state is to_state
    assert reload(engine, op.id) == moved
    events = events_of(engine, op.id)
    assert events[: len(events_before)] == events_before
    assert len(events) == len(events_before) + 1
    event = events[-1]
    assert (event.from_state, event.to_state) == (from_state, to_state)
    assert event.actor == actor.value
    assert event.reason == "because the test says so"
    assert event.detail == {"step": 1}
    assert event.attempt == moved.attempts
    assert (moved.resolved_at is not None) == (to_state in TERMINAL_STATES)
    if to_state is State.CONFIRMED:
        assert moved.remote_ref == "ref-42"


@pytest.mark.parametrize(("from_state", "to_state"), REFUSED_PAIRS)
def test_refused_move_raises_and_writes_nothing(
    engine: Engine, from_state: State, to_state: State
) -> None:
    """Each actor the table does not allow for a move gets TransitionNotAllowed; nothing changes."""
    op = make_operation(engine, from_state)
    events_before = event_count(engine, op.id)
    refused = [actor for actor in Actor if actor not in ALLOWED.get((from_state, to_state), ())]

    for actor in refused:
        with pytest.raises(TransitionNotAllowed) as caught:
            commit_transition(
                engine,
                op.id,
                from_state=from_state,
                to_state=to_state,
                actor=actor,
                reason="not allowed",
                **columns_for(to_state, op),
            )
        assert (caught.value.from_state, caught.value.to_state, caught.value.actor) == (
            from_state,
            to_state,
            actor,
        )

    assert_nothing_written(engine, op, events_before)


def test_every_pair_and_actor_is_covered() -> None:
    """The two parametrisations above cover all State x State x Actor combinations."""
    allowed = sum(len(actors) for actors in ALLOWED.values())
    assert len(ALLOWED_MOVES) == allowed
    assert allowed + sum(
        len([a for a in Actor if a not in ALLOWED.get(pair, ())])
        for pair in itertools.product(State, State)
    ) == len(State) ** 2 * len(Actor)


@pytest.mark.parametrize("from_state", [State.SENT, State.UNKNOWN, State.NEEDS_HUMAN])
def test_confirm_without_remote_ref_is_refused(engine: Engine, from_state: State) -> None:
    """Entering confirmed without a remote_ref is refused before touching the row."""
    op = make_operation(engine, from_state)
    events_before = event_count(engine, op.id)
    actor = Actor.DISPATCHER if from_state is State.SENT else Actor.OPERATOR
    for columns in ({}, {"remote_ref": ""}):
        with pytest.raises(TransitionNotAllowed, match="remote_ref"):
            commit_transition(
                engine,
                op.id,
                from_state=from_state,
                to_state=State.CONFIRMED,
                actor=actor,
                reason="no ref",
                **columns,
            )
    assert_nothing_written(engine, op, events_before)


def test_stale_from_state_raises_and_writes_nothing(engine: Engine) -> None:
    """A CAS from a state the row is no longer in raises StaleTransition and writes nothing."""
    op = make_operation(engine, State.PLANNED)
    events_before = event_count(engine, op.id)
    with pytest.raises(StaleTransition) as caught:
        commit_transition(
            engine,
            op.id,
            from_state=State.SENT,
            to_state=State.UNKNOWN,
            actor=Actor.SWEEP,
            reason="lost",
        )
    assert not isinstance(caught.value, ReplayDeadlinePassed)
    assert caught.value.expected == (State.SENT, None)
    assert caught.value.actual == (State.PLANNED, 0)
    assert_nothing_written(engine, op, events_before)


def test_write_about_an_older_attempt_is_fenced(engine: Engine) -> None:
    """An outcome for attempt k on a row now at attempt k+1 raises StaleTransition, no write."""
    first = make_operation(engine, State.SENT)
    back = move(engine, first, State.PLANNED, Actor.DISPATCHER)
    second = move(engine, back, State.SENT, Actor.DISPATCHER)
    assert (first.attempts, second.attempts) == (1, 2)
    events_before = event_count(engine, second.id)

    with pytest.raises(StaleTransition) as caught:
        commit_transition(
            engine,
            first.id,
            from_state=State.SENT,
            to_state=State.CONFIRMED,
            actor=Actor.DISPATCHER,
            reason="late outcome of attempt 1",
            attempt=1,
            remote_ref="ref-1",
        )
    assert caught.value.expected == (State.SENT, 1)
    assert caught.value.actual == (State.SENT, 2)
    assert_nothing_written(engine, second, events_before)


def test_unknown_operation_id_raises_not_found(engine: Engine) -> None:
    """A transition of an id that does not exist raises OperationNotFound."""
    with pytest.raises(OperationNotFound):
        commit_transition(
            engine,
            UUID("00000000-0000-7000-8000-000000000000"),
            from_state=State.PLANNED,
            to_state=State.SENT,
            actor=Actor.DISPATCHER,
            reason="ghost",
        )
    assert event_count(engine) == 0


def test_send_counts_attempts_and_keeps_first_sent_at(engine: Engine) -> None:
    """planned->sent increments attempts and sets sent_at; first_sent_at is kept on a retry."""
    planned = make_operation(engine, State.PLANNED)
    assert (planned.attempts, planned.sent_at, planned.first_sent_at) == (0, None, None)

    first = move(engine, planned, State.SENT, Actor.DISPATCHER)
    assert first.attempts == 1
    assert first.sent_at is not None
    assert first.first_sent_at == first.sent_at

    back = move(engine, first, State.PLANNED, Actor.DISPATCHER)
    second = move(engine, back, State.SENT, Actor.DISPATCHER)
    assert second.attempts == 2
    assert second.first_sent_at == first.first_sent_at
    assert second.sent_at is not None
    assert second.sent_at > first.sent_at
    assert [event.attempt for event in events_of(engine, planned.id)] == [0, 1, 1, 2]


def test_replay_inside_its_deadline_leaves(engine: Engine) -> None:
    """A dedup replay planned with a window still open may be sent again."""
    unknown = make_operation(engine, State.UNKNOWN)
    replay = move(engine, unknown, State.PLANNED, Actor.RECONCILER, replay_window_s=600)
    assert replay.first_sent_at is not None
    assert replay.replay_deadline is not None
    assert (replay.replay_deadline - replay.first_sent_at).total_seconds() == 600
    sent = move(engine, replay, State.SENT, Actor.DISPATCHER)
    assert sent.attempts == 2


def test_replay_after_its_deadline_is_refused(engine: Engine) -> None:
    """planned->sent raises ReplayDeadlinePassed once the replay deadline is past; no write."""
    unknown = make_operation(engine, State.UNKNOWN)
    age(engine, unknown.id, 3600, "first_sent_at")
    replay = move(
        engine,
        reload(engine, unknown.id),
        State.PLANNED,
        Actor.RECONCILER,
        replay_window_s=60,
    )
    events_before = event_count(engine, replay.id)

    with pytest.raises(ReplayDeadlinePassed) as caught:
        move(engine, replay, State.SENT, Actor.DISPATCHER)
    assert isinstance(caught.value, StaleTransition)
    assert caught.value.operation_id == replay.id
    assert_nothing_written(engine, replay, events_before)


def test_undelivered_replay_keeps_its_deadline(engine: Engine) -> None:
    """sent->planned (the replay never left) keeps the replay deadline for the next attempt."""
    unknown = make_operation(engine, State.UNKNOWN)
    replay = move(engine, unknown, State.PLANNED, Actor.RECONCILER, replay_window_s=60)
    sent = move(engine, replay, State.SENT, Actor.DISPATCHER)
    back = move(engine, sent, State.PLANNED, Actor.DISPATCHER, reason="send deadline missed")
    assert back.replay_deadline is not None
    assert back.replay_deadline == replay.replay_deadline


def test_undelivered_replay_cannot_leave_after_its_deadline(engine: Engine) -> None:
    """A replay that missed its send deadline is refused once the dedup window has closed."""
    unknown = make_operation(engine, State.UNKNOWN)
    replay = move(engine, unknown, State.PLANNED, Actor.RECONCILER, replay_window_s=60)
    sent = move(engine, replay, State.SENT, Actor.DISPATCHER)
    back = move(engine, sent, State.PLANNED, Actor.DISPATCHER, reason="send deadline missed")
    age(engine, back.id, 3600, "replay_deadline")
    aged = reload(engine, back.id)
    events_before = event_count(engine, back.id)
    with pytest.raises(ReplayDeadlinePassed):
        move(engine, aged, State.SENT, Actor.DISPATCHER)
    assert_nothing_written(engine, aged, events_before)


@pytest.mark.parametrize(
    ("from_state", "actor"),
    [
        (State.UNKNOWN, Actor.RECONCILER),
        (State.UNKNOWN, Actor.OPERATOR),
        (State.NEEDS_HUMAN, Actor.OPERATOR),
    ],
)
def test_a_new_decision_to_plan_replaces_the_deadline(
    engine: Engine, from_state: State, actor: Actor
) -> None:
    """A reconciler's or operator's move to planned without a window clears an old deadline."""
    unknown = make_operation(engine, State.UNKNOWN)
    replay = move(engine, unknown, State.PLANNED, Actor.RECONCILER, replay_window_s=60)
    sent = move(engine, replay, State.SENT, Actor.DISPATCHER)
    doubtful = move(engine, sent, State.UNKNOWN, Actor.SWEEP)
    if from_state is State.NEEDS_HUMAN:
        doubtful = move(engine, doubtful, State.NEEDS_HUMAN, Actor.RECONCILER)
    assert doubtful.replay_deadline is not None
    again = move(engine, doubtful, State.PLANNED, actor, not_applied=True)
    assert again.replay_deadline is None


@pytest.mark.parametrize(
    ("from_state", "to_state", "actor"),
    [
        (State.SENT, State.UNKNOWN, Actor.DISPATCHER),
        (State.SENT, State.UNKNOWN, Actor.SWEEP),
        (State.SENT, State.NEEDS_HUMAN, Actor.SWEEP),
        (State.UNKNOWN, State.NEEDS_HUMAN, Actor.RECONCILER),
    ],
)
def test_doubt_about_an_attempt_sets_maybe_applied(
    engine: Engine, from_state: State, to_state: State, actor: Actor
) -> None:
    """Moving an attempt into unknown or needs_human sets maybe_applied."""
    op = make_operation(engine, State.SENT)
    if from_state is State.UNKNOWN:
        # An unknown row whose flag was cleared, so the move itself must set it again.
        op = move(engine, op, State.UNKNOWN, Actor.SWEEP)
        with engine.begin() as conn:
            conn.execute(
                text("UPDATE outbox.operations SET maybe_applied = false WHERE id = :id"),
                {"id": op.id},
            )
        op = reload(engine, op.id)
    assert op.maybe_applied is False
    assert move(engine, op, to_state, actor).maybe_applied is True


def test_planned_to_needs_human_does_not_set_maybe_applied(engine: Engine) -> None:
    """A planned row that cannot be dispatched goes to a human without maybe_applied."""
    op = make_operation(engine, State.PLANNED)
    assert move(engine, op, State.NEEDS_HUMAN, Actor.RELAY).maybe_applied is False


def test_undelivered_attempt_leaves_maybe_applied_as_it_was(engine: Engine) -> None:
    """sent->planned (provably not delivered) keeps maybe_applied from the earlier attempt."""
    replay = move(engine, make_operation(engine, State.UNKNOWN), State.PLANNED, Actor.RECONCILER)
    assert replay.maybe_applied is True
    sent = move(engine, replay, State.SENT, Actor.DISPATCHER)
    assert move(engine, sent, State.PLANNED, Actor.DISPATCHER).maybe_applied is True


def test_authoritative_not_applied_clears_maybe_applied(engine: Engine) -> None:
    """A replay planned on an authoritative "not applied" clears maybe_applied."""
    unknown = make_operation(engine, State.UNKNOWN)
    replay = move(engine, unknown, State.PLANNED, Actor.RECONCILER, not_applied=True)
    assert replay.maybe_applied is False


def test_cancel_after_a_doubtful_attempt_is_refused(engine: Engine) -> None:
    """A planned replay whose earlier attempt may have applied raises NotCancellable; no write."""
    unknown = make_operation(engine, State.UNKNOWN)
    replay = move(engine, unknown, State.PLANNED, Actor.RECONCILER)
    assert (replay.state, replay.maybe_applied) == (State.PLANNED, True)
    events_before = event_count(engine, replay.id)

    with pytest.raises(NotCancellable):
        move(engine, replay, State.CANCELLED, Actor.AGENT)
    with Session(engine) as session, session.begin(), pytest.raises(NotCancellable):
        api.cancel(session, replay.id)
    assert_nothing_written(engine, replay, events_before)


@pytest.mark.parametrize(
    ("from_state", "actor"),
    [
        (State.SENT, Actor.DISPATCHER),
        (State.UNKNOWN, Actor.RECONCILER),
        (State.UNKNOWN, Actor.OPERATOR),
        (State.NEEDS_HUMAN, Actor.OPERATOR),
    ],
)
def test_move_to_planned_clears_published_at(
    engine: Engine, from_state: State, actor: Actor
) -> None:
    """A move back to planned clears published_at and makes the row due after its backoff."""
    op = make_operation(engine, from_state)
    mark_published(engine, op.id)
    assert reload(engine, op.id).published_at is not None

    back = move(engine, reload(engine, op.id), State.PLANNED, actor, available_in_s=30)
    assert back.published_at is None
    assert back.next_check_at is None
    assert (back.available_at - back.updated_at).total_seconds() == 30


def test_move_to_unknown_schedules_the_first_check(engine: Engine) -> None:
    """Entering unknown sets next_check_at to the move's time plus check_in_s."""
    op = make_operation(engine, State.SENT)
    unknown = move(engine, op, State.UNKNOWN, Actor.SWEEP, check_in_s=5)
    assert unknown.next_check_at is not None
    assert (unknown.next_check_at - unknown.updated_at).total_seconds() == 5


def test_effects_are_stored(engine: Engine) -> None:
    """remote_ref, result and last_error given with a move are written to the row."""
    op = make_operation(engine, State.SENT)
    confirmed = move(
        engine,
        op,
        State.CONFIRMED,
        Actor.DISPATCHER,
        remote_ref="rel-9",
        result={"id": "rel-9", "ok": True},
    )
    assert (confirmed.remote_ref, confirmed.result) == ("rel-9", {"id": "rel-9", "ok": True})
    refused = move(
        engine,
        make_operation(engine, State.SENT),
        State.FAILED,
        Actor.DISPATCHER,
        last_error="HTTP 422",
        result={"error": "taken"},
    )
    assert (refused.last_error, refused.result) == ("HTTP 422", {"error": "taken"})


def test_transition_does_not_commit(engine: Engine) -> None:
    """apply() joins the caller's transaction: a rollback undoes the move and its event."""
    op = make_operation(engine, State.PLANNED)
    events_before = event_count(engine, op.id)
    with Session(engine) as session:
        moved = apply_move(
            session,
            op.id,
            from_state=State.PLANNED,
            to_state=State.SENT,
            actor=Actor.DISPATCHER,
            reason="rolled back",
        )
        assert moved.state is State.SENT
        assert reload(engine, op.id) == op
        session.rollback()
    assert_nothing_written(engine, op, events_before)


@pytest.mark.parametrize("round_", range(3))
def test_racing_cas_has_exactly_one_winner(engine: Engine, round_: int) -> None:
    """Two dispatchers racing planned->sent: one wins; the other, refused at once while the
    winner's move is open (the `sent` move never waits on a row lock) and tried again, gets
    StaleTransition; one event."""
    op = make_operation(engine, State.PLANNED)
    barrier = threading.Barrier(2)
    outcomes: list[object] = []

    def attempt(session: Session, *, first: bool) -> None:
        with session.begin():
            if first:
                barrier.wait(timeout=10)
            outcomes.append(
                apply_move(
                    session,
                    op.id,
                    from_state=State.PLANNED,
                    to_state=State.SENT,
                    actor=Actor.DISPATCHER,
                    reason=f"race {round_}",
                )
            )

    def dispatch() -> None:
        with Session(engine) as session:
            for tries in range(100):
                try:
                    attempt(session, first=tries == 0)
                except StaleTransition as exc:
                    outcomes.append(exc)
                except DBAPIError as exc:
                    if not sql.locks.is_row_lock_busy(exc):
                        outcomes.append(exc)  # anything else fails the count below
                        return
                    time.sleep(0.05)  # the winner's move is still open: ask again
                    continue
                return

    threads = [threading.Thread(target=dispatch) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    winners = [o for o in outcomes if isinstance(o, Operation)]
    losers = [o for o in outcomes if isinstance(o, StaleTransition)]
    assert (len(winners), len(losers)) == (1, 1), outcomes
    assert losers[0].actual == (State.SENT, 1)
    assert reload(engine, op.id).attempts == 1
    sends = [e for e in events_of(engine, op.id) if e.to_state is State.SENT]
    assert len(sends) == 1


@pytest.mark.parametrize(
    ("state", "assignments", "constraint"),
    [
        ("confirmed", "resolved_at = clock_timestamp()", "ck_operations_confirmed_has_remote_ref"),
        (
            "confirmed",
            "resolved_at = clock_timestamp(), remote_ref = ''",
            "ck_operations_confirmed_has_remote_ref",
        ),
        ("failed", "remote_ref = 'x'", "ck_operations_terminal_iff_resolved"),
        ("sent", "remote_ref = 'x'", "ck_operations_sent_has_attempt"),
        ("planned", "attempts = 1", "ck_operations_sent_times_consistent"),
        (
            "cancelled",
            "resolved_at = clock_timestamp(), maybe_applied = true",
            "ck_operations_cancelled_never_applied",
        ),
        ("bogus", "remote_ref = 'x'", "ck_operations_state_known"),
        ("planned", "checks = -1", "ck_operations_counters_not_negative"),
        ("planned", "payload_hash = 'not-a-hash'", "ck_operations_payload_hash_sha256"),
        ("planned", "target = ''", "ck_operations_target_not_empty"),
        ("planned", "payload_hash = upper(payload_hash)", "ck_operations_payload_hash_sha256"),
        ("planned", "payload_hash = payload_hash || '0'", "ck_operations_payload_hash_sha256"),
        ("planned", "intent_key = ''", "ck_operations_intent_key_length"),
        ("planned", "tool = repeat('t', 129)", "ck_operations_tool_length"),
        ("planned", "attempt_budget_base = 1", "ck_operations_budget_within_attempts"),
    ],
)
def test_check_constraints_reject_impossible_rows(
    engine: Engine, state: str, assignments: str, constraint: str
) -> None:
    """A raw UPDATE that would store an impossible row is refused by the named CHECK constraint."""
    op = make_operation(engine, State.PLANNED)

    with pytest.raises(IntegrityError) as caught, engine.begin() as conn:  # noqa: PT012
        # Some rules are on immutable columns, whose trigger (0010) would refuse first; the
        # CHECK is tested on its own, in a transaction that rolls back.
        conn.execute(text("ALTER TABLE outbox.operations DISABLE TRIGGER operations_immutable"))
        conn.execute(
            text(f"UPDATE outbox.operations SET state = :state, {assignments} WHERE id = :id"),
            {"state": state, "id": op.id},
        )
    error = caught.value.orig
    assert isinstance(error, psycopg.Error)
    assert error.sqlstate == "23514"  # check_violation, as a plain CHECK raises it
    assert error.diag.constraint_name == constraint
    assert (error.diag.schema_name, error.diag.table_name) == ("outbox", "operations")
    assert constraint in str(error)
    assert reload(engine, op.id) == op


def test_invariants_list_every_state() -> None:
    """The invariants function's state lists are the code's (a new state needs a migration)."""
    invariants = importlib.import_module("outbox.migrations.versions.0012_approval")

    def quoted(states: Iterable[State]) -> str:
        return ", ".join(f"'{state.value}'" for state in sorted(states))

    assert quoted(State) == invariants.STATES
    assert quoted(TERMINAL_STATES) == invariants.TERMINAL


def test_events_are_append_only(engine: Engine) -> None:
    """outbox.events rejects UPDATE: the audit trail is never rewritten."""
    op = make_operation(engine, State.SENT)
    before = events_of(engine, op.id)
    with pytest.raises(DBAPIError, match="append-only"), engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox.events SET reason = 'rewritten' WHERE operation_id = :id"),
            {"id": op.id},
        )
    assert events_of(engine, op.id) == before


def test_events_follow_the_row_through_its_life(engine: Engine) -> None:
    """The audit trail of an operation lists every move in order, starting with the enqueue."""
    op = make_operation(engine, State.NEEDS_HUMAN)
    moves = [(e.from_state, e.to_state, e.actor) for e in events_of(engine, op.id)]
    assert moves == [
        (None, State.PLANNED, "agent"),
        (State.PLANNED, State.SENT, "dispatcher"),
        (State.SENT, State.UNKNOWN, "dispatcher"),
        (State.UNKNOWN, State.NEEDS_HUMAN, "reconciler"),
    ]
