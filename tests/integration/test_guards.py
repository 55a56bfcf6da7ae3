"""The guards (breaker, rate, concurrency) in the dispatch protocol, against a real PostgreSQL."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, text

from outbox import guard_state, transitions
from outbox.config import get_settings
from outbox.contracts import ContractTable
from outbox.guards import Breaker, Concurrency, Rate
from outbox.metrics import OutboxCollector
from outbox.reconcilers.lookup import LookupOutcome, lookup
from outbox.sql import guards as guard_sql
from outbox.states import State
from outbox.tools import (
    Applied,
    DispatchResult,
    Inconclusive,
    NotDelivered,
    ToolCall,
    ToolRegistry,
    tool,
)
from outbox.workers.dispatch import Outcome, dispatch
from tests.factories import make_operation, reload
from tests.integration.test_dispatch import Remote
from tests.integration.test_metrics import scrape

TOOL = "deploy.create_release"
SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()


@pytest.fixture
def webhooks_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Webhooks configured (to an address nothing delivers to here): rows are written."""
    monkeypatch.setenv("OUTBOX_WEBHOOK_URL", "http://127.0.0.1:9/hook")
    monkeypatch.setenv("OUTBOX_WEBHOOK_SECRET", SECRET)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def guarded(**guards: Any) -> tuple[ToolRegistry, Remote]:
    """A registry of its own with TOOL guarded as asked, and its remote."""
    registry = ToolRegistry(ContractTable())
    remote = Remote()
    tool(
        TOOL,
        timeout=2,
        send_deadline=2,
        inflight_horizon=60,
        max_attempts=9,
        registry=registry,
        **guards,
    )(remote)
    return registry, remote


def deliveries(engine: Engine) -> list[tuple[str, str]]:
    """The guard webhooks written: (event, subject)."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT event, subject FROM outbox.webhook_deliveries "
                "WHERE subject IS NOT NULL ORDER BY id"
            )
        )
        return [(r.event, r.subject) for r in rows]


def end_open_spell(engine: Engine) -> None:
    """Age every open breaker's open_until into the past (as if open_s had elapsed)."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox.guard_breakers "
                "SET open_until = clock_timestamp() - interval '1 second'"
            )
        )


def test_breaker_opens_holds_then_one_probe_closes_it(engine: Engine, webhooks_on: None) -> None:
    """After `failures` undelivered attempts the breaker opens (circuit_opened), later
    operations stay planned without a call, and one probe's success closes it."""
    registry, remote = guarded(breaker=Breaker(failures=3, open_s=60))
    remote.answer = lambda call: NotDelivered("connection refused")
    for _ in range(3):
        op = make_operation(engine)
        assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.REPLANNED
    assert deliveries(engine) == [("circuit_opened", f"{TOOL}:project-a")]
    held = make_operation(engine)
    report = dispatch(held.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.HELD
    row = reload(engine, held.id)
    assert (row.state, row.attempts, len(remote.calls)) == (State.PLANNED, 0, 3)
    other = make_operation(engine, target="project-b")
    assert dispatch(other.id, engine=engine, registry=registry).outcome is Outcome.REPLANNED

    end_open_spell(engine)
    remote.answer = lambda call: Applied(f"ref-{call.operation_id}")
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox.operations SET available_at = clock_timestamp() "
                "WHERE state = 'planned'"
            )
        )
    probe = dispatch(held.id, engine=engine, registry=registry)
    assert probe.outcome is Outcome.CONFIRMED
    assert deliveries(engine)[-1] == ("circuit_closed", f"{TOOL}:project-a")
    after = make_operation(engine)
    assert dispatch(after.id, engine=engine, registry=registry).outcome is Outcome.CONFIRMED


def test_half_open_breaker_lets_exactly_one_probe_through(engine: Engine) -> None:
    """Once the open spell is over, of six racing dispatchers exactly one sends (the probe)."""
    registry, remote = guarded(breaker=Breaker(failures=1, open_s=60))
    remote.answer = lambda call: NotDelivered("refused")
    first = make_operation(engine)
    dispatch(first.id, engine=engine, registry=registry)
    end_open_spell(engine)
    gate = threading.Event()

    def slow(call: ToolCall) -> DispatchResult:
        gate.wait(10)
        return Applied(f"ref-{call.operation_id}")

    remote.answer = slow
    ops = [make_operation(engine) for _ in range(6)]
    outcomes: list[Outcome] = []
    threads = [
        threading.Thread(
            target=lambda o=o: outcomes.append(
                dispatch(o.id, engine=engine, registry=registry).outcome
            )
        )
        for o in ops
    ]
    for thread in threads:
        thread.start()
    while sum(1 for o in outcomes if o is Outcome.HELD) < len(ops) - 1:
        time.sleep(0.01)
    gate.set()
    for thread in threads:
        thread.join(10)
    assert sorted(outcomes) == sorted([Outcome.CONFIRMED] + [Outcome.HELD] * 5)
    assert len(remote.calls) == 2  # the failure that opened it, and the one probe


def test_rate_limit_holds_past_the_burst_per_target(engine: Engine) -> None:
    """With rate 1/s and burst 2, two sends go, the third stays planned until the next slot;
    another target has its own bucket."""
    registry, remote = guarded(rate=Rate(per_second=1, burst=2))
    outcomes = [
        dispatch(make_operation(engine).id, engine=engine, registry=registry).outcome
        for _ in range(3)
    ]
    assert outcomes == [Outcome.CONFIRMED, Outcome.CONFIRMED, Outcome.HELD]
    other = make_operation(engine, target="project-b")
    assert dispatch(other.id, engine=engine, registry=registry).outcome is Outcome.CONFIRMED
    with engine.connect() as conn:
        wait = conn.execute(
            text(
                "SELECT extract(epoch FROM available_at - clock_timestamp()) "
                "FROM outbox.operations WHERE state = 'planned'"
            )
        ).scalar_one()
    assert 0 < wait <= 1.0
    assert len(remote.calls) == 3


def test_concurrency_cap_counts_sent_rows(engine: Engine) -> None:
    """With max_in_flight 1 and one attempt of the target in sent, another is held, not
    another target's."""
    registry, remote = guarded(concurrency=Concurrency(max_in_flight=1))
    make_operation(engine, State.SENT)
    held = make_operation(engine)
    assert dispatch(held.id, engine=engine, registry=registry).outcome is Outcome.HELD
    assert reload(engine, held.id).attempts == 0
    other = make_operation(engine, target="project-b")
    assert dispatch(other.id, engine=engine, registry=registry).outcome is Outcome.CONFIRMED
    assert len(remote.calls) == 1


def test_cap_admission_waits_for_the_keys_lock_and_counts_its_holders_move(
    engine: Engine,
) -> None:
    """A `sent` move asked of a cap of 1 while another transaction holds the key's lock waits
    for it, then counts that transaction's committed `sent` row (its snapshot is taken after
    the lock, not at the statement's start) and is held."""
    registry, remote = guarded(concurrency=Concurrency(max_in_flight=1))
    found = registry.get(TOOL)
    assert found is not None
    first, second = make_operation(engine), make_operation(engine)
    outcomes: list[Outcome] = []
    waiter = threading.Thread(
        target=lambda: outcomes.append(
            dispatch(second.id, engine=engine, registry=registry).outcome
        )
    )
    with engine.connect() as holder, holder.begin():
        admission = guard_state.admission(found.contract, first.target)
        assert guard_sql.admit(holder, admission).admitted
        transitions.apply(holder, transitions.mark_sent(first.id, attempt=0, reason="holder"))
        waiter.start()
        waiting = text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        deadline = time.monotonic() + 10
        with engine.connect() as watch:
            while not watch.execute(waiting).scalar_one() and time.monotonic() < deadline:
                time.sleep(0.01)
    waiter.join(10)
    assert outcomes == [Outcome.HELD]
    assert (reload(engine, second.id).attempts, remote.calls) == (0, [])


def test_guards_reset_closes_and_is_audited(engine: Engine) -> None:
    """`guards reset` closes an open breaker and clears the bucket, audited: who and why."""
    registry, remote = guarded(breaker=Breaker(failures=1), rate=Rate(per_second=1))
    remote.answer = lambda call: NotDelivered("refused")
    dispatch(make_operation(engine).id, engine=engine, registry=registry)
    contracts = [registry.get(TOOL).contract]  # type: ignore[union-attr]
    with engine.connect() as conn:
        listed = {(s.guard, s.key): s.state for s in guard_state.report(conn, contracts)}
    assert listed[("breaker", f"{TOOL}:project-a")]["state"] == "open"
    with engine.connect() as conn:
        done = guard_state.reset(
            conn, f"{TOOL}:project-a", by="ada", note="remote fixed", contracts=contracts
        )
    assert done.guards == ["breaker", "rate"]
    with engine.connect() as conn:
        listed = {(s.guard, s.key): s.state for s in guard_state.report(conn, contracts)}
        audit = conn.execute(
            text("SELECT guard, reset_by, note FROM outbox.guard_resets ORDER BY id")
        ).all()
    assert listed[("breaker", f"{TOOL}:project-a")]["state"] == "closed"
    assert [tuple(r) for r in audit] == [
        ("breaker", "ada", "remote fixed"),
        ("rate", "ada", "remote fixed"),
    ]


def test_metrics_show_breaker_state_bucket_and_in_flight_per_key(engine: Engine) -> None:
    """A scrape reports an open breaker (1), a bucket ahead of now, and attempts in flight."""
    registry, remote = guarded(breaker=Breaker(failures=1), rate=Rate(per_second=1, burst=1))
    remote.answer = lambda call: NotDelivered("refused")
    dispatch(make_operation(engine).id, engine=engine, registry=registry)
    make_operation(engine, State.SENT, target="project-b")
    collector = OutboxCollector(engine)
    assert collector.baseline()
    samples = scrape(collector)
    key = f"{TOOL}:project-a"
    assert samples("outbox_guard_breaker_state", scope="dispatch", key=key) == 1
    assert 0 < samples("outbox_guard_rate_ahead_seconds", key=key) <= 1
    assert samples("outbox_guard_in_flight", tool=TOOL, target="project-b") == 1


def test_lookup_breaker_defers_lookups_without_counting_them(engine: Engine) -> None:
    """Inconclusive lookups open the lookup breaker (not the dispatch one); while open, a
    lookup is deferred without asking the remote and without counting a check."""
    registry = ToolRegistry(ContractTable())
    charge = tool(
        TOOL,
        timeout=2,
        send_deadline=2,
        inflight_horizon=60,
        max_attempts=9,
        registry=registry,
        breaker=Breaker(failures=2, open_s=60),
    )(Remote())
    asked: list[str] = []

    @charge.lookup
    def _lookup(call: ToolCall) -> Inconclusive:
        asked.append(call.operation_id)
        return Inconclusive("503")

    ops = [make_operation(engine, State.UNKNOWN) for _ in range(3)]
    outcomes = [lookup(op.id, engine=engine, registry=registry).outcome for op in ops]
    assert outcomes == [LookupOutcome.RECHECK, LookupOutcome.RECHECK, LookupOutcome.DEFERRED]
    assert len(asked) == 2
    held = reload(engine, ops[2].id)
    assert (held.state, held.checks) == (State.UNKNOWN, 0)
    with engine.connect() as conn:
        scopes = conn.execute(text("SELECT scope, state FROM outbox.guard_breakers")).all()
    assert [tuple(r) for r in scopes] == [("lookup", "open")]
    assert dispatch(make_operation(engine).id, engine=engine, registry=registry).outcome is (
        Outcome.CONFIRMED
    )
