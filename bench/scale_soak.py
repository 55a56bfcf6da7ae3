"""The soak's pipeline: paced agents, the real relay, simulated dispatch, the sweep and its
lookups, on threads; what each window collected.
"""

from __future__ import annotations

import argparse
import functools
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from scale_data import TOOL
from scale_paths import BATCH, REPUBLISH_AFTER_S, lookup_registry
from sqlalchemy import Connection, Engine, event
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from outbox import api, sql, transitions
from outbox.db import create_engine
from outbox.errors import StaleTransition
from outbox.reconcilers.sweep import SweepConfig, Sweeper
from outbox.relay import OutboundMessage, Relay, RelayConfig, RelayResult
from outbox.states import Actor, State


@dataclass
class Window:
    """What happened in one window of the soak."""

    claims: list[float] = field(default_factory=list)
    passes: list[float] = field(default_factory=list)
    sweeps: list[float] = field(default_factory=list)
    enqueued: int = 0
    done: int = 0


class Recorder:
    """Thread-safe per-window collection; :meth:`cut` starts a new window."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._window = Window()
        #: The relay's claim as it last ran: (SQL, parameters), for EXPLAIN.
        self.claim_statement: tuple[str, Any] | None = None

    def claim(self, seconds: float) -> None:
        """One claim statement's latency."""
        with self._lock:
            self._window.claims.append(seconds)

    def relay_pass(self, seconds: float) -> None:
        """One ``Relay.run_once``."""
        with self._lock:
            self._window.passes.append(seconds)

    def sweep(self, seconds: float) -> None:
        """One ``Sweeper.run_once``."""
        with self._lock:
            self._window.sweeps.append(seconds)

    def enqueued(self) -> None:
        """One intent committed."""
        with self._lock:
            self._window.enqueued += 1

    def done(self) -> None:
        """One operation terminal."""
        with self._lock:
            self._window.done += 1

    def cut(self) -> Window:
        """The window so far; a new one begins."""
        with self._lock:
            window, self._window = self._window, Window()
        return window


class QueuePublisher:
    """Hands every message to the simulated workers' queue and confirms it."""

    def __init__(self, inbox: queue.Queue[OutboundMessage]) -> None:
        self.inbox = inbox

    def publish(self, messages: Sequence[OutboundMessage]) -> set[UUID]:
        """Queue and confirm all of ``messages``."""
        for message in messages:
            self.inbox.put(message)
        return {m.operation_id for m in messages}

    def close(self) -> None:
        """Nothing to release."""


class TimedRelay(Relay):
    """The real relay; each ``run_once`` timed."""

    recorder: Recorder

    def run_once(self) -> RelayResult:
        """``Relay.run_once``, timed."""
        started = time.perf_counter()
        result = super().run_once()
        if result.claimed:
            self.recorder.relay_pass(time.perf_counter() - started)
        return result


def time_claims(engine: Engine, recorder: Recorder) -> None:
    """Time every execution of the claim statement on ``engine`` (at the driver); keep the
    last one's SQL and parameters in ``recorder.claim_statement``."""

    def before(conn: Connection, *_: Any) -> None:
        conn.info["bench_started"] = time.perf_counter()

    def after(conn: Connection, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        started = conn.info.pop("bench_started", None)
        if started is not None and "SKIP LOCKED" in statement:
            recorder.claim(time.perf_counter() - started)
            recorder.claim_statement = (statement, parameters)

    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "after_cursor_execute", after)


class Soak:
    """The pipeline of the soak: agents, the relay, simulated dispatch, the sweep, lookups."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.args = args
        self.rate: float = args.soak_rate
        threads = args.soak_agents + args.soak_workers
        self.engine = create_engine(url, pool_size=threads + 2, max_overflow=4)
        self.relay_engine = create_engine(url, pool_size=2, max_overflow=2)
        self.recorder = Recorder()
        self.inbox: queue.Queue[OutboundMessage] = queue.Queue()
        self.lookups: queue.Queue[UUID] = queue.Queue()
        self.stop = threading.Event()
        #: Set while the simulated workers take no message (--soak-pause): an outage.
        self.paused = threading.Event()
        self.errors: list[BaseException] = []
        self.tag = uuid.uuid4().hex[:8]
        self.relay = TimedRelay(
            self.relay_engine,
            QueuePublisher(self.inbox),
            RelayConfig(batch_size=BATCH, republish_after_s=REPUBLISH_AFTER_S),
        )
        self.relay.recorder = self.recorder
        time_claims(self.relay_engine, self.recorder)
        self.sweeper = Sweeper(
            self.engine,
            registry=lookup_registry(),
            config=SweepConfig(sent_timeout_s=5.0, sent_max_age_s=600.0, lookup_lease_s=30.0),
            request_lookup=self.lookups.put,
        )
        self._threads: list[threading.Thread] = []
        self._started = 0.0

    def start(self) -> None:
        """Start every thread; the agents' schedule begins now."""
        self._started = time.perf_counter()
        agents = self.args.soak_agents
        targets: list[tuple[str, Callable[[], None]]] = [
            ("relay", self.relay.run_forever),
            ("sweep", self._sweep_loop),
            ("lookups", self._lookup_loop),
        ]
        targets += [
            (f"agent-{i}", functools.partial(self._agent, i, agents)) for i in range(agents)
        ]
        targets += [(f"worker-{i}", self._worker) for i in range(self.args.soak_workers)]
        for name, target in targets:
            thread = threading.Thread(target=self._guard(target), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def finish(self) -> None:
        """Stop every thread and the engines."""
        self.stop.set()
        self.relay.stop()
        for thread in self._threads:
            thread.join(30)
        self.engine.dispose()
        self.relay_engine.dispose()
        if self.errors:
            raise RuntimeError(f"a soak thread failed: {self.errors[0]!r}") from self.errors[0]

    def _guard(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                self.errors.append(exc)
                self.stop.set()
                self.relay.stop()
                raise

        return run

    def _agent(self, index: int, agents: int) -> None:
        """Enqueue intents ``index``, ``index + agents``, ... on the fixed schedule."""
        with Session(self.engine) as session:
            i = index
            while not self.stop.is_set():
                due_at = self._started + i / self.rate
                delay = due_at - time.perf_counter()
                if delay > 0:
                    self.stop.wait(delay)
                    continue
                with session.begin():
                    api.enqueue(
                        session,
                        tool=TOOL,
                        target=f"project-{i % 50}",
                        payload={
                            "version": f"4.0.{i}",
                            "changelog": f"{uuid.uuid4().hex} " * 5,
                            "approvers": ["alice", "bob"],
                        },
                        intent_key=f"soak-{self.tag}-{i}",
                        metadata={"agent": "release-bot", "conversation": i // 7},
                    )
                self.recorder.enqueued()
                i += agents

    def _worker(self) -> None:
        """The dispatcher's state moves for every message: sent, then the outcome."""
        with self.engine.connect() as conn:
            while not self.stop.is_set():
                if self.paused.is_set():
                    self.stop.wait(0.2)
                    continue
                try:
                    message = self.inbox.get(timeout=0.2)
                except queue.Empty:
                    continue
                self._dispatch(conn, message.operation_id)

    def _dispatch(self, conn: Connection, op_id: UUID) -> None:
        fate = op_id.int % 100
        if not self._mark_sent(conn, op_id):
            return
        if fate == 0:
            return  # the dispatcher died after its `sent` commit: the sweep finds it
        with conn.begin():
            if fate < 6:
                move = transitions.fail(
                    op_id,
                    from_state=State.SENT,
                    actor=Actor.DISPATCHER,
                    reason="rejected by the remote: HTTP 422",
                    attempt=1,
                    last_error="HTTP 422: version already released",
                )
            else:
                move = transitions.confirm(
                    op_id,
                    from_state=State.SENT,
                    actor=Actor.DISPATCHER,
                    reason="applied",
                    attempt=1,
                    remote_ref=f"rel_{op_id.hex[:20]}",
                    result={"id": f"rel_{op_id.hex[:20]}", "status": "created"},
                )
            transitions.apply(conn, move)
        self.recorder.done()

    def _mark_sent(self, conn: Connection, op_id: UUID) -> bool:
        """``planned -> sent`` as the dispatcher makes it: the move never waits on a row lock
        (a relay's open claim), so a busy row is waited for outside it and the move retried."""
        for _ in range(3):
            try:
                with conn.begin():
                    found = sql.locks.get_for_dispatch(conn, op_id)
                    if found is None or found.operation.state is not State.PLANNED:
                        return False  # a duplicate message: the row moved on
                    sql.locks.require_synchronous_commit(conn)
                    transitions.apply(
                        conn,
                        transitions.mark_sent(op_id, attempt=0, reason="dispatching attempt 1"),
                    )
            except StaleTransition:
                return False
            except DBAPIError as exc:
                if not sql.locks.is_row_lock_busy(exc):
                    raise
                with conn.begin():
                    sql.locks.wait_for_row_lock(conn, op_id, timeout_s=5.0)
                continue
            return True
        return False  # held three times over: the relay publishes it again

    def _sweep_loop(self) -> None:
        while not self.stop.wait(5.0):
            started = time.perf_counter()
            self.sweeper.run_once()
            self.recorder.sweep(time.perf_counter() - started)

    def _lookup_loop(self) -> None:
        """Lookups that find the effect: ``unknown -> confirmed``."""
        with self.engine.connect() as conn:
            while not self.stop.is_set():
                try:
                    op_id = self.lookups.get(timeout=0.2)
                except queue.Empty:
                    continue
                try:
                    with conn.begin():
                        transitions.apply(
                            conn,
                            transitions.confirm(
                                op_id,
                                from_state=State.UNKNOWN,
                                actor=Actor.RECONCILER,
                                reason="lookup: the effect exists",
                                attempt=1,
                                remote_ref=f"rel_{op_id.hex[:20]}",
                            ),
                        )
                except StaleTransition:
                    continue
                self.recorder.done()
