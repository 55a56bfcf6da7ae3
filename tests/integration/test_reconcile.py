"""The sweep, lookups and the decision table, against real PostgreSQL and the reference service."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from sqlalchemy import Engine, event

from outbox import sql
from outbox.contracts import ContractTable
from outbox.db import create_engine
from outbox.dev.service import DeployService
from outbox.locks import operation_lock_key
from outbox.models import Operation
from outbox.reconcilers.lookup import LookupOutcome, lookup
from outbox.reconcilers.sweep import SweepConfig, Sweeper, SweepResult
from outbox.states import Actor, State
from outbox.tools import Applied, DispatchResult, LookupResult, ToolCall, ToolRegistry, tool
from outbox.workers.dispatch import Outcome, dispatch
from tests.factories import age, apply_move, events_of, make_operation, poisoned_updates, reload
from tests.tool_configs import http_registry

HORIZON = 30


@pytest.fixture
def service() -> Iterator[DeployService]:
    """The reference service without dedup (a second call is a second effect)."""
    with DeployService(port=0, fault_delay_s=2.0) as running:
        yield running


@pytest.fixture
def dedup_service() -> Iterator[DeployService]:
    """The reference service honouring the same key + payload for an hour."""
    with DeployService(port=0, dedup_window_s=3600, fault_delay_s=2.0) as running:
        yield running


def _ambiguous(engine: Engine, registry: ToolRegistry, service: DeployService) -> Operation:
    """An operation whose first attempt committed at the remote, then timed out: unknown."""
    op = make_operation(engine)
    service.faults.arm_key(str(op.id), "commit_then_timeout", 1)
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.UNKNOWN
    return reload(engine, op.id)


def _undelivered(engine: Engine, registry: ToolRegistry, service: DeployService) -> Operation:
    """An operation whose first attempt got a 503 (nothing committed): unknown."""
    op = make_operation(engine)
    service.faults.arm_key(str(op.id), "error_503", 1)
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.UNKNOWN
    return reload(engine, op.id)


def _past_horizon(engine: Engine, op_id: UUID) -> None:
    age(engine, op_id, HORIZON + 1, "sent_at", "first_sent_at")


def _sweeper(engine: Engine, registry: ToolRegistry, asked: list[UUID] | None = None) -> Sweeper:
    return Sweeper(
        engine,
        registry=registry,
        config=SweepConfig(sent_timeout_s=5, sent_max_age_s=60),
        request_lookup=asked.append if asked is not None else None,
    )


# --- lookup available -----------------------------------------------------------------------


def test_lookup_finds_the_effect_and_confirms(
    engine: Engine, service: DeployService, tmp_path: Path
) -> None:
    """Lookup available, effect applied: confirmed with the remote's ref, still one effect."""
    registry = http_registry(tmp_path, service.url, inflight_horizon_s=HORIZON)
    op = _ambiguous(engine, registry, service)
    asked: list[UUID] = []
    assert _sweeper(engine, registry, asked).run_once().lookups == 1
    assert asked == [op.id]
    assert lookup(op.id, engine=engine, registry=registry).outcome is LookupOutcome.CONFIRMED
    done = reload(engine, op.id)
    assert done.state is State.CONFIRMED
    assert done.remote_ref == service.ledger()[0].id
    assert service.effects_by_key() == {str(op.id): 1}


def test_not_applied_before_the_horizon_waits(
    engine: Engine, service: DeployService, tmp_path: Path
) -> None:
    """Lookup says not applied before the horizon: check again after it, not counted."""
    registry = http_registry(tmp_path, service.url, inflight_horizon_s=HORIZON)
    op = _undelivered(engine, registry, service)
    assert lookup(op.id, engine=engine, registry=registry).outcome is LookupOutcome.WAITING
    waiting = reload(engine, op.id)
    assert waiting.state is State.UNKNOWN
    assert waiting.checks == 0
    assert waiting.next_check_at is not None
    assert waiting.sent_at is not None
    assert (waiting.next_check_at - waiting.sent_at).total_seconds() == pytest.approx(HORIZON)


def test_not_applied_after_the_horizon_replays_with_the_same_key(
    engine: Engine, service: DeployService, tmp_path: Path
) -> None:
    """Lookup says not applied after the horizon: replay with the same key, then one effect."""
    registry = http_registry(tmp_path, service.url, inflight_horizon_s=HORIZON)
    op = _undelivered(engine, registry, service)
    _past_horizon(engine, op.id)
    assert lookup(op.id, engine=engine, registry=registry).outcome is LookupOutcome.REPLANNED
    replay = reload(engine, op.id)
    assert replay.state is State.PLANNED
    assert not replay.maybe_applied
    assert replay.payload_hash == op.payload_hash
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.CONFIRMED
    assert service.effects_by_key() == {str(op.id): 1}


def test_inconclusive_lookups_back_off_then_fall_through(
    engine: Engine, service: DeployService, tmp_path: Path
) -> None:
    """Inconclusive lookups count as checks with backoff; after max_checks a human decides."""
    registry = http_registry(tmp_path, service.url, inflight_horizon_s=HORIZON, max_checks=2)
    op = _ambiguous(engine, registry, service)
    service.stop()  # the lookup endpoint is unreachable: inconclusive
    first = lookup(op.id, engine=engine, registry=registry)
    assert first.outcome is LookupOutcome.RECHECK
    after_one = reload(engine, op.id)
    assert after_one.checks == 1
    assert after_one.next_check_at is not None
    assert after_one.next_check_at > after_one.updated_at
    second = lookup(op.id, engine=engine, registry=registry)
    assert second.outcome is LookupOutcome.ROUTED
    stuck = reload(engine, op.id)
    assert stuck.state is State.NEEDS_HUMAN
    assert (
        "lookup inconclusive 2 times and no dedup contract" in events_of(engine, op.id)[-1].reason
    )


# --- no lookup: the dedup contract decides ------------------------------------------------


def test_dedup_replay_after_the_horizon_is_one_effect(
    engine: Engine, dedup_service: DeployService, tmp_path: Path
) -> None:
    """No lookup, dedup contract, horizon passed: a replay with a deadline; the remote dedups."""
    registry = http_registry(
        tmp_path,
        dedup_service.url,
        lookup=False,
        inflight_horizon_s=HORIZON,
        dedup_window_s=3600,
        dedup_margin_s=300,
    )
    op = _ambiguous(engine, registry, dedup_service)
    _past_horizon(engine, op.id)
    assert _sweeper(engine, registry).run_once().replays == 1
    replay = reload(engine, op.id)
    assert replay.state is State.PLANNED
    assert replay.maybe_applied
    assert replay.replay_deadline is not None
    assert replay.first_sent_at is not None
    assert (replay.replay_deadline - replay.first_sent_at).total_seconds() == pytest.approx(3300)
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.CONFIRMED
    assert dedup_service.effects_by_key() == {str(op.id): 1}


def test_dedup_waits_for_the_horizon_unless_concurrent_safe(
    engine: Engine, dedup_service: DeployService, tmp_path: Path
) -> None:
    """No lookup, dedup, horizon not passed: wait for it; a concurrent-safe remote replays now."""
    registry = http_registry(
        tmp_path,
        dedup_service.url,
        lookup=False,
        inflight_horizon_s=HORIZON,
        dedup_window_s=3600,
        dedup_margin_s=300,
    )
    op = _ambiguous(engine, registry, dedup_service)
    result = _sweeper(engine, registry).run_once()
    assert (result.waiting, result.replays) == (1, 0)
    waiting = reload(engine, op.id)
    assert waiting.state is State.UNKNOWN
    assert waiting.next_check_at is not None
    assert waiting.sent_at is not None
    assert (waiting.next_check_at - waiting.sent_at).total_seconds() == pytest.approx(HORIZON)
    assert _sweeper(engine, registry).run_once().waiting == 0  # not due again yet

    safe = http_registry(
        tmp_path,
        dedup_service.url,
        lookup=False,
        inflight_horizon_s=HORIZON,
        dedup_window_s=3600,
        dedup_margin_s=300,
        dedup_concurrent_safe=True,
    )
    other = _ambiguous(engine, safe, dedup_service)
    assert _sweeper(engine, safe).run_once().replays == 1
    assert reload(engine, other.id).state is State.PLANNED


def test_expired_dedup_window_goes_to_a_human(
    engine: Engine, dedup_service: DeployService, tmp_path: Path
) -> None:
    """No lookup, and the dedup window (minus its margin) has closed: a human decides."""
    registry = http_registry(
        tmp_path,
        dedup_service.url,
        lookup=False,
        inflight_horizon_s=HORIZON,
        dedup_window_s=600,
        dedup_margin_s=60,
    )
    op = _ambiguous(engine, registry, dedup_service)
    age(engine, op.id, 541, "sent_at", "first_sent_at")
    assert _sweeper(engine, registry).run_once().escalated == 1
    assert reload(engine, op.id).state is State.NEEDS_HUMAN
    assert "dedup window expired" in events_of(engine, op.id)[-1].reason


def test_neither_lookup_nor_dedup_goes_to_a_human(
    engine: Engine, service: DeployService, tmp_path: Path
) -> None:
    """No lookup and no dedup contract: straight to a human, never a replay."""
    registry = http_registry(tmp_path, service.url, lookup=False, inflight_horizon_s=HORIZON)
    op = _ambiguous(engine, registry, service)
    _past_horizon(engine, op.id)
    assert _sweeper(engine, registry).run_once().escalated == 1
    stuck = reload(engine, op.id)
    assert stuck.state is State.NEEDS_HUMAN
    assert stuck.maybe_applied
    assert events_of(engine, op.id)[-1].reason == "no lookup and no dedup contract"
    assert service.effects_by_key() == {str(op.id): 1}


def test_max_attempts_stops_a_replay_loop(
    engine: Engine, dedup_service: DeployService, tmp_path: Path
) -> None:
    """Replays that keep ending ambiguous stop at max_attempts and go to a human."""
    registry = http_registry(
        tmp_path,
        dedup_service.url,
        lookup=False,
        inflight_horizon_s=HORIZON,
        dedup_window_s=3600,
        dedup_margin_s=300,
        max_attempts=2,
    )
    op = make_operation(engine)
    dedup_service.faults.arm_key(str(op.id), "error_503", 10)
    for _ in range(2):
        assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.UNKNOWN
        _past_horizon(engine, op.id)
        _sweeper(engine, registry).run_once()
    assert reload(engine, op.id).state is State.NEEDS_HUMAN
    assert "max_attempts (2) reached" in events_of(engine, op.id)[-1].reason


# --- the sweep ---------------------------------------------------------------------------


def test_a_lost_dispatcher_is_swept_to_unknown(
    engine: Engine, service: DeployService, tmp_path: Path
) -> None:
    """A `sent` row past the timeout whose lock is free moves to unknown, fenced on its attempt."""
    registry = http_registry(tmp_path, service.url, inflight_horizon_s=HORIZON)
    op = make_operation(engine, State.SENT)
    assert _sweeper(engine, registry).run_once().lost == 0  # not stale yet
    age(engine, op.id, 10, "sent_at", "first_sent_at")
    result = _sweeper(engine, registry).run_once()
    assert result.lost == 1
    swept = reload(engine, op.id)
    assert swept.state is State.UNKNOWN
    assert swept.maybe_applied
    assert "dispatcher lost" in events_of(engine, op.id)[-1].reason
    assert result.lookups == 1  # routed in the same run


def test_a_slow_live_dispatcher_is_left_alone_until_the_max_age(
    engine: Engine, service: DeployService, tmp_path: Path
) -> None:
    """A `sent` row whose dispatcher still holds the lock is slow, not lost; past the max age,
    a human is told which backend holds it."""
    registry = http_registry(tmp_path, service.url, inflight_horizon_s=HORIZON)
    op = make_operation(engine, State.SENT)
    age(engine, op.id, 10, "sent_at", "first_sent_at")
    with engine.connect() as holder:
        assert sql.locks.try_lock(holder, operation_lock_key(op.id))
        holder.commit()
        result = _sweeper(engine, registry).run_once()
        assert (result.lost, result.slow) == (0, 1)
        assert reload(engine, op.id).state is State.SENT
        age(engine, op.id, 60, "sent_at", "first_sent_at")
        result = _sweeper(engine, registry).run_once()
        assert result.stuck == 1
        sql.locks.unlock_all(holder)
        holder.commit()
    stuck = reload(engine, op.id)
    assert stuck.state is State.NEEDS_HUMAN
    assert "backend pid" in events_of(engine, op.id)[-1].reason


def test_two_sweeps_at_once_route_each_operation_once(
    engine: Engine, service: DeployService, tmp_path: Path
) -> None:
    """Two sweeps running together ask for one lookup per operation, no more."""
    registry = http_registry(tmp_path, service.url, inflight_horizon_s=HORIZON)
    ops = [make_operation(engine, State.UNKNOWN) for _ in range(30)]
    asked: list[UUID] = []
    lock = threading.Lock()

    def ask(op_id: UUID) -> None:
        with lock:
            asked.append(op_id)

    sweepers = [
        Sweeper(engine, registry=registry, config=SweepConfig(), request_lookup=ask)
        for _ in range(2)
    ]
    barrier = threading.Barrier(2)

    def run(sweeper: Sweeper) -> None:
        barrier.wait()
        sweeper.run_once()

    threads = [threading.Thread(target=run, args=(s,)) for s in sweepers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(asked) == sorted(op.id for op in ops)


def test_a_lookup_losing_to_an_operator_keeps_its_evidence(engine: Engine) -> None:
    """If the operation was decided while the lookup asked, the evidence becomes an event."""
    registry = ToolRegistry(ContractTable())
    op = make_operation(engine, State.UNKNOWN)

    @tool(op.tool, inflight_horizon=HORIZON, registry=registry)
    def create(call: ToolCall) -> DispatchResult:
        raise AssertionError("a lookup never dispatches")

    @create.lookup
    def decided_meanwhile(call: ToolCall) -> LookupResult:
        with engine.begin() as conn:
            apply_move(
                conn,
                op.id,
                from_state=State.UNKNOWN,
                to_state=State.FAILED,
                actor=Actor.OPERATOR,
                reason="operator: refunded by hand",
                attempt=op.attempts,
                not_applied=True,
            )
        return Applied("rel-late")

    assert lookup(op.id, engine=engine, registry=registry).outcome is LookupOutcome.LATE
    assert reload(engine, op.id).state is State.FAILED
    assert "lookup evidence after the operation moved on" in events_of(engine, op.id)[-1].reason


def test_an_unknown_tool_is_escalated_by_the_sweep_and_by_a_lookup(
    engine: Engine, service: DeployService, tmp_path: Path
) -> None:
    """An `unknown` operation whose tool the reconciler does not know goes to a human."""
    registry = http_registry(tmp_path, service.url, inflight_horizon_s=HORIZON)
    swept = make_operation(engine, State.UNKNOWN, tool="mail.send")
    looked_up = make_operation(engine, State.UNKNOWN, tool="mail.send")
    assert lookup(looked_up.id, engine=engine, registry=registry).outcome is LookupOutcome.ROUTED
    assert _sweeper(engine, registry).run_once().escalated == 1
    for op in (swept, looked_up):
        assert reload(engine, op.id).state is State.NEEDS_HUMAN
        assert "not registered in the reconciler" in events_of(engine, op.id)[-1].reason


# --- a row that fails, and two sweeps at once (issue 17, findings 3 and 13) -----------------


@contextmanager
def _poisoned(engine: Engine, *op_ids: UUID) -> Iterator[None]:
    """Any update that leaves one of ``op_ids`` in `unknown` raises, as a broken row would."""
    ids = ", ".join(f"'{op_id}'" for op_id in op_ids)
    with poisoned_updates(engine, f"NEW.id IN ({ids}) AND NEW.state = 'unknown'"):
        yield


def test_one_poisoned_row_does_not_stop_the_sweep(
    engine: Engine, service: DeployService, tmp_path: Path
) -> None:
    """A row whose handling raises is skipped and counted on the row while the others are swept
    and routed; after max_row_failures runs it goes to a human with the error."""
    registry = http_registry(tmp_path, service.url, inflight_horizon_s=HORIZON)
    poisoned_sent = make_operation(engine, State.SENT)
    healthy_sent = make_operation(engine, State.SENT)
    poisoned_unknown = make_operation(engine, State.UNKNOWN)
    healthy_unknown = make_operation(engine, State.UNKNOWN)
    age(engine, poisoned_sent.id, 30, "sent_at", "first_sent_at")  # first by sent_at
    age(engine, healthy_sent.id, 20, "sent_at", "first_sent_at")
    asked: list[UUID] = []
    with _poisoned(engine, poisoned_sent.id, poisoned_unknown.id):
        first = _sweeper(engine, registry, asked).run_once()
        assert (first.failed, first.lost) == (2, 1)
        assert reload(engine, healthy_sent.id).state is State.UNKNOWN
        assert sorted(asked) == sorted([healthy_sent.id, healthy_unknown.id])
        for op in (poisoned_sent, poisoned_unknown):
            assert reload(engine, op.id).state is op.state
            assert "poisoned row" in events_of(engine, op.id)[-1].reason
        _sweeper(engine, registry).run_once()
        third = _sweeper(engine, registry).run_once()
        assert (third.failed, third.escalated) == (2, 2)
    for op in (poisoned_sent, poisoned_unknown):
        assert reload(engine, op.id).state is State.NEEDS_HUMAN
        reason = events_of(engine, op.id)[-1].reason
        assert "the sweep failed on this operation 3 times" in reason
        assert "RaiseException: poisoned row" in reason


def test_two_sweeps_never_blame_each_others_probe(
    engine: Engine, service: DeployService, tmp_path: Path
) -> None:
    """Two sweeps at once on lost dispatchers' rows move them to unknown; neither sends one to a
    human because the other sweep's probe holds its lock."""
    registry = http_registry(tmp_path, service.url, inflight_horizon_s=HORIZON)
    ops = [make_operation(engine, State.SENT) for _ in range(40)]
    for op in ops:
        age(engine, op.id, 120, "sent_at", "first_sent_at")  # past the max age: too old
    slow_engine = create_engine(engine.url.render_as_string(hide_password=False))
    fast_engine = create_engine(engine.url.render_as_string(hide_password=False))
    in_move = threading.Event()

    @event.listens_for(slow_engine, "before_cursor_execute", retval=True)
    def pause_before_the_first_move(*args: Any) -> tuple[Any, Any]:
        statement, parameters = args[2], args[3]
        if "UPDATE outbox.operations" in statement and not in_move.is_set():
            in_move.set()  # holding the first row's lock, its move not yet made
            time.sleep(1.0)
        return statement, parameters

    config = SweepConfig(sent_timeout_s=5, sent_max_age_s=60)
    slow, fast = (Sweeper(e, registry=registry, config=config) for e in (slow_engine, fast_engine))
    results: list[SweepResult] = []

    def run(sweeper: Sweeper) -> None:
        results.append(sweeper.run_once())

    first = threading.Thread(target=run, args=(slow,))
    first.start()
    assert in_move.wait(30)
    second = threading.Thread(target=run, args=(fast,))
    second.start()
    for thread in (first, second):
        thread.join(60)
    slow_engine.dispose()
    fast_engine.dispose()
    assert len(results) == 2
    assert sum(r.stuck for r in results) == 0
    assert [reload(engine, op.id).state for op in ops] == [State.UNKNOWN] * len(ops)
    for op in ops:
        assert not any("backend pid" in e.reason for e in events_of(engine, op.id))
