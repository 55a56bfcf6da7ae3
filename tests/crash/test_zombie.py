"""The zombie dispatcher: a worker whose database connection is cut while its call is in flight.

The worker does not die. Its database session is gone (``pg_terminate_backend`` on the backend
holding the operation's advisory lock, as a network partition or a failover would end it), so
the lock is free and, to everyone else, the dispatcher is lost; but the process is only frozen
(SIGSTOP on its process group) with its request out at the remote, and it wakes up later
(SIGCONT) holding an answer about an attempt that the rest of the system has moved past.

Real processes (``outbox relay``, ``outbox worker``, ``outbox beat`` on the database broker)
against the reference service in this process, whose ``slow`` fault keeps the zombie's
request in flight for :data:`REMOTE_DELAY_S` before committing it. Two properties:

(a) no second request before the tool's in-flight horizon, counted from the attempt's
    ``sent_at``: a lookup that finds nothing waits for the horizon, and a dedup replay that is
    not concurrent-safe leaves only after it (its ``sent_at`` compared with the first one,
    both written by the database clock);
(b) the zombie's late outcome never overwrites a later verdict or a later attempt: woken after
    the verdict, it leaves the row exactly as it was and adds one "late outcome of attempt 1"
    event; woken while attempt 2 is itself `sent` (only the attempt fence tells the two apart),
    it adds that event and attempt 2 carries on. The remote's ledger holds exactly one effect.

A zombie frozen past its total deadline wakes to that deadline (``asyncio.timeout`` runs on the
monotonic clock, which a stopped process does not stop), so its late outcome is "ambiguous:
exceeded the total deadline", even though the remote's answer is waiting in its socket; the
tests accept any outcome of the zombie's and judge only what it does to the row.

The reconciling worker and beat run from the start (a worker's start-up takes seconds, which
would otherwise decide whether the first lookup lands before or after the remote commits);
the replacement dispatcher starts once the zombie is frozen, so a replay would really leave.
Processes start one at a time, each once its log says it is up: on a fresh database, several
processes opening the database broker at once race in kombu's unlocked table creation
(``CREATE SEQUENCE queue_id_sequence``: duplicate key), and the loser dies at start-up.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from uuid import UUID

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api, sql
from outbox.dev.service import DeployService
from outbox.locks import operation_lock_key
from outbox.logs import Action
from outbox.models import Event, Operation
from outbox.states import State
from tests.acceptance.conftest import clean_environment
from tests.processes import Service, Services, wait_until
from tests.tool_configs import TOOL, http_tool_toml

pytestmark = pytest.mark.slow

#: The tool's total deadline per call; the zombie must be frozen before it fires.
TIMEOUT_S = 2.0
SEND_DEADLINE_S = 1.0
#: The smallest horizon the contract leaves room for (send deadline + timeout + 5 s margin is
#: 8 s), plus slack so the remote's delay below fits well inside it.
HORIZON_S = 10.0
#: How long the remote holds a `slow` request before committing it: after the first lookup
#: (sent_at + OUTBOX_SENT_TIMEOUT + a sweep interval), before the horizon, as the contract says.
REMOTE_DELAY_S = 7.0
#: The zombie's database backend is recognisable by this application_name (libpq's PGAPPNAME).
ZOMBIE_APP = "outbox-zombie"
STACK_ENV = {
    "OUTBOX_SENT_TIMEOUT": "3",  # must exceed timeout_s
    "OUTBOX_SENT_MAX_AGE": "60",  # must be at least the horizon
    "OUTBOX_SWEEP_INTERVAL": "1",
    "OUTBOX_REPUBLISH_AFTER": "2",
}


# --- the stack ----------------------------------------------------------------------------


@dataclass
class Stack:
    """The remote, the database and the processes of one test."""

    engine: Engine
    remote: DeployService
    services: Services

    def start(self, name: str, *args: str, ready: str, **env: str) -> Service:
        """Start ``outbox ARGS`` as ``name`` and wait until its log matches ``ready``.

        One at a time: on a fresh database, kombu's SQLAlchemy transport creates its tables
        and queue rows without any lock, so processes connecting to the database broker for
        the first time all at once can die of a duplicate-key error (see the module doc).
        """
        service = self.services.start(name, *args, env=env)
        wait_until(
            lambda: re.search(ready, service.output()) is not None or not service.alive(),
            timeout=60,
            interval=0.05,
            what=f"{name} to start",
        )
        assert service.alive(), service.output()[-4000:]
        return service

    def worker(self, name: str, queues: str, **env: str) -> Service:
        """``outbox worker -Q queues`` with two threads, named ``name``, once it is ready."""
        return self.start(
            name,
            "worker",
            *("-Q", queues, "-c", "2", "-P", "threads", "-n", f"{name}@%h"),
            ready=rf"{name}@\S+ ready\.",
            **env,
        )


def _tool_toml(url: str, contract: str) -> str:
    common = {
        "timeout_s": TIMEOUT_S,
        "send_deadline_s": SEND_DEADLINE_S,
        "inflight_horizon_s": HORIZON_S,
        "max_attempts": 5,
    }
    if contract == "lookup":
        return http_tool_toml(url, lookup=True, **common)
    return http_tool_toml(
        url,
        lookup=False,
        dedup_window_s=3600.0,
        dedup_margin_s=60.0,
        dedup_concurrent_safe=False,
        **common,
    )


@pytest.fixture
def stack(
    request: pytest.FixtureRequest, engine: Engine, database_url: str, tmp_path: Path
) -> Iterator[Stack]:
    """The remote for ``request.param`` ("lookup": lookups, no dedup, so a second request is
    a second effect; "dedup": a dedup window, no lookups) and an empty process group.

    Teardown resumes every process before killing it, so nothing is left frozen."""
    contract = str(request.param)
    window = 3600.0 if contract == "dedup" else None
    with DeployService(port=0, dedup_window_s=window, fault_delay_s=REMOTE_DELAY_S) as remote:
        config = tmp_path / "tools.toml"
        config.write_text(_tool_toml(remote.url, contract), encoding="utf-8")
        env = clean_environment(
            OUTBOX_DATABASE_URL=database_url,
            OUTBOX_CONFIG=str(config),
            OUTBOX_HOME=str(tmp_path / "home"),
            **STACK_ENV,
        )
        group = Services(env, tmp_path)
        try:
            yield Stack(engine, remote, group)
        finally:
            for service in group.started:
                _signal_group(service, signal.SIGCONT)
                service.kill()
            group.stop_all()
            report = getattr(request.node, "rep_call", None)
            if report is not None and report.failed:
                for name, output in group.logs():
                    print(f"----- {name} -----\n{output[-8000:]}")  # noqa: T201


# --- freezing and cutting -----------------------------------------------------------------


def _signal_group(service: Service, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(service.pid, signum)


def _process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``T``: stopped), ``?`` if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii")
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[0]


def _freeze(service: Service) -> None:
    _signal_group(service, signal.SIGSTOP)
    wait_until(
        lambda: _process_state(service.pid) == "T",
        timeout=5,
        interval=0.01,
        what=f"{service.name} to stop",
    )


def _thaw(service: Service) -> None:
    _signal_group(service, signal.SIGCONT)


def _cut_lock_connection(engine: Engine, op_id: str) -> None:
    """Terminate the backend holding the operation's lock (it must be the zombie's)."""
    key = operation_lock_key(op_id)
    with engine.connect() as conn:
        pid = sql.locks.lock_holder_pid(conn, key)
        assert pid is not None, "nobody holds the operation's lock: the dispatcher let go early"
        app_name = conn.execute(
            text("SELECT application_name FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid}
        ).scalar_one()
        assert app_name == ZOMBIE_APP, f"the lock is held by {app_name!r}, not the zombie"
        assert conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid}).scalar_one()
        conn.commit()

    def lock_free() -> bool:
        with engine.connect() as conn:
            return sql.locks.lock_holder_pid(conn, key) is None

    wait_until(lock_free, timeout=10, interval=0.02, what="the zombie's lock to be freed")


# --- the database's view ------------------------------------------------------------------


def _operation(engine: Engine, op_id: str) -> Operation:
    with engine.connect() as conn:
        op = sql.intents.get_operation(conn, UUID(op_id))
    assert op is not None
    return op


def _events(engine: Engine, op_id: str) -> list[Event]:
    with engine.connect() as conn:
        return sql.intents.list_events(conn, UUID(op_id))


def _at(engine: Engine, op_id: str, state: State, attempts: int) -> bool:
    op = _operation(engine, op_id)
    return op.state is state and op.attempts == attempts


def _transitions(events: list[Event]) -> list[tuple[str | None, str, int, str]]:
    """(from, to, attempt, actor) of the events that changed the state."""
    return [
        (None if e.from_state is None else e.from_state.value, e.to_state.value, e.attempt, e.actor)
        for e in events
        if e.from_state is not e.to_state
    ]


def _late_events(engine: Engine, op_id: str) -> list[Event]:
    return [e for e in _events(engine, op_id) if e.reason.startswith("late outcome of attempt")]


def _waits_for_the_horizon(engine: Engine, op_id: str, attempts: int) -> bool:
    """`unknown` at ``attempts``, next check exactly at that attempt's sent_at + horizon."""
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text(
                    "SELECT EXISTS (SELECT FROM outbox.operations WHERE id = :id "
                    "AND state = 'unknown' AND attempts = :attempts "
                    "AND next_check_at = sent_at + make_interval(secs => :horizon))"
                ),
                {"id": op_id, "attempts": attempts, "horizon": HORIZON_S},
            ).scalar_one()
        )


# --- the scenario's first half: a dispatcher frozen mid-call, its session cut --------------


def _strand_a_zombie(stack: Stack, *, slow_requests: int) -> tuple[str, Service]:
    """Freeze a dispatcher whose request is at the remote, and cut its database session.

    The first ``slow_requests`` requests for the operation's key take REMOTE_DELAY_S at the
    remote. Returns the operation id and the frozen worker; a replacement dispatcher is
    started once the zombie is frozen.
    """
    zombie = stack.worker("zombie", "dispatch", PGAPPNAME=ZOMBIE_APP)
    stack.worker("reconciler", "reconcile,lookup")
    stack.start("relay", "relay", ready=Action.RELAY_STARTED)
    stack.start("beat", "beat", ready="beat: Starting")
    with Session(stack.engine) as session, session.begin():
        op_id = str(api.enqueue(session, tool=TOOL, target="web", payload={"version": "3.1.4"}).id)
        # Armed before the commit: no dispatcher can see the operation before its fault.
        stack.remote.faults.arm_key(op_id, "slow", slow_requests)
    wait_until(
        lambda: op_id in stack.remote.in_flight(),
        timeout=60,
        interval=0.01,
        what="the zombie's request to reach the remote",
    )
    _freeze(zombie)  # well inside its 2 s deadline, so it has recorded nothing yet
    op = _operation(stack.engine, op_id)
    assert (op.state, op.attempts) == (State.SENT, 1), "the zombie moved on before it froze"
    _cut_lock_connection(stack.engine, op_id)
    stack.worker("dispatcher", "dispatch")
    return op_id, zombie


#: Celery's line for a finished dispatch task, with what :func:`outbox.workers.dispatch.dispatch`
#: reported: ``late`` when its outcome write missed and became an event.
_TASK_ENDED = re.compile(r"outbox\.dispatch\[[^\]]+\] (?:succeeded in \S+: '(\w+)'|raised)")


def _wake_and_let_it_write(stack: Stack, zombie: Service, op_id: str) -> Event:
    """SIGCONT the zombie and wait for its dispatch task to end; its late-outcome event."""
    assert _process_state(zombie.pid) == "T", "the zombie was not frozen all along"
    assert not _late_events(stack.engine, op_id)
    _thaw(zombie)
    wait_until(
        lambda: _TASK_ENDED.search(zombie.output()) is not None,
        timeout=20,
        interval=0.05,
        what="the zombie's dispatch task to end",
    )
    ended = _TASK_ENDED.search(zombie.output())
    assert ended is not None
    events = _events(stack.engine, op_id)
    assert ended.group(1) == "late", (
        f"the zombie's outcome for attempt 1 was not refused as late: {ended.group(0)!r}; "
        f"transitions: {_transitions(events)}\n{zombie.output()[-4000:]}"
    )
    [late] = _late_events(stack.engine, op_id)
    assert late.attempt == 1
    assert late.actor == "dispatcher"
    assert late.from_state is late.to_state  # an event, not a move
    return late


# --- the tests ----------------------------------------------------------------------------


@pytest.mark.parametrize("stack", ["lookup"], indirect=True)
def test_a_zombie_with_a_lookup_tool_waits_for_the_horizon_and_its_late_answer_changes_nothing(
    stack: Stack,
) -> None:
    """Lookup tool, no dedup at the remote (a second request would be a second effect).

    The sweep finds the zombie's `sent` row with its lock free (dispatcher lost); the lookup
    before the remote commits answers 404 and the reconciler waits for the horizon instead of
    replaying; after it, the lookup finds the effect. The zombie wakes after that verdict, and
    its answer about attempt 1 changes nothing but the log.
    """
    engine, remote = stack.engine, stack.remote
    op_id, zombie = _strand_a_zombie(stack, slow_requests=1)

    # (a) Before the remote commits, a lookup says "not applied": wait for the horizon.
    wait_until(
        lambda: (
            remote.stats.snapshot()["lookups"]["missing"] >= 1
            and _waits_for_the_horizon(engine, op_id, 1)
        ),
        timeout=REMOTE_DELAY_S,
        interval=0.05,
        what="a lookup before the remote committed, and a wait for the horizon",
    )
    wait_until(
        lambda: remote.effects_by_key().get(op_id) == 1,
        timeout=REMOTE_DELAY_S + 5,
        what="the zombie's request to land at the remote",
    )
    assert _at(engine, op_id, State.UNKNOWN, 1), "decided before the horizon"
    wait_until(
        lambda: _operation(engine, op_id).state is State.CONFIRMED,
        timeout=HORIZON_S + 10,
        interval=0.1,
        what="the lookup after the horizon to confirm",
    )
    confirmed = _operation(engine, op_id)
    [effect] = [e for e in remote.ledger() if e.key == op_id]
    assert (confirmed.attempts, confirmed.remote_ref) == (1, effect.id)
    assert confirmed.sent_at is not None
    before = _events(engine, op_id)
    assert _transitions(before) == [
        (None, "planned", 0, "agent"),
        ("planned", "sent", 1, "dispatcher"),
        ("sent", "unknown", 1, "sweep"),
        ("unknown", "confirmed", 1, "reconciler"),
    ]
    assert before[2].reason.startswith("dispatcher lost")
    assert before[-1].reason == f"lookup: applied at the remote ({effect.id})"
    assert before[-1].at >= confirmed.sent_at + timedelta(seconds=HORIZON_S)

    # (b) The zombie wakes up with its answer about attempt 1.
    late = _wake_and_let_it_write(stack, zombie, op_id)
    assert late.to_state is State.CONFIRMED
    assert _operation(engine, op_id) == confirmed
    assert _events(engine, op_id) == [*before, late]
    assert remote.effects_by_key() == {op_id: 1}
    stats = remote.stats.snapshot()
    assert (stats["created"], stats["deduplicated"], stats["faulted"]["slow"]) == (1, 0, 1)
    assert remote.in_flight() == []


@pytest.mark.parametrize("stack", ["dedup"], indirect=True)
def test_a_zombie_with_a_dedup_tool_is_replayed_only_after_the_horizon(stack: Stack) -> None:
    """Dedup window, no lookup, not concurrent-safe: the reconciler waits for the horizon,
    then replays (attempt 2), which the remote deduplicates. The zombie wakes after attempt
    2's verdict, and its answer about attempt 1 changes nothing but the log."""
    engine, remote = stack.engine, stack.remote
    op_id, zombie = _strand_a_zombie(stack, slow_requests=1)

    # (a) Dispatcher lost, and no replay while the zombie's request may still land.
    wait_until(
        lambda: _waits_for_the_horizon(engine, op_id, 1),
        timeout=REMOTE_DELAY_S,
        interval=0.05,
        what="the reconciler to wait for the horizon",
    )
    wait_until(
        lambda: _operation(engine, op_id).state is State.CONFIRMED,
        timeout=HORIZON_S + 15,
        interval=0.1,
        what="the replay to be confirmed",
    )
    confirmed = _operation(engine, op_id)
    [effect] = remote.ledger()
    assert (confirmed.attempts, confirmed.remote_ref, effect.key) == (2, effect.id, op_id)
    assert confirmed.sent_at is not None
    assert confirmed.first_sent_at is not None
    horizon_at = confirmed.first_sent_at + timedelta(seconds=HORIZON_S)
    # first_sent_at is attempt 1's sent_at; sent_at is the replay's `sent` commit, which
    # precedes its request: both written by the database clock.
    assert confirmed.sent_at >= horizon_at, (confirmed.first_sent_at, confirmed.sent_at)
    before = _events(engine, op_id)
    assert _transitions(before) == [
        (None, "planned", 0, "agent"),
        ("planned", "sent", 1, "dispatcher"),
        ("sent", "unknown", 1, "sweep"),
        ("unknown", "planned", 1, "reconciler"),
        ("planned", "sent", 2, "dispatcher"),
        ("sent", "confirmed", 2, "dispatcher"),
    ]
    replayed, sent_again = before[3], before[4]
    assert "replay with the same key inside the dedup window" in replayed.reason
    assert replayed.at >= horizon_at
    assert sent_again.at >= horizon_at
    stats = remote.stats.snapshot()
    assert (stats["created"], stats["deduplicated"], stats["faulted"]["slow"]) == (1, 1, 1)

    # (b) The zombie wakes up with its answer about attempt 1.
    late = _wake_and_let_it_write(stack, zombie, op_id)
    assert late.to_state is State.CONFIRMED
    assert _operation(engine, op_id) == confirmed
    assert _events(engine, op_id) == [*before, late]
    assert remote.effects_by_key() == {op_id: 1}
    assert remote.stats.snapshot()["created"] == 1
    assert remote.in_flight() == []


@pytest.mark.parametrize("stack", ["dedup"], indirect=True)
def test_a_zombie_waking_during_the_next_attempt_leaves_it_alone(stack: Stack) -> None:
    """The zombie wakes while attempt 2 is itself in flight (`sent`, attempt 2): its outcome
    for attempt 1 must not land on attempt 2 (only the attempt fence can tell the two apart,
    as both are `sent`). Attempt 2 is slow too, times out and is replayed after its own
    horizon; the remote deduplicates both replays into the zombie's one effect."""
    engine, remote = stack.engine, stack.remote
    op_id, zombie = _strand_a_zombie(stack, slow_requests=2)

    wait_until(
        lambda: _at(engine, op_id, State.SENT, 2) and op_id in remote.in_flight(),
        timeout=HORIZON_S + 15,
        interval=0.02,
        what="attempt 2 to be in flight",
    )
    second = _operation(engine, op_id)
    assert second.sent_at is not None
    assert second.first_sent_at is not None
    assert second.sent_at >= second.first_sent_at + timedelta(seconds=HORIZON_S)

    # (b) The zombie's late write lands while attempt 2 is `sent` and changes nothing.
    late = _wake_and_let_it_write(stack, zombie, op_id)
    assert late.to_state is State.SENT, "attempt 2 ended before the zombie wrote"

    wait_until(
        lambda: _operation(engine, op_id).state is State.CONFIRMED,
        timeout=HORIZON_S + 15,
        interval=0.1,
        what="attempt 3 to be confirmed",
    )
    done = _operation(engine, op_id)
    [effect] = remote.ledger()
    assert (done.attempts, done.remote_ref, effect.key) == (3, effect.id, op_id)
    assert done.sent_at is not None
    # (a) Each replay left only after the previous attempt's horizon.
    assert done.sent_at >= second.sent_at + timedelta(seconds=HORIZON_S)
    events = _events(engine, op_id)
    assert _transitions(events) == [
        (None, "planned", 0, "agent"),
        ("planned", "sent", 1, "dispatcher"),
        ("sent", "unknown", 1, "sweep"),
        ("unknown", "planned", 1, "reconciler"),
        ("planned", "sent", 2, "dispatcher"),
        ("sent", "unknown", 2, "dispatcher"),  # attempt 2's own timeout, not the zombie's
        ("unknown", "planned", 2, "reconciler"),
        ("planned", "sent", 3, "dispatcher"),
        ("sent", "confirmed", 3, "dispatcher"),
    ]
    # The zombie's event sits between attempt 2's `sent` and attempt 2's own outcome.
    position = events.index(late)
    assert (events[position - 1].to_state, events[position - 1].attempt) == (State.SENT, 2)
    assert (events[position + 1].from_state, events[position + 1].attempt) == (State.SENT, 2)
    assert events[position + 1].reason.startswith("ambiguous: exceeded the total deadline")
    assert len(_late_events(engine, op_id)) == 1
    stats = remote.stats.snapshot()
    assert (stats["created"], stats["deduplicated"], stats["faulted"]["slow"]) == (1, 2, 2)
    assert remote.in_flight() == []
