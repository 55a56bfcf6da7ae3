"""The dispatch protocol, called as a plain function against a real PostgreSQL and real tools."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

import outbox
from outbox import faults, sql
from outbox.contracts import ContractTable
from outbox.dev.service import DeployService, FaultMode
from outbox.locks import operation_lock_key
from outbox.states import Actor, State
from outbox.tools import (
    Ambiguous,
    Applied,
    DispatchResult,
    NotDelivered,
    Rejected,
    ToolCall,
    ToolRegistry,
    close_thread_loop,
    tool,
)
from outbox.workers.dispatch import DispatchConfig, Outcome, dispatch
from outbox.workers.locking import DispatchLocks
from tests.factories import (
    age,
    apply_move,
    cancelled_meanwhile,
    events_of,
    make_operation,
    reload,
    tamper,
)
from tests.tool_configs import http_registry

TOOL = "deploy.create_release"


class Remote:
    """A Python tool's remote: counts calls and answers what the test says."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.answer: Callable[[ToolCall], DispatchResult] = lambda call: Applied(
            f"ref-{call.operation_id}"
        )
        self.lock = threading.Lock()

    def __call__(self, call: ToolCall) -> DispatchResult:
        with self.lock:
            self.calls.append(call)
        return self.answer(call)


@pytest.fixture
def registry() -> ToolRegistry:
    """A registry of its own, so tests never see each other's tools."""
    return ToolRegistry(ContractTable())


@pytest.fixture
def remote(registry: ToolRegistry) -> Remote:
    """A Python tool named deploy.create_release that records its calls."""
    target = Remote()
    tool(TOOL, timeout=2, send_deadline=2, inflight_horizon=60, max_attempts=3, registry=registry)(
        target
    )
    return target


def test_applied_answer_confirms(engine: Engine, registry: ToolRegistry, remote: Remote) -> None:
    """An applied answer moves planned → sent → confirmed with the remote's ref, in one call."""
    op = make_operation(engine)
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.CONFIRMED
    done = reload(engine, op.id)
    assert done.state is State.CONFIRMED
    assert done.remote_ref == f"ref-{op.id}"
    assert done.attempts == 1
    assert [call.operation_id for call in remote.calls] == [str(op.id)]
    assert remote.calls[0].payload == op.payload
    assert [(e.from_state, e.to_state) for e in events_of(engine, op.id)][1:] == [
        (State.PLANNED, State.SENT),
        (State.SENT, State.CONFIRMED),
    ]


def test_refusal_fails_when_nothing_earlier_may_have_applied(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """A declared refusal on a first attempt is failed, authoritatively."""
    remote.answer = lambda call: Rejected("HTTP 422: bad version")
    op = make_operation(engine)
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.FAILED
    done = reload(engine, op.id)
    assert done.state is State.FAILED
    assert done.last_error == "HTTP 422: bad version"
    assert not done.maybe_applied


def test_refusal_after_an_ambiguous_attempt_is_unknown(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """A refusal after an earlier attempt that may have applied is unknown, not failed."""
    remote.answer = lambda call: Ambiguous("read timeout")
    op = make_operation(engine)
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.UNKNOWN
    with engine.begin() as conn:  # the reconciler schedules a replay (maybe_applied stays set)
        apply_move(
            conn,
            op.id,
            from_state=State.UNKNOWN,
            to_state=State.PLANNED,
            actor=Actor.RECONCILER,
            reason="dedup replay",
            replay_window_s=3600,
        )
    remote.answer = lambda call: Rejected("HTTP 422: key reused")
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.UNKNOWN
    done = reload(engine, op.id)
    assert done.state is State.UNKNOWN
    assert done.attempts == 2
    assert "earlier attempt may have applied" in (done.last_error or "")


def test_ambiguous_answer_is_unknown(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """An ambiguous answer leaves the operation unknown and marks it maybe applied."""
    remote.answer = lambda call: Ambiguous("reset after send")
    op = make_operation(engine)
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.UNKNOWN
    done = reload(engine, op.id)
    assert done.state is State.UNKNOWN
    assert done.maybe_applied
    assert done.next_check_at is not None


def test_not_delivered_goes_back_to_planned_with_backoff(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """A provably undelivered attempt returns to planned, unpublished, due only after a backoff."""
    remote.answer = lambda call: NotDelivered("connection refused")
    op = make_operation(engine)
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.REPLANNED
    back = reload(engine, op.id)
    assert back.state is State.PLANNED
    assert back.attempts == 1
    assert back.published_at is None
    assert not back.maybe_applied
    assert back.available_at > back.updated_at
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.NOT_DUE
    assert len(remote.calls) == 1


def test_duplicate_messages_make_one_call(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """The same operation dispatched five times, one after another, calls the remote once."""
    op = make_operation(engine)
    outcomes = [dispatch(op.id, engine=engine, registry=registry).outcome for _ in range(5)]
    assert outcomes == [Outcome.CONFIRMED] + [Outcome.NOT_PLANNED] * 4
    assert len(remote.calls) == 1


def test_racing_dispatchers_make_one_call(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """Two dispatchers racing one operation (a slow remote) make exactly one call."""

    def slow(call: ToolCall) -> DispatchResult:
        time.sleep(0.3)
        return Applied("ref-slow")

    remote.answer = slow
    op = make_operation(engine)
    barrier = threading.Barrier(4)
    outcomes: list[Outcome] = []

    def racer() -> None:
        barrier.wait()
        outcomes.append(dispatch(op.id, engine=engine, registry=registry).outcome)

    threads = [threading.Thread(target=racer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(remote.calls) == 1
    assert outcomes.count(Outcome.CONFIRMED) == 1
    assert set(outcomes) <= {Outcome.CONFIRMED, Outcome.LOCK_BUSY, Outcome.NOT_PLANNED}


def test_a_message_finding_sent_hands_it_to_the_reconciler(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """A redelivered message that finds the row sent (its dispatcher gone) moves it to unknown."""
    op = make_operation(engine, State.SENT)
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.DISPATCHER_LOST
    lost = reload(engine, op.id)
    assert lost.state is State.UNKNOWN
    assert lost.maybe_applied
    assert remote.calls == []
    assert "dispatcher lost" in events_of(engine, op.id)[-1].reason


def test_a_held_lock_means_hands_off(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """While another component holds the operation's lock, dispatch neither writes nor calls."""
    op = make_operation(engine)
    with engine.connect() as holder:
        assert sql.locks.try_lock(holder, operation_lock_key(op.id))
        holder.commit()
        report = dispatch(op.id, engine=engine, registry=registry)
        sql.locks.unlock_all(holder)
        holder.commit()
    assert report.outcome is Outcome.LOCK_BUSY
    assert reload(engine, op.id).state is State.PLANNED
    assert remote.calls == []


def test_the_lock_is_released_after_an_attempt(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """After dispatch returns, nobody holds the operation's lock."""
    op = make_operation(engine)
    dispatch(op.id, engine=engine, registry=registry)
    with engine.connect() as probe:
        assert sql.locks.lock_holder_pid(probe, operation_lock_key(op.id)) is None


def test_a_failing_sent_commit_is_never_followed_by_a_call(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """If committing `sent` raises, the remote is not called and the row stays planned."""
    op = make_operation(engine)
    with engine.begin() as conn:
        conn.execute(
            text(
                "CREATE OR REPLACE FUNCTION pg_temp.refuse() RETURNS trigger "
                "LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'disk full'; END $$"
            )
        )
        conn.execute(
            text(
                "CREATE TRIGGER refuse_sent BEFORE UPDATE ON outbox.operations FOR EACH ROW "
                "WHEN (NEW.state = 'sent') EXECUTE FUNCTION pg_temp.refuse()"
            )
        )
    try:
        with pytest.raises(DBAPIError, match="disk full"):
            dispatch(op.id, engine=engine, registry=registry)
    finally:
        with engine.begin() as conn:
            conn.execute(text("DROP TRIGGER refuse_sent ON outbox.operations"))
    assert remote.calls == []
    assert reload(engine, op.id).state is State.PLANNED


def test_an_injected_fault_after_the_sent_commit_makes_no_call(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """A dispatcher that dies right after committing `sent` has called nobody; the row says sent."""
    op = make_operation(engine)
    with faults.armed("after_sent_commit", "raise"), pytest.raises(faults.InjectedFault):
        dispatch(op.id, engine=engine, registry=registry)
    assert remote.calls == []
    assert reload(engine, op.id).state is State.SENT


def test_a_send_past_its_deadline_is_not_made(engine: Engine, registry: ToolRegistry) -> None:
    """When the send deadline has passed since the `sent` commit, the call is not made."""
    remote = Remote()
    tool(TOOL, timeout=2, send_deadline=1e-9, inflight_horizon=60, registry=registry)(remote)
    op = make_operation(engine)
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.NOT_SENT
    assert remote.calls == []
    back = reload(engine, op.id)
    assert back.state is State.PLANNED
    assert back.attempts == 1
    assert not back.maybe_applied
    assert "not sent" in events_of(engine, op.id)[-1].reason


def test_an_unknown_tool_goes_to_a_human(engine: Engine, registry: ToolRegistry) -> None:
    """An operation whose tool this worker does not know needs a human, and nothing crashes."""
    op = make_operation(engine, tool="mail.send")
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.NEEDS_HUMAN
    stuck = reload(engine, op.id)
    assert stuck.state is State.NEEDS_HUMAN
    assert "not registered" in events_of(engine, op.id)[-1].reason


def test_max_attempts_stops_a_loop(engine: Engine, registry: ToolRegistry, remote: Remote) -> None:
    """After max_attempts undelivered attempts the operation goes to a human, not round again."""
    remote.answer = lambda call: NotDelivered("connection refused")
    op = make_operation(engine)
    for _ in range(3):
        assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.REPLANNED
        age(engine, op.id, 3600, "available_at")
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.NEEDS_HUMAN
    assert len(remote.calls) == 3
    assert "max_attempts (3)" in events_of(engine, op.id)[-1].reason


def test_a_replay_past_its_deadline_goes_to_a_human(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """A dedup replay whose deadline has passed is not sent; it needs a human."""
    op = make_operation(engine, State.UNKNOWN)
    with engine.begin() as conn:
        apply_move(
            conn,
            op.id,
            from_state=State.UNKNOWN,
            to_state=State.PLANNED,
            actor=Actor.RECONCILER,
            reason="dedup replay",
            replay_window_s=60,
        )
    age(engine, op.id, 120, "first_sent_at", "sent_at", "replay_deadline")
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.NEEDS_HUMAN
    assert remote.calls == []
    assert "dedup window closed" in events_of(engine, op.id)[-1].reason


def test_a_stale_outcome_becomes_evidence(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """An outcome arriving after the sweep took the row is kept as an event and confirms it."""
    op = make_operation(engine)

    def swept_meanwhile(call: ToolCall) -> DispatchResult:
        with engine.begin() as conn:
            apply_move(
                conn,
                op.id,
                from_state=State.SENT,
                to_state=State.UNKNOWN,
                actor=Actor.SWEEP,
                reason="dispatcher lost",
                attempt=call.attempt,
            )
        return Applied("ref-late")

    remote.answer = swept_meanwhile
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.LATE
    done = reload(engine, op.id)
    assert done.state is State.CONFIRMED
    assert done.remote_ref == "ref-late"
    reasons = [(e.actor, e.reason) for e in events_of(engine, op.id)]
    assert ("dispatcher", "late outcome of attempt 1: applied at the remote") in reasons
    assert reasons[-1][0] == "evidence"


def test_a_stale_outcome_never_overwrites_a_later_attempt(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """An outcome of attempt k that arrives after attempt k+1 began changes nothing but the log."""
    op = make_operation(engine)

    def overtaken(call: ToolCall) -> DispatchResult:
        with engine.begin() as conn:
            for from_state, to_state, actor in (
                (State.SENT, State.UNKNOWN, Actor.SWEEP),
                (State.UNKNOWN, State.PLANNED, Actor.RECONCILER),
                (State.PLANNED, State.SENT, Actor.DISPATCHER),
            ):
                apply_move(
                    conn,
                    op.id,
                    from_state=from_state,
                    to_state=to_state,
                    actor=actor,
                    reason="moved on",
                )
        return Rejected("HTTP 422")

    remote.answer = overtaken
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.LATE
    current = reload(engine, op.id)
    assert current.state is State.SENT
    assert current.attempts == 2
    assert events_of(engine, op.id)[-1].reason.startswith("late outcome of attempt 1")


def test_a_cut_connection_still_records_the_outcome(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """A dispatcher whose connection is killed mid-call records its outcome on a new one."""
    op = make_operation(engine)

    def cut_my_connection(call: ToolCall) -> DispatchResult:
        with engine.begin() as conn:
            pid = sql.locks.lock_holder_pid(conn, operation_lock_key(op.id))
            assert pid is not None
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        return Applied("ref-after-cut")

    remote.answer = cut_my_connection
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.CONFIRMED
    assert reload(engine, op.id).remote_ref == "ref-after-cut"


# --- the declarative HTTP tool against the reference service --------------------------------


@pytest.fixture
def service() -> Iterator[DeployService]:
    """The reference deploy service, without dedup, on a free port."""
    with DeployService(port=0, fault_delay_s=3.0) as running:
        yield running


@pytest.mark.parametrize(
    ("fault", "outcome", "state", "effects"),
    [
        (None, Outcome.CONFIRMED, State.CONFIRMED, 1),
        ("commit_then_timeout", Outcome.UNKNOWN, State.UNKNOWN, 1),
        ("commit_then_reset", Outcome.UNKNOWN, State.UNKNOWN, 1),
        ("error_503", Outcome.UNKNOWN, State.UNKNOWN, 0),
        ("reject_422", Outcome.FAILED, State.FAILED, 0),
    ],
)
def test_http_outcomes_are_classified_honestly(
    engine: Engine,
    service: DeployService,
    tmp_path: Any,
    fault: FaultMode | None,
    outcome: Outcome,
    state: State,
    effects: int,
) -> None:
    """Each fault of the reference service ends in the state its evidence allows, no more."""
    registry = http_registry(tmp_path, service.url)
    op = make_operation(engine)
    if fault is not None:
        service.faults.arm_key(str(op.id), fault, 1)
    assert dispatch(op.id, engine=engine, registry=registry).outcome is outcome
    done = reload(engine, op.id)
    assert done.state is state
    assert service.effects_by_key().get(str(op.id), 0) == effects
    if state is State.CONFIRMED:
        [effect] = service.ledger()
        assert done.remote_ref == effect.id


def test_http_connection_refused_then_service_back(engine: Engine, tmp_path: Any) -> None:
    """Connection refused returns the operation to planned; once the service is up, one effect."""
    with DeployService(port=0) as probe:
        port = int(probe.url.rsplit(":", 1)[1])
    url = f"http://127.0.0.1:{port}"
    registry = http_registry(tmp_path, url)
    op = make_operation(engine)
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.REPLANNED
    assert reload(engine, op.id).state is State.PLANNED
    age(engine, op.id, 3600, "available_at")
    with DeployService(port=port) as service:
        assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.CONFIRMED
        assert service.effects_by_key() == {str(op.id): 1}
    done = reload(engine, op.id)
    assert done.state is State.CONFIRMED
    assert done.attempts == 2


def test_an_operator_replay_grants_a_fresh_attempt_budget(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """After max_attempts, an operator's replay is sent again instead of bouncing back."""
    remote.answer = lambda call: NotDelivered("connection refused")
    op = make_operation(engine)
    for _ in range(3):
        dispatch(op.id, engine=engine, registry=registry)
        age(engine, op.id, 3600, "available_at")
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.NEEDS_HUMAN
    with Session(engine) as session, session.begin():
        outbox.resolve(
            session,
            op.id,
            applied=False,
            replay=True,
            by="ops@example",
            note="the remote was down; send it again",
            force=True,
        )
    remote.answer = lambda call: Applied("ref-after-replay")
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.CONFIRMED
    done = reload(engine, op.id)
    assert (done.attempts, done.attempt_budget_base) == (4, 3)
    assert len(remote.calls) == 4


def test_a_payload_edited_by_hand_is_never_sent(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """A stored payload that no longer matches its hash goes to a human instead of the remote."""
    op = make_operation(engine, payload={"version": "1.0.0"})
    tamper(engine, op.id, """payload = '{"version": "6.6.6"}'""")
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.NEEDS_HUMAN
    assert remote.calls == []
    assert "no longer matches its payload hash" in events_of(engine, op.id)[-1].reason


@pytest.mark.parametrize(
    ("assignments", "params"),
    [("tool = :other", {"other": "deploy.delete_release"}), ("target = 'project-z'", {})],
)
def test_a_tool_or_target_edited_by_hand_is_never_sent(
    engine: Engine,
    registry: ToolRegistry,
    remote: Remote,
    assignments: str,
    params: dict[str, Any],
) -> None:
    """A row whose tool or target was changed (the immutability trigger dropped, as someone
    with DDL rights could) goes to a human at dispatch instead of to the remote."""
    tool(
        "deploy.delete_release",
        timeout=2,
        send_deadline=2,
        inflight_horizon=60,
        max_attempts=3,
        registry=registry,
    )(remote)
    op = make_operation(engine, payload={"version": "1.0.0"})
    tamper(engine, op.id, assignments, **params)
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.NEEDS_HUMAN
    assert remote.calls == []
    assert "no longer matches the intent hash" in events_of(engine, op.id)[-1].reason
    assert reload(engine, op.id).state is State.NEEDS_HUMAN


# --- the autocommit lock connection ---------------------------------------------------------


@pytest.fixture
def one_connection(database_url: str) -> Iterator[Engine]:
    """An engine with a single pooled connection whose sessions start with
    synchronous_commit=off, and no pre-ping (as the worker's dispatch engine)."""
    from outbox.db import create_engine  # noqa: PLC0415

    engine = create_engine(
        database_url,
        pool_size=1,
        max_overflow=0,
        pool_pre_ping=False,
        connect_args={"options": "-c synchronous_commit=off"},
    )
    yield engine
    engine.dispose()


def test_the_sent_commit_is_durable_whatever_the_session_default(
    engine: Engine, one_connection: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """A dispatch connection whose session says synchronous_commit=off is switched to `on`
    with the lock, before its `sent` commit (the only connection of the pool shows it)."""
    with one_connection.connect() as conn:
        assert conn.execute(text("SHOW synchronous_commit")).scalar_one() == "off"
    op = make_operation(engine)
    with faults.armed("after_sent_commit", "raise"), pytest.raises(faults.InjectedFault):
        dispatch(op.id, engine=one_connection, registry=registry)
    assert reload(engine, op.id).state is State.SENT
    assert remote.calls == []
    with one_connection.connect() as conn:
        assert conn.execute(text("SHOW synchronous_commit")).scalar_one() == "on"


def test_a_dead_pooled_connection_is_replaced_at_the_lock(
    engine: Engine, one_connection: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """Without pre-ping, a pooled connection the server dropped fails at the lock, before
    anything is written, and the dispatcher takes a fresh one: the attempt goes ahead."""
    with one_connection.connect() as conn:
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    with engine.connect() as admin:
        admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        admin.commit()
    op = make_operation(engine)
    assert dispatch(op.id, engine=one_connection, registry=registry).outcome is Outcome.CONFIRMED
    assert len(remote.calls) == 1


def test_an_escalation_by_the_dispatcher_commits_with_its_webhook_or_not_at_all(
    engine: Engine, registry: ToolRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the autocommit lock connection, a move that writes webhook deliveries runs in one
    transaction with them: if the delivery cannot be written, the move is not made either;
    when it can, both are there."""
    from outbox.config import get_settings  # noqa: PLC0415

    monkeypatch.setenv("OUTBOX_WEBHOOK_URL", "https://hooks.example.com/outbox")
    monkeypatch.setenv("OUTBOX_WEBHOOK_SECRET", "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    get_settings.cache_clear()
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "CREATE OR REPLACE FUNCTION pg_temp.refuse() RETURNS trigger "
                    "LANGUAGE plpgsql AS "
                    "$$ BEGIN RAISE EXCEPTION 'deliveries table full'; END $$"
                )
            )
            conn.execute(
                text(
                    "CREATE TRIGGER refuse_delivery BEFORE INSERT ON outbox.webhook_deliveries "
                    "FOR EACH ROW EXECUTE FUNCTION pg_temp.refuse()"
                )
            )
        op = make_operation(engine, tool="mail.send")
        try:
            with pytest.raises(DBAPIError, match="deliveries table full"):
                dispatch(op.id, engine=engine, registry=registry)
        finally:
            with engine.begin() as conn:
                conn.execute(text("DROP TRIGGER refuse_delivery ON outbox.webhook_deliveries"))
        assert reload(engine, op.id).state is State.PLANNED
        report = dispatch(op.id, engine=engine, registry=registry)
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
    assert report.outcome is Outcome.NEEDS_HUMAN
    with engine.connect() as conn:
        events = conn.execute(
            text("SELECT event FROM outbox.webhook_deliveries WHERE operation_id = :id"),
            {"id": op.id},
        ).scalars()
        assert list(events) == ["needs_human"]


def test_the_read_with_the_lock_sees_what_was_committed_while_the_statement_ran(
    engine: Engine,
) -> None:
    """The dispatcher locks and reads in one statement; the row comes from a function whose
    query takes its snapshot after its input (the lock) was computed, so a move committed
    after the statement began is seen. A plain join, the control, reads the statement's
    older snapshot: the difference is what makes one round trip as safe as two."""

    def state_read_while_cancelled(join: str) -> str:
        op = make_operation(engine)
        with cancelled_meanwhile(engine, op.id), engine.connect() as conn:
            # The CTE stands for the lock: it runs first, and takes a second.
            return str(
                conn.execute(
                    text(
                        "WITH lk AS MATERIALIZED (SELECT true AS taken FROM pg_sleep(1)) "
                        f"SELECT op.state FROM lk {join}"
                    ),
                    {"id": op.id},
                ).scalar_one()
            )

    plain = state_read_while_cancelled("LEFT JOIN outbox.operations op ON op.id = :id")
    assert plain == State.PLANNED  # the statement's snapshot: from before the move
    fresh = state_read_while_cancelled(
        "LEFT JOIN LATERAL outbox.operation_if_locked(:id, lk.taken) AS op ON true"
    )
    assert fresh == State.CANCELLED


def test_the_lock_and_read_reports_busy_gone_and_found(engine: Engine) -> None:
    """One round trip, three answers: another holder, no such operation, the operation."""
    op = make_operation(engine)
    key = operation_lock_key(op.id)
    with engine.connect() as holder, engine.connect() as conn:
        assert sql.locks.try_lock(holder, key)
        read = sql.locks.try_lock_and_read(conn, key, op.id)
        assert (read.taken, read.found) == (False, None)
        sql.locks.unlock_all(holder)
        read = sql.locks.try_lock_and_read(conn, key, op.id)
        assert read.taken
        assert read.synchronous_commit in {"on", "off", "local", "remote_write", "remote_apply"}
        assert read.found is not None
        assert read.found.operation == reload(engine, op.id)
        assert (read.found.due, read.found.replay_expired) == (True, False)
        sql.locks.unlock_all(conn)
        missing = uuid.uuid4()
        read = sql.locks.try_lock_and_read(conn, operation_lock_key(missing), missing)
        assert (read.taken, read.found) == (True, None)
        sql.locks.unlock_all(conn)


def _free(engine: Engine, operation_id: uuid.UUID) -> bool:
    """Whether another connection can take the operation's lock (and gives it back)."""
    with engine.connect() as probe:
        taken = sql.locks.try_lock(probe, operation_lock_key(operation_id))
        sql.locks.unlock_all(probe)
        return taken


def test_a_message_s_locks_are_taken_in_turn_on_one_connection(engine: Engine) -> None:
    """Each lock is released by the statement that takes the next (also when that one is
    busy), on the same connection; the last at close; a block that raises gives its lock
    back at once and the next lock takes a fresh connection."""
    first, second, third, fourth = (make_operation(engine) for _ in range(4))
    with DispatchLocks(engine) as locks:
        with locks.lock(first.id) as locked:
            assert locked is not None
            conn, found = locked
            assert found is not None
            assert found.operation.id == first.id
            assert not _free(engine, first.id)
        assert not _free(engine, first.id)  # held until the next lock is taken
        pid = conn.connection.driver_connection.info.backend_pid  # type: ignore[union-attr]
        with locks.lock(second.id) as locked:
            assert locked is not None
            assert locked[0].connection.driver_connection.info.backend_pid == pid  # type: ignore[union-attr]
            assert _free(engine, first.id)
            assert not _free(engine, second.id)
        with engine.connect() as holder:
            assert sql.locks.try_lock(holder, operation_lock_key(third.id))
            with locks.lock(third.id) as locked:
                assert locked is None  # busy, and the second's lock went with the attempt
                assert _free(engine, second.id)
            sql.locks.unlock_all(holder)

        def broken_attempt() -> None:
            with locks.lock(fourth.id) as locked:
                assert locked is not None
                raise RuntimeError("the attempt broke")

        with pytest.raises(RuntimeError, match="the attempt broke"):
            broken_attempt()
        assert _free(engine, fourth.id)
        with locks.lock(first.id) as locked:
            assert locked is not None
            assert locked[0].connection.driver_connection.info.backend_pid != pid  # type: ignore[union-attr]
    assert _free(engine, first.id)


def test_the_operations_of_a_message_share_one_lock_connection(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """Attempts dispatched with one DispatchLocks run on the same connection, one after the
    other, and each lock is free once the next attempt took its own."""
    ops = [make_operation(engine) for _ in range(3)]
    pids: list[int] = []

    def answer(call: ToolCall) -> DispatchResult:
        with engine.connect() as conn:
            pids.append(
                int(
                    conn.execute(
                        text(
                            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                            "AND pid <> pg_backend_pid() AND database = "
                            "(SELECT oid FROM pg_database WHERE datname = current_database())"
                        )
                    ).scalar_one()
                )
            )
        return Applied(f"ref-{call.operation_id}")

    remote.answer = answer
    with DispatchLocks(engine) as locks:
        reports = [dispatch(op.id, engine=engine, registry=registry, locks=locks) for op in ops]
    assert [r.outcome for r in reports] == [Outcome.CONFIRMED] * 3
    assert len(pids) == 3
    assert len(set(pids)) == 1  # one backend, holding exactly one lock during each call
    assert all(_free(engine, op.id) for op in ops)


def _hold_row_like_a_relay(
    engine: Engine, operation_id: uuid.UUID, hold_s: float
) -> threading.Thread:
    """A relay's claim on another connection: the row locked FOR UPDATE while it publishes
    (``hold_s``), then marked published and committed. Returns once the lock is held."""
    held = threading.Event()

    def claim() -> None:
        with engine.begin() as conn:
            conn.execute(
                text("SELECT id FROM outbox.operations WHERE id = :id FOR UPDATE"),
                {"id": operation_id},
            )
            held.set()
            time.sleep(hold_s)
            conn.execute(
                text(
                    "UPDATE outbox.operations SET published_at = clock_timestamp() WHERE id = :id"
                ),
                {"id": operation_id},
            )

    holder = threading.Thread(target=claim)
    holder.start()
    assert held.wait(10), "the relay-like transaction never got the row"
    return holder


def test_waiting_for_a_relay_s_claim_is_not_an_attempt(
    engine: Engine, registry: ToolRegistry
) -> None:
    """A row held by a relay's open claim (1 s) is waited for outside the attempt: with a
    0.5 s send deadline and max_attempts 2 the operation is sent once and confirmed."""
    remote = Remote()
    tool(
        TOOL, timeout=2, send_deadline=0.5, inflight_horizon=60, max_attempts=2, registry=registry
    )(remote)
    op = make_operation(engine)
    outcomes = []
    for _ in range(3):  # one more round than max_attempts: enough to escalate if waits counted
        holder = _hold_row_like_a_relay(engine, op.id, 1.0)
        try:
            report = dispatch(op.id, engine=engine, registry=registry)
        finally:
            holder.join()
        outcomes.append(report.outcome)
        if report.outcome is not Outcome.NOT_SENT:
            break
    assert outcomes == [Outcome.CONFIRMED]
    done = reload(engine, op.id)
    assert done.state is State.CONFIRMED
    assert done.attempts == 1
    assert [call.operation_id for call in remote.calls] == [str(op.id)]
    assert not [e for e in events_of(engine, op.id) if "not sent" in e.reason]


def test_a_row_held_past_the_wait_is_put_back_with_nothing_written(
    engine: Engine, registry: ToolRegistry, remote: Remote
) -> None:
    """A row still held after the dispatcher's row-lock wait gives LOCK_BUSY: no attempt
    counted, no event, the remote not called."""
    op = make_operation(engine)
    before = events_of(engine, op.id)
    holder = _hold_row_like_a_relay(engine, op.id, 1.5)
    try:
        report = dispatch(
            op.id, engine=engine, registry=registry, config=DispatchConfig(row_lock_wait_s=0.3)
        )
    finally:
        holder.join()
    assert report.outcome is Outcome.LOCK_BUSY
    assert remote.calls == []
    still = reload(engine, op.id)
    assert (still.state, still.attempts) == (State.PLANNED, 0)
    assert events_of(engine, op.id) == before
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.CONFIRMED


def test_a_python_tool_past_its_send_deadline_sends_nothing(
    engine: Engine, registry: ToolRegistry
) -> None:
    """A Python tool paused past its send deadline after the dispatcher's check is refused
    by call.check_send_deadline(): its remote sees nothing and the attempt goes back to
    planned as "not sent"."""
    ledger: list[str] = []

    def paused_tool(call: ToolCall) -> DispatchResult:
        time.sleep(0.5)  # a GC pause, a SIGSTOP, a busy thread pool… after the dispatcher's check
        call.check_send_deadline()
        ledger.append(call.operation_id)
        return Applied(f"ref-{call.operation_id}")

    tool(TOOL, timeout=2, send_deadline=0.2, inflight_horizon=60, registry=registry)(paused_tool)
    op = make_operation(engine)
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.NOT_SENT
    assert ledger == []
    back = reload(engine, op.id)
    assert (back.state, back.attempts, back.maybe_applied) == (State.PLANNED, 1, False)
    assert events_of(engine, op.id)[-1].reason.startswith("not sent")


def test_an_http_call_connected_past_its_send_deadline_sends_nothing(
    engine: Engine, service: DeployService, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the worker pauses past the send deadline after its check, here once connected
    (a GC pause, a SIGSTOP, a blocked loop), the HTTP tool writes no byte: the service's
    ledger stays empty and the attempt goes back to planned as "not sent"."""
    create_connection = aiohttp.TCPConnector._create_connection

    async def paused_connect(self: aiohttp.TCPConnector, *args: Any, **kwargs: Any) -> Any:
        connected = await create_connection(self, *args, **kwargs)
        time.sleep(0.6)  # the whole process stalls: no timer can fire meanwhile
        return connected

    monkeypatch.setattr(aiohttp.TCPConnector, "_create_connection", paused_connect)
    registry = http_registry(tmp_path, service.url, send_deadline_s=0.3, timeout_s=2.0)
    op = make_operation(engine)
    try:
        report = dispatch(op.id, engine=engine, registry=registry)
    finally:
        close_thread_loop()
    assert report.outcome is Outcome.NOT_SENT
    assert service.ledger() == []
    back = reload(engine, op.id)
    assert (back.state, back.attempts, back.maybe_applied) == (State.PLANNED, 1, False)
    assert events_of(engine, op.id)[-1].reason.startswith("not sent")
