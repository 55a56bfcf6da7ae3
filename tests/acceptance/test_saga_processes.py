"""Sagas with real processes (relay, Celery workers, beat) against the reference service, whose
ledger judges: a refused step undoes the confirmed ones before it, once each and in reverse
order; an undecided step holds the undo until a lookup or an operator decides it; a confirmed
pivot, or a refused undo, turns a refusal into a person's decision; a saga without refusal
completes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from outbox.dev.service import DeployService
from outbox.sagas import SagaState
from outbox.states import State
from tests import saga_stack
from tests.acceptance.conftest import run_outbox
from tests.processes import Services, wait_until
from tests.saga_stack import (
    SECRET,
    SignedReceiver,
    Step,
    assert_undone_once_in_reverse,
    open_saga,
    rollbacks_of,
    signed_receiver,
    view,
)

pytestmark = pytest.mark.slow

#: The issue's three steps: a release, the load balancer, the announcement.
THREE = (Step("release", "web"), Step("point-lb", "lb"), Step("announce", "chat"))
REFUSED = {"_fault": "reject_422"}
#: Faults that hold a request (``slow``) or its answer (``commit_then_timeout``) outlast the
#: test: the tool's 1 s timeout always fires first, and a held ``slow`` never commits.
FAULT_DELAY_S = 300.0


@pytest.fixture
def service() -> Iterator[DeployService]:
    """The reference service without dedup (an undo sent twice is two effects), with
    lookups."""
    with DeployService(port=0, fault_delay_s=FAULT_DELAY_S) as running:
        yield running


@pytest.fixture
def receiver() -> Iterator[SignedReceiver]:
    """The webhook receiver, verifying signatures."""
    with signed_receiver() as receiving:
        yield receiving


@pytest.fixture
def stack_env(
    database_url: str,
    rabbitmq_url: str,
    service: DeployService,
    receiver: SignedReceiver,
    tmp_path: Path,
) -> dict[str, str]:
    """The stack's environment: both tools, short timeouts, webhooks to the receiver."""
    return saga_stack.stack_env(
        database_url,
        rabbitmq_url,
        tmp_path,
        service.url,
        OUTBOX_WEBHOOK_URL=receiver.url,
        OUTBOX_WEBHOOK_SECRET=SECRET,
    )


@pytest.fixture
def stack(services: Services) -> Services:
    """A relay, a worker on every queue and beat, running."""
    services.start("worker", "worker", "-c", "4", "-P", "threads")
    services.start("relay", "relay")
    services.start("beat", "beat")
    return services


def _state(engine: Engine, key: str) -> SagaState:
    return view(engine, key).state


def _steps(engine: Engine, key: str) -> list[State | None]:
    return [s.state for s in view(engine, key).steps]


@pytest.mark.timeout(180)
def test_a_refused_third_step_undoes_the_second_then_the_first_once_and_another_completes(
    engine: Engine, service: DeployService, receiver: SignedReceiver, stack: Services
) -> None:
    """Beside a saga that completes, a saga whose third step is refused ends `compensated`
    with its second then its first release rolled back, once each, and one signed
    saga.compensated webhook."""
    refused = open_saga(engine, "refused", [*THREE[:2], Step("announce", "chat", REFUSED)])
    open_saga(engine, "done", THREE)
    wait_until(
        lambda: (
            _state(engine, "refused") is SagaState.COMPENSATED
            and _state(engine, "done") is SagaState.COMPLETED
        ),
        timeout=120,
        what="one saga compensated and the other completed",
    )

    saga = view(engine, "refused")
    assert [s.state for s in saga.steps] == [State.CONFIRMED, State.CONFIRMED, State.FAILED]
    assert [s.compensation_state for s in saga.steps] == [State.CONFIRMED, State.CONFIRMED, None]
    assert_undone_once_in_reverse(
        service, saga, undone=["release", "point-lb"], not_applied=["announce"]
    )
    completed = view(engine, "done")
    assert [s.state for s in completed.steps] == [State.CONFIRMED] * 3
    assert rollbacks_of(service, completed) == []
    releases = [e.key for e in service.ledger() if e.kind == "release"]
    done_keys = [str(s.operation_id) for s in completed.steps]
    assert [key for key in releases if key in done_keys] == done_keys  # in saga order
    assert service.effects_by_key()[str(refused[0].id)] == 1

    wait_until(
        lambda: bool(receiver.about("saga.compensated", "refused")),
        timeout=30,
        what="the saga.compensated webhook",
    )
    (hook,) = {h.id: h for h in receiver.about("saga.compensated", "refused")}.values()
    assert hook.message["data"]["state"] == "compensated"
    assert [s["name"] for s in hook.message["data"]["steps"]] == [s.name for s in THREE]
    assert receiver.about("saga.compensated", "done") == []
    assert receiver.about("saga.needs_human", "refused") == []
    assert receiver.invalid() == 0


@pytest.mark.timeout(180)
def test_an_undecided_step_holds_the_undo_until_a_lookup_or_an_operator_decides_it(
    engine: Engine,
    service: DeployService,
    stack: Services,
    stack_env: dict[str, str],
) -> None:
    """A step whose call timed out holds its saga's undo while lookups cannot decide it; a
    lookup that finds it applied has it rolled back before the step before it, and a step an
    operator resolves "not applied" is not rolled back while the confirmed one before it is."""
    service.lookup_enabled = False  # every lookup answers 501: inconclusive
    held = open_saga(
        engine,
        "held",
        [
            Step("release", "web"),
            Step("point-lb", "lb", group="out"),
            Step("announce", "chat", REFUSED, group="out"),
        ],
    )
    resolved = open_saga(
        engine,
        "resolved",
        [
            Step("release", "web"),
            Step("point-lb", "lb", group="out"),
            Step("announce", "chat", REFUSED, group="out"),
        ],
    )
    # Applied, but the answer never comes; and sent, but never applied.
    service.faults.arm_key(str(held[1].id), "commit_then_timeout", 1)
    service.faults.arm_key(str(resolved[1].id), "slow", 1)
    undecided = [State.CONFIRMED, State.UNKNOWN, State.FAILED]
    wait_until(
        lambda: _steps(engine, "held") == undecided and _steps(engine, "resolved") == undecided,
        timeout=60,
        what="both sagas' second step unknown and third failed",
    )
    wait_until(
        lambda: service.stats.snapshot()["lookups"]["disabled"] >= 4,
        timeout=60,
        what="lookups that cannot decide",
    )
    for key in ("held", "resolved"):
        _pass_over_again(engine, key)
        saga = view(engine, key)
        # Still running (refused, not yet unwinding: the table waits before it moves).
        assert saga.state in (SagaState.RUNNING, SagaState.COMPENSATING)
        assert "waiting for step point-lb (unknown)" in (saga.reason or "")
        assert rollbacks_of(service, saga) == []
        assert all(s.compensation_operation_id is None for s in saga.steps)
    assert [e.kind for e in service.ledger()] == ["release"] * 3  # 2 first steps, held's b

    def resolve() -> bool:
        answer = run_outbox(
            "ops",
            "resolve",
            str(resolved[1].id),
            "--not-applied",
            "--by",
            "alice",
            "--note",
            "no such release in the deploy console",
            env=stack_env,
        )
        assert answer.code in (0, 1), answer.stderr
        return answer.code == 0

    wait_until(resolve, timeout=60, interval=1.0, what="the in-flight horizon, then a verdict")
    wait_until(
        lambda: _state(engine, "resolved") is SagaState.COMPENSATED,
        timeout=60,
        what="the resolved saga compensated",
    )
    assert _state(engine, "held") in (SagaState.RUNNING, SagaState.COMPENSATING)
    assert rollbacks_of(service, view(engine, "held")) == []

    service.lookup_enabled = True
    with engine.begin() as conn:  # time passing: the next check is due now, not in minutes
        conn.execute(
            text("UPDATE outbox.operations SET next_check_at = clock_timestamp() WHERE id = :id"),
            {"id": held[1].id},
        )
    wait_until(
        lambda: _state(engine, "held") is SagaState.COMPENSATED,
        timeout=60,
        what="the held saga compensated",
    )

    saga = view(engine, "held")
    assert [s.state for s in saga.steps] == [State.CONFIRMED, State.CONFIRMED, State.FAILED]
    assert_undone_once_in_reverse(
        service, saga, undone=["release", "point-lb"], not_applied=["announce"]
    )
    saga = view(engine, "resolved")
    assert [s.state for s in saga.steps] == [State.CONFIRMED, State.FAILED, State.FAILED]
    assert_undone_once_in_reverse(
        service, saga, undone=["release"], not_applied=["point-lb", "announce"]
    )


@pytest.mark.timeout(180)
def test_a_refusal_after_a_confirmed_pivot_or_a_refused_undo_needs_a_human(
    engine: Engine, service: DeployService, receiver: SignedReceiver, stack: Services
) -> None:
    """A third step refused after a confirmed pivot leaves its saga `needs_human` with the
    pivot named and nothing rolled back; a refused rollback leaves its saga `needs_human`
    after the one rollback before it; each gets one signed saga.needs_human webhook."""
    pivot = open_saga(
        engine,
        "pivot",
        [
            Step("release", "web"),
            Step("migrate", "db", pivot=True),
            Step("announce", "chat", REFUSED),
        ],
    )
    stuck = open_saga(
        engine,
        "stuck",
        [
            Step("release", "web", undo_extra=REFUSED),
            Step("point-lb", "lb"),
            Step("announce", "chat", REFUSED),
        ],
    )
    wait_until(
        lambda: (
            _state(engine, "pivot") is SagaState.NEEDS_HUMAN
            and _state(engine, "stuck") is SagaState.NEEDS_HUMAN
        ),
        timeout=90,
        what="both sagas to need a human",
    )
    wait_until(
        lambda: (
            bool(receiver.about("saga.needs_human", "pivot"))
            and bool(receiver.about("saga.needs_human", "stuck"))
        ),
        timeout=30,
        what="the saga.needs_human webhooks",
    )
    _pass_over_again(engine, "pivot")
    _pass_over_again(engine, "stuck")

    saga = view(engine, "pivot")
    assert saga.state is SagaState.NEEDS_HUMAN
    assert "after pivot migrate" in (saga.reason or "")
    assert [s.state for s in saga.steps] == [State.CONFIRMED, State.CONFIRMED, State.FAILED]
    assert all(s.compensation_operation_id is None for s in saga.steps)
    assert rollbacks_of(service, saga) == []
    counts = service.effects_by_key()
    assert [counts.get(str(op.id), 0) for op in pivot] == [1, 1, 0]

    saga = view(engine, "stuck")
    assert saga.state is SagaState.NEEDS_HUMAN
    assert "the compensation of step release was refused" in (saga.reason or "")
    assert [s.compensation_state for s in saga.steps] == [State.FAILED, State.CONFIRMED, None]
    (undone,) = rollbacks_of(service, saga)
    assert (undone.key, undone.payload["release"]) == (
        str(saga.steps[1].compensation_operation_id),
        saga.steps[1].remote_ref,
    )
    assert [counts.get(str(op.id), 0) for op in stuck] == [1, 1, 0]
    assert counts.get(str(saga.steps[0].compensation_operation_id), 0) == 0
    assert [e.kind for e in service.ledger()].count("rollback") == 1

    for key, reason in (("pivot", "after pivot migrate"), ("stuck", "was refused")):
        hooks = {h.id: h for h in receiver.about("saga.needs_human", key)}
        assert len(hooks) == 1, key
        (hook,) = hooks.values()
        assert reason in hook.message["data"]["reason"]
        assert receiver.about("saga.compensated", key) == []
    assert receiver.invalid() == 0


def _pass_over_again(engine: Engine, key: str) -> None:
    """Time passing: the saga's next check is due now; wait until the periodic pass looked
    at it (and scheduled the next one)."""
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox.sagas SET next_check_at = clock_timestamp() WHERE key = :key"),
            {"key": key},
        )

    def rescheduled() -> bool:
        with engine.connect() as conn:
            return bool(
                conn.execute(
                    text(
                        "SELECT next_check_at > clock_timestamp() FROM outbox.sagas "
                        "WHERE key = :key"
                    ),
                    {"key": key},
                ).scalar()
            )

    wait_until(rescheduled, timeout=30, what=f"a pass of the driver over saga {key}")
