"""The kill matrix: every fault point x {``os._exit`` inside the process, SIGKILL from outside}.

Each case runs a few operations through real ``python -m outbox`` processes until one of them
dies exactly at the fault point (armed through ``OUTBOX_FAULTS``: ``exit@1`` ends the process
there; ``hang@1`` stops it there and the test SIGKILLs its process group once its log says so).
Then a fresh worker, relay and beat start without faults, and the reference service's own
ledger judges: every operation decided (confirmed, or `needs_human` for the one whose tool no
worker knows), one effect per confirmed operation, none for the others, never two.

The remote has no dedup window but answers lookups, so every ambiguous attempt is confirmed or
replayed by evidence. Where a crash leaves a lease that the system deliberately waits out (a
lookup's routing lease, a webhook delivery's lease: minutes, by design), the test lets that
time pass by moving the row's timestamp into the past, as DESIGN.md's "Time" prescribes.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api, faults
from outbox.dev.scenario import WebhookLog, webhook_receiver
from outbox.dev.service import DeployService
from tests.acceptance.conftest import clean_environment
from tests.processes import Service, Services, wait_until
from tests.tool_configs import TOOL, http_tool_toml

pytestmark = pytest.mark.slow

#: Operations per case: enough for a crash to strand some mid-flight and others untouched.
OPERATIONS = 3
#: A tool no worker registers: its operation goes to `needs_human` (the escalation webhook).
UNREGISTERED_TOOL = "deploy.unregistered"
SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
#: Every process of the stack: short timeouts so recovery takes seconds. The tool's total
#: deadline (1 s) stays below OUTBOX_SENT_TIMEOUT; its in-flight horizon is the smallest the
#: contract allows (send deadline + timeout + 5 s margin).
STACK_ENV = {
    "OUTBOX_SENT_TIMEOUT": "2",
    "OUTBOX_SENT_MAX_AGE": "60",
    "OUTBOX_SWEEP_INTERVAL": "1",
    "OUTBOX_REPUBLISH_AFTER": "2",
}
DECIDED = ("confirmed", "failed", "needs_human", "cancelled")


class Kill(enum.StrEnum):
    """How the armed process dies at the point."""

    EXIT = "os_exit"  #: the point calls os._exit inside the process
    SIGKILL = "sigkill"  #: the point hangs; the test SIGKILLs the process group from outside


class Stage(enum.StrEnum):
    """Which component passes the point, so which processes phase one needs."""

    RELAY = "relay"
    DIRECT = "direct"  #: a worker taking due operations itself (either broker)
    DISPATCH = "dispatch"
    SWEEP = "sweep"
    LOOKUP = "lookup"
    WEBHOOK = "webhook"


STAGES: dict[str, Stage] = {
    "relay_before_publish": Stage.RELAY,
    "relay_after_publish": Stage.RELAY,
    "relay_after_commit": Stage.RELAY,
    "direct_after_take": Stage.DIRECT,
    "lock_granted": Stage.DISPATCH,  # the first lock a stack takes is a dispatcher's
    "after_lock": Stage.DISPATCH,
    "after_sent_commit": Stage.DISPATCH,
    "after_call": Stage.DISPATCH,
    "after_outcome_commit": Stage.DISPATCH,
    "sweep_after_move": Stage.SWEEP,
    "lookup_after_call": Stage.LOOKUP,
    "lookup_after_commit": Stage.LOOKUP,
    "webhook_after_claim": Stage.WEBHOOK,
    "webhook_after_send": Stage.WEBHOOK,
}


def _cases() -> Iterator[Any]:
    for point in faults.POINTS:
        for kill in Kill:
            yield pytest.param((point, kill, "database"), id=f"{point}-{kill}-database")
            if STAGES.get(point) in (Stage.DISPATCH, Stage.DIRECT):
                yield pytest.param((point, kill, "rabbitmq"), id=f"{point}-{kill}-rabbitmq")


def test_every_fault_point_is_in_the_matrix() -> None:
    """Every registered fault point has a stage here, so the matrix covers all of them."""
    assert set(STAGES) == set(faults.POINTS)


# --- a webhook receiver that remembers every webhook-id -------------------------------------


@pytest.fixture
def receiver() -> Iterator[tuple[str, WebhookLog]]:
    """A local endpoint that verifies Standard Webhooks signatures; yields (url, log)."""
    with webhook_receiver(SECRET) as (url, log):
        yield url, log


# --- the stack ----------------------------------------------------------------------------


@pytest.fixture
def remote() -> Iterator[DeployService]:
    """The reference service without dedup (a second call is a second effect), with lookups;
    its delayed faults outlast the tool's 1 s deadline."""
    with DeployService(port=0, fault_delay_s=3.0) as running:
        yield running


@dataclass
class Stack:
    """The processes of one case, and what they need to start."""

    services: Services
    point: str
    kill: Kill

    def start(self, name: str, *args: str, armed: bool = False, **env: str) -> Service:
        """Start ``outbox ARGS``; ``armed`` arms the case's point in it for the first pass."""
        if armed:
            action = "exit" if self.kill is Kill.EXIT else "hang"
            env["OUTBOX_FAULTS"] = f"{self.point}={action}@1"
        return self.services.start(name, *args, env=env)

    def worker(self, name: str, queues: str, *, armed: bool = False, threads: int = 1) -> Service:
        """A worker on ``queues`` with a thread pool (one process: the whole worker dies)."""
        return self.start(
            name, "worker", "-Q", queues, "-c", str(threads), "-P", "threads", armed=armed
        )


@pytest.fixture
def stack(
    request: pytest.FixtureRequest,
    database_url: str,
    remote: DeployService,
    receiver: tuple[str, WebhookLog],
    tmp_path: Path,
) -> Iterator[Stack]:
    """The case's environment and process group; logs are printed if the test fails."""
    point, kill, broker = request.param
    config = tmp_path / "tools.toml"
    config.write_text(
        http_tool_toml(remote.url, timeout_s=1.0, send_deadline_s=1.0, inflight_horizon_s=7),
        encoding="utf-8",
    )
    env = clean_environment(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_CONFIG=str(config),
        OUTBOX_HOME=str(tmp_path / "home"),
        **STACK_ENV,
    )
    if broker == "rabbitmq":
        env["OUTBOX_BROKER_URL"] = str(request.getfixturevalue("rabbitmq_url"))
    if STAGES[point] is Stage.WEBHOOK:
        env |= {
            "OUTBOX_WEBHOOK_URL": receiver[0],
            "OUTBOX_WEBHOOK_SECRET": SECRET,
            "OUTBOX_WEBHOOK_EVENTS": "needs_human,confirmed",
        }
    group = Services(env, tmp_path)
    yield Stack(group, point, kill)
    for service in group.started:
        service.kill()  # the case is over: no need to wait for graceful shutdowns
    group.stop_all()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for name, output in group.logs():
            print(f"----- {name} -----\n{output[-6000:]}")  # noqa: T201


# --- the database's view ------------------------------------------------------------------


def _enqueue(engine: Engine, tools: list[str]) -> list[str]:
    with Session(engine) as session, session.begin():
        return [
            str(
                api.enqueue(
                    session, tool=tool, target=f"project-{i}", payload={"version": f"1.0.{i}"}
                ).id
            )
            for i, tool in enumerate(tools)
        ]


def _states(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id::text, state FROM outbox.operations"))
        return {str(op_id): str(state) for op_id, state in rows}


def _remote_refs(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id::text, remote_ref FROM outbox.operations WHERE state = 'confirmed'")
        )
        return {str(op_id): str(ref) for op_id, ref in rows}


def _deliveries(engine: Engine) -> dict[str, tuple[str, str]]:
    """Webhook delivery rows: id -> (status, operation id)."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id::text, status, operation_id::text FROM outbox.webhook_deliveries")
        )
        return {str(row_id): (str(status), str(op_id)) for row_id, status, op_id in rows}


def _let_leases_pass(engine: Engine) -> None:
    """Time passing: the leases a dead lookup or deliverer held end now, not in minutes."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox.operations SET next_check_at = clock_timestamp() "
                "WHERE state = 'unknown'"
            )
        )
        conn.execute(
            text(
                "UPDATE outbox.webhook_deliveries SET next_attempt_at = clock_timestamp() "
                "WHERE status = 'pending'"
            )
        )


# --- phase one: drive the point, and die there -------------------------------------------


def _drive(stack: Stack, stage: Stage) -> Service:
    """Start the processes that take an operation to the point; the armed one."""
    if stage is Stage.RELAY:
        return stack.start("relay-armed", "relay", armed=True)
    if stage is Stage.DIRECT:
        # No relay: the worker takes the due operations from the outbox itself.
        return stack.worker("worker-armed", "dispatch", armed=True)
    stack.start("relay", "relay")
    if stage is Stage.DISPATCH:
        return stack.worker("worker-armed", "dispatch", armed=True)
    if stage is Stage.SWEEP:
        # A dispatcher that dies after its `sent` commit leaves a stale row for the sweep.
        lost = stack.start(
            "worker-lost",
            "worker",
            "-Q",
            "dispatch",
            "-c",
            "1",
            "-P",
            "threads",
            OUTBOX_FAULTS="after_sent_commit=exit@1",
        )
        lost.process.wait(60)
        assert lost.process.returncode == faults.EXIT_STATUS, lost.output()
        stack.start("beat", "beat")
        return stack.worker("worker-armed", "reconcile", armed=True)
    stack.worker("worker-dispatch", "dispatch", threads=OPERATIONS)
    stack.start("beat", "beat")
    if stage is Stage.LOOKUP:
        stack.worker("worker-reconcile", "reconcile")
        return stack.worker("worker-armed", "lookup", armed=True)
    stack.worker("worker-reconcile", "reconcile,lookup")
    return stack.worker("worker-armed", "human", armed=True)


def _die_at_the_point(stack: Stack, armed: Service) -> None:
    """Wait until the armed process exited at the point, or hangs there and is SIGKILLed."""
    if stack.kill is Kill.EXIT:
        armed.process.wait(45)
        assert armed.process.returncode == faults.EXIT_STATUS, armed.output()
        return
    wait_until(
        lambda: f"fault point {stack.point}: hanging" in armed.output(),
        timeout=45,
        interval=0.05,
        what=f"{armed.name} to hang at {stack.point}",
    )
    armed.kill()


# --- the matrix ---------------------------------------------------------------------------


@pytest.mark.parametrize("stack", list(_cases()), indirect=True)
def test_a_process_killed_at_a_fault_point_loses_nothing_and_duplicates_nothing(
    engine: Engine, remote: DeployService, receiver: tuple[str, WebhookLog], stack: Stack
) -> None:
    """A component that dies at any fault point leaves every operation decided once a clean
    stack restarts: one remote effect per confirmed operation, none for the others."""
    stage = STAGES[stack.point]
    tools = [TOOL] * OPERATIONS
    if stage is Stage.WEBHOOK:
        tools[-1] = UNREGISTERED_TOOL  # escalated: its needs_human webhook
    ids = _enqueue(engine, tools)
    if stage is Stage.LOOKUP:
        # Ambiguous first attempts: one applied behind a timeout, one refused by a 503.
        remote.faults.arm_key(ids[0], "commit_then_timeout", 1)
        remote.faults.arm_key(ids[1], "error_503", 1)
    started = time.monotonic()
    _die_at_the_point(stack, _drive(stack, stage))
    crashed = time.monotonic()
    reached = set(remote.effects_by_key())
    stack.services.stop_all()
    _let_leases_pass(engine)

    stack.worker("worker", "dispatch,lookup,reconcile,human", threads=4)
    stack.start("relay", "relay")
    stack.start("beat", "beat")
    wait_until(
        lambda: all(state in DECIDED for state in _states(engine).values()),
        timeout=60,
        interval=0.2,
        what="every operation decided",
    )
    recovered = time.monotonic()

    states = _states(engine)
    expected = {
        op_id: "confirmed" if tool == TOOL else "needs_human"
        for op_id, tool in zip(ids, tools, strict=True)
    }
    assert states == expected
    effects = remote.effects_by_key()
    confirmed = {op_id for op_id, state in states.items() if state == "confirmed"}
    assert effects == dict.fromkeys(confirmed, 1)  # one each; none for the others
    assert reached <= confirmed
    assert _remote_refs(engine) == {e.key: e.id for e in remote.ledger()}
    if stage is Stage.WEBHOOK:
        _assert_webhooks_delivered(engine, receiver[1])
    print(  # noqa: T201 -- timings for the report
        f"{stack.point}/{stack.kill}: crash {crashed - started:.1f}s, "
        f"recovery {recovered - crashed:.1f}s"
    )


def _assert_webhooks_delivered(engine: Engine, received: WebhookLog) -> None:
    """Every delivery row is delivered, at least once, always under its own webhook-id."""
    wait_until(
        lambda: (
            bool(_deliveries(engine))
            and all(status == "delivered" for status, _ in _deliveries(engine).values())
        ),
        timeout=20,
        interval=0.2,
        what="every webhook delivered",
    )
    deliveries = _deliveries(engine)
    hooks = received.snapshot()
    assert received.invalid == 0
    assert {hook_id for hook_id, _, _ in hooks} == set(deliveries)
    for hook_id, _, op_id in hooks:
        assert deliveries[hook_id][1] == op_id
    assert {kind for _, kind, _ in hooks} == {"operation.confirmed", "operation.needs_human"}
