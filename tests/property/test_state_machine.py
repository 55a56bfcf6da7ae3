"""A stateful property test: the real outbox components against a real PostgreSQL and a
modelled remote, under lost, duplicated and reordered messages, crashes and passing time.

Hypothesis drives the real enqueue, relay, dispatch, sweep, lookup, cancel and operator
resolution code in random orders. The remote is an in-process tool backed by
:class:`FakeRemote`, the test's model of a remote service: a ledger of every effect per
operation id, with or without a dedup window (answering a duplicate key with the stored
answer, or always refusing it) and a lookup, answering each call as the step says (applied,
applied-then-ambiguous, not-applied-ambiguous, refused, not delivered). Time passes by moving
every timestamp of every row into the past, and the remote's clock forward by as much; no
clock is faked. After every step the promises are checked against the database and the
ledger (no operation has two effects; `confirmed` names an effect the remote holds; `failed`
and `cancelled` only where the remote holds none); at the end of each example the system is
driven to quiescence and every operation must have settled.

The schedules are weighted towards the paths where mistakes hide: every example starts with
an operation on every remote, an answer lost after the effect is the likeliest answer, and
one step runs every component once after the in-flight horizon, so an ambiguous attempt,
its replay and the remote's answer to the replay happen within a few steps.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID, uuid4

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import Engine, text

import outbox
from outbox import faults, sql
from outbox.canonical import canonical_json, payload_hash
from outbox.contracts import ContractTable
from outbox.errors import NotCancellable
from outbox.faults import InjectedFault
from outbox.reconcilers.lookup import LookupOutcome, lookup
from outbox.reconcilers.sweep import SweepConfig, Sweeper
from outbox.relay import OutboundMessage, Relay, RelayConfig
from outbox.states import SETTLED_STATES, State
from outbox.tools import (
    Ambiguous,
    Applied,
    Dedup,
    DispatchResult,
    Inconclusive,
    LookupResult,
    NotApplied,
    NotDelivered,
    Rejected,
    ToolCall,
    ToolRegistry,
    tool,
)
from outbox.workers.dispatch import Outcome, dispatch

#: After this, a request sent at ``sent_at`` can no longer land (the tools' contract).
HORIZON_S = 30.0
#: The dedup remotes remember an applied key this long; the outbox keeps a margin off it.
WINDOW_S = 600.0
MARGIN_S = 60.0
#: The sweep treats a `sent` row older than this as possibly lost, and one whose dispatcher
#: still holds its lock after the max age as stuck.
SENT_TIMEOUT_S = 5.0
SENT_MAX_AGE_S = 60.0
#: The relay publishes a `planned` row again this long after its last message.
REPUBLISH_S = 30.0
#: How far one drain round moves time: past the horizon, the republish delay, the sweep's
#: lookup lease (60s) and every backoff these contracts can produce.
DRAIN_STEP_S = 75.0
DRAIN_ROUNDS = 12


@dataclass(frozen=True)
class RemoteKind:
    """What one remote service promises."""

    #: It keeps one effect per key inside its window.
    dedup: bool = False
    #: It answers a same-key request inside the window with a refusal ("this key was already
    #: used"), never with the stored answer, as some remotes do.
    refuses_duplicates: bool = False
    #: It can say whether an operation's effect exists.
    has_lookup: bool = False


#: The remotes, one tool each.
REMOTES: dict[str, RemoteKind] = {
    "remote.plain": RemoteKind(),
    "remote.dedup": RemoteKind(dedup=True),
    "remote.dedup_refuses": RemoteKind(dedup=True, refuses_duplicates=True),
    "remote.lookup": RemoteKind(has_lookup=True),
    "remote.dedup_lookup": RemoteKind(dedup=True, has_lookup=True),
}

DISPATCH_FAULTS = ("after_lock", "after_sent_commit", "after_call", "after_outcome_commit")
RELAY_FAULTS = ("relay_before_publish", "relay_after_publish", "relay_after_commit")
TIMESTAMPS = (
    "created_at",
    "updated_at",
    "available_at",
    "published_at",
    "first_sent_at",
    "sent_at",
    "next_check_at",
    "replay_deadline",
    "resolved_at",
)
# Every timestamp by the same amount, so first_sent_at <= sent_at and every deadline keeps
# its distance from the times it was computed from: exactly what the passing of time does.
_AGE_ALL = text(
    "UPDATE outbox.operations SET "
    + ", ".join(f"{c} = {c} - make_interval(secs => :s)" for c in TIMESTAMPS)
)
_TRUNCATE = text(
    "TRUNCATE outbox.operations, outbox.events, outbox.relays, outbox.webhook_deliveries, "
    "outbox.pruned_intents, outbox.sagas, outbox.saga_steps, outbox.saga_events"
)
_SNAPSHOT = text(
    "SELECT id, state, attempts, payload, payload_hash, remote_ref, next_check_at "
    "FROM outbox.operations"
)
_EVENTS = text("SELECT operation_id, from_state, to_state FROM outbox.events ORDER BY id")


class Behaviour(enum.StrEnum):
    """How the remote answers one dispatch call."""

    APPLIED = "applied"
    APPLY_THEN_AMBIGUOUS = "apply_then_ambiguous"  #: effect recorded, the answer lost
    NOT_APPLIED_AMBIGUOUS = "not_applied_ambiguous"  #: no effect, the answer lost
    REFUSED = "refused"
    NOT_DELIVERED = "not_delivered"


#: The remote's answers; the effect recorded and its answer lost counts twice: it is the
#: case the outbox exists for, and the start of every path through replays.
BEHAVIOURS = st.sampled_from([*Behaviour, Behaviour.APPLY_THEN_AMBIGUOUS])


@dataclass(frozen=True)
class Effect:
    """One effect at the remote: its reference and when (remote clock) it happened."""

    ref: str
    at: float


@dataclass
class FakeRemote:
    """The test's model of the remote services: every effect, per operation id."""

    engine: Engine
    #: The remote's clock in seconds; moves only when the test lets time pass.
    now: float = 0.0
    #: How the next dispatch call is answered.
    behaviour: Behaviour = Behaviour.APPLIED
    #: Whether the next lookup is inconclusive.
    lookup_inconclusive: bool = False
    #: Runs while a call is in flight, after its effect (if any) was recorded.
    during_call: Callable[[], None] | None = None
    ledger: dict[str, list[Effect]] = field(default_factory=dict)
    #: Calls that broke a promise of the outbox, described for the failure message.
    violations: list[str] = field(default_factory=list)
    _refs: itertools.count[int] = field(default_factory=itertools.count)

    def dispatch(self, call: ToolCall, kind: RemoteKind) -> DispatchResult:
        """Answer one call as :attr:`behaviour` says, recording any effect."""
        if self.behaviour is Behaviour.NOT_DELIVERED:
            return NotDelivered("connection refused")
        self._check_sent_committed(call)
        answer = self._answer(call, kind)
        if self.during_call is not None:
            self.during_call()
        return answer

    def _answer(self, call: ToolCall, kind: RemoteKind) -> DispatchResult:
        effects = self.ledger.setdefault(call.operation_id, [])
        if kind.dedup and effects and self.now - effects[0].at < WINDOW_S:
            return self._deduplicated(effects[0], refuses=kind.refuses_duplicates)
        if effects:
            self.violations.append(
                f"{call.operation_id}: attempt {call.attempt} reached the remote after an "
                "effect, with no dedup window open"
            )
        if self.behaviour in (Behaviour.APPLIED, Behaviour.APPLY_THEN_AMBIGUOUS):
            effect = Effect(f"eff-{next(self._refs)}", self.now)
            effects.append(effect)
            if self.behaviour is Behaviour.APPLIED:
                return Applied(effect.ref)
            return Ambiguous("read timeout after the remote committed")
        if self.behaviour is Behaviour.REFUSED:
            return Rejected("HTTP 422")
        return Ambiguous("HTTP 503")

    def _deduplicated(self, first: Effect, *, refuses: bool) -> DispatchResult:
        """A same-key request inside the window: no new effect; the stored answer, a refusal
        of the duplicate (always, from a remote that ``refuses``), or a lost answer."""
        if self.behaviour is Behaviour.APPLIED and not refuses:
            return Applied(first.ref)
        if self.behaviour in (Behaviour.APPLIED, Behaviour.REFUSED):
            return Rejected("HTTP 422: this idempotency key was already used")
        return Ambiguous("read timeout")

    def _check_sent_committed(self, call: ToolCall) -> None:
        """No call without a committed `sent` row for exactly this attempt (read apart)."""
        with self.engine.connect() as conn:
            row = sql.intents.get_operation(conn, UUID(call.operation_id))
        if row is None or row.state is not State.SENT or row.attempts != call.attempt:
            seen = f"{row.state.value} at attempt {row.attempts}" if row else "missing"
            self.violations.append(
                f"{call.operation_id}: attempt {call.attempt} called while the row is {seen}"
            )

    def lookup(self, call: ToolCall) -> LookupResult:
        """What the remote knows about the operation: its effect, or none."""
        if self.lookup_inconclusive:
            return Inconclusive("HTTP 500 from the lookup")
        effects = self.ledger.get(call.operation_id)
        return Applied(effects[0].ref) if effects else NotApplied("404")

    def refs(self, op_id: UUID) -> list[str]:
        """The references of every effect of one operation."""
        return [effect.ref for effect in self.ledger.get(str(op_id), [])]


def remote_registry(remote: FakeRemote) -> ToolRegistry:
    """A private registry of one tool per remote in :data:`REMOTES`, all backed by ``remote``."""
    registry = ToolRegistry(ContractTable())
    for name, kind in REMOTES.items():

        def send(call: ToolCall, *, kind: RemoteKind = kind) -> DispatchResult:
            return remote.dispatch(call, kind)

        python_tool = tool(
            name,
            timeout=10,  # ample for a call that runs the sweep while it is in flight
            send_deadline=2,
            inflight_horizon=HORIZON_S,
            max_checks=2,
            max_attempts=3,
            dedup=Dedup(window_s=WINDOW_S, margin_s=MARGIN_S) if kind.dedup else None,
            registry=registry,
        )(send)
        if kind.has_lookup:
            python_tool.lookup(remote.lookup)
    return registry


class QueuePublisher:
    """A broker stand-in: published messages land in the model's queue."""

    def __init__(self, queue: list[UUID], *, confirm: bool) -> None:
        self.queue = queue
        self.confirm = confirm

    def publish(self, messages: Sequence[OutboundMessage]) -> set[UUID]:
        """Queue every message; confirm all of them, or none (the confirms were lost)."""
        self.queue.extend(message.operation_id for message in messages)
        return {message.operation_id for message in messages} if self.confirm else set()

    def close(self) -> None:
        """Nothing to release."""


@dataclass(frozen=True)
class Intent:
    """What the agent asked for, as the model remembers it."""

    key: str
    tool: str
    payload: dict[str, Any]
    digest: str


@dataclass(frozen=True)
class Row:
    """The columns the invariants read."""

    state: State
    attempts: int
    payload: Any
    digest: str
    remote_ref: str | None
    check_scheduled: bool


class OutboxMachine(RuleBasedStateMachine):
    """Random schedules of every component of the outbox against one modelled remote."""

    ops: Bundle[UUID] = Bundle("ops")

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        with engine.begin() as conn:
            conn.execute(_TRUNCATE)
        self.remote = FakeRemote(engine)
        self.registry = remote_registry(self.remote)
        self.intents: dict[UUID, Intent] = {}
        self.messages: list[UUID] = []
        self.lookup_requests: list[UUID] = []

    @initialize(target=ops)
    def first_intents(self) -> MultipleResults[UUID]:
        """One intent per remote to start with (so every remote's paths are open in every
        example); a message for an id never enqueued finds nothing."""
        missing = uuid4()
        assert self._dispatch(missing, Behaviour.APPLIED) is Outcome.GONE
        assert lookup(missing, engine=self.engine, registry=self.registry).outcome is (
            LookupOutcome.GONE
        )
        return multiple(*(self._enqueue(name, 0) for name in sorted(REMOTES)))

    # --- the agent -------------------------------------------------------------------------

    @rule(target=ops, tool_name=st.sampled_from(sorted(REMOTES)), n=st.integers(0, 2))
    def enqueue(self, tool_name: str, n: int) -> UUID:
        """A new intent, committed with the agent's transaction."""
        return self._enqueue(tool_name, n)

    @rule(op_id=ops)
    def enqueue_again(self, op_id: UUID) -> None:
        """An agent retrying its enqueue with the same key and payload gets the same operation."""
        intent = self.intents[op_id]
        with self.engine.begin() as conn:
            op = outbox.enqueue(
                conn,
                tool=intent.tool,
                target="project",
                payload=intent.payload,
                intent_key=intent.key,
            )
        assert op.id == op_id
        assert op.payload_hash == intent.digest

    @rule(op_id=ops)
    def cancel(self, op_id: UUID) -> None:
        """The agent withdraws an operation; refused unless no attempt can have applied."""
        with contextlib.suppress(NotCancellable), self.engine.begin() as conn:
            outbox.cancel(conn, op_id)

    # --- the relay and the broker ----------------------------------------------------------

    @rule(confirm=st.booleans())
    def relay_step(self, confirm: bool) -> None:
        """One relay batch; the broker confirms all of its messages or none."""
        self._relay(confirm=confirm)

    @rule(point=st.sampled_from(RELAY_FAULTS))
    def relay_crash(self, point: str) -> None:
        """A relay batch that dies at one of its commit boundaries."""
        with faults.armed(point, "raise"), contextlib.suppress(InjectedFault):
            self._relay(confirm=True)

    @precondition(lambda self: self.messages)
    @rule(data=st.data())
    def duplicate_message(self, data: st.DataObject) -> None:
        """The broker delivers a message twice."""
        self.messages.append(data.draw(st.sampled_from(self.messages)))

    @precondition(lambda self: self.messages)
    @rule(data=st.data())
    def drop_message(self, data: st.DataObject) -> None:
        """The broker loses a message."""
        self.messages.pop(data.draw(st.integers(0, len(self.messages) - 1)))

    # --- the dispatcher ----------------------------------------------------------------------

    @precondition(lambda self: self.messages)
    @rule(data=st.data(), behaviour=BEHAVIOURS)
    def deliver_message(self, data: st.DataObject, behaviour: Behaviour) -> None:
        """A worker takes any queued message (so messages are reordered) and dispatches it."""
        op_id = self.messages.pop(data.draw(st.integers(0, len(self.messages) - 1)))
        self._dispatch(op_id, behaviour)

    @rule(op_id=ops, behaviour=BEHAVIOURS)
    def stray_dispatch(self, op_id: UUID, behaviour: Behaviour) -> None:
        """A dispatch for any operation, whatever its state (a stale or redelivered message)."""
        self._dispatch(op_id, behaviour)

    @rule(op_id=ops, behaviour=BEHAVIOURS, point=st.sampled_from(DISPATCH_FAULTS))
    def dispatch_crash(self, op_id: UUID, behaviour: Behaviour, point: str) -> None:
        """A dispatcher that dies at a named point (after_call: the remote already answered)."""
        with faults.armed(point, "raise"), contextlib.suppress(InjectedFault):
            self._dispatch(op_id, behaviour)

    @rule(op_id=ops, behaviour=BEHAVIOURS)
    def dispatch_outlives_max_age(self, op_id: UUID, behaviour: Behaviour) -> None:
        """A call still in flight past the max age: the sweep hands it to a human meanwhile,
        and its late answer is kept as evidence."""
        self.remote.during_call = self._hang
        try:
            self._dispatch(op_id, behaviour)
        finally:
            self.remote.during_call = None

    # --- the reconciler and the operator -----------------------------------------------------

    @rule()
    def sweep(self) -> None:
        """One sweep: lost dispatchers to unknown, due unknown rows routed."""
        self._sweep()

    @precondition(lambda self: self.lookup_requests)
    @rule(inconclusive=st.booleans())
    def requested_lookup(self, inconclusive: bool) -> None:
        """A lookup the sweep asked for, answered conclusively from the ledger or not."""
        self._lookup(self.lookup_requests.pop(0), inconclusive=inconclusive)

    @rule(op_id=ops, inconclusive=st.booleans())
    def stray_lookup(self, op_id: UUID, inconclusive: bool) -> None:
        """A lookup of any operation, whatever its state (a duplicated lookup message)."""
        self._lookup(op_id, inconclusive=inconclusive)

    @rule(data=st.data(), replay=st.booleans())
    def operator_resolves(self, data: st.DataObject, replay: bool) -> None:
        """An operator who checked the remote resolves a waiting operation (forced)."""
        waiting = sorted(
            op_id
            for op_id, row in self._rows().items()
            if row.state in (State.UNKNOWN, State.NEEDS_HUMAN)
        )
        if not waiting:
            return
        op_id = data.draw(st.sampled_from(waiting))
        refs = self.remote.refs(op_id)
        with self.engine.begin() as conn:
            if refs:
                outbox.resolve(
                    conn, op_id, applied=True, remote_ref=refs[0], by="op", note="found", force=True
                )
            else:
                outbox.resolve(
                    conn, op_id, applied=False, replay=replay, by="op", note="absent", force=True
                )

    @rule(
        seconds=st.sampled_from([31, 61, 200]),
        inconclusive=st.booleans(),
        answers=st.lists(BEHAVIOURS, min_size=1, max_size=3),
    )
    def everything_runs(self, seconds: int, inconclusive: bool, answers: list[Behaviour]) -> None:
        """Time passes beyond the in-flight horizon, then every component runs once: the sweep,
        the lookups it asked for, the relay, and a worker for every queued message, the remote
        answering the calls in turn as ``answers`` says.

        One step for what is otherwise a long, unlikely run of separate steps: an ambiguous
        attempt reconciled into a replay (a dedup replay, or a lookup after the horizon), and
        the replay answered (by a refusal of the key the remote already holds, say). The
        answers are drawn before the step runs: how many messages there are depends on the
        wall clock too (a backoff may have run out), and what Hypothesis draws must not.
        """
        self._age(seconds)
        self._sweep()
        while self.lookup_requests:
            self._lookup(self.lookup_requests.pop(0), inconclusive=inconclusive)
        self._relay(confirm=True)
        for answer in itertools.cycle(answers):
            if not self.messages:
                break
            self._dispatch(self.messages.pop(0), answer)

    @rule(seconds=st.sampled_from([1, 6, 31, 61, 200, 700]))
    def time_passes(self, seconds: int) -> None:
        """Time passes for the database (every row ages) and for the remote alike."""
        self._age(seconds)

    # --- the promises --------------------------------------------------------------------------

    @invariant()
    def promises_hold(self) -> None:
        """Every promise of the outbox holds in the database and at the remote."""
        rows = self._rows()
        assert set(rows) == set(self.intents), "an operation appeared or vanished"
        assert not self.remote.violations, self.remote.violations
        self._check_effects(rows)
        self._check_rows(rows)
        self._check_event_log(rows)

    def teardown(self) -> None:
        """Drive the system to quiescence: every operation settles, every promise still holds."""
        try:
            for _ in range(DRAIN_ROUNDS):
                unsettled = self._unsettled()
                if not unsettled:
                    break
                self._drain_round()
            assert not self._unsettled(), f"operations never settled: {self._unsettled()}"
            self.promises_hold()
        finally:
            faults.disarm()

    def _check_effects(self, rows: dict[UUID, Row]) -> None:
        for key, effects in self.remote.ledger.items():
            assert len(effects) <= 1, f"{key}: {len(effects)} effects at the remote"
        for op_id, row in rows.items():
            refs = self.remote.refs(op_id)
            if row.state is State.CONFIRMED:
                assert row.remote_ref in refs, f"{op_id} confirmed as {row.remote_ref}, not {refs}"
            if row.state in (State.CANCELLED, State.FAILED):
                assert not refs, f"{op_id} is {row.state.value} but the remote holds {refs}"

    def _check_rows(self, rows: dict[UUID, Row]) -> None:
        for op_id, row in rows.items():
            intent = self.intents[op_id]
            assert row.digest == intent.digest, f"{op_id}: the payload hash changed"
            assert row.payload == intent.payload, f"{op_id}: the payload changed"
            # Not lost: settled, or in a state that a component moves on by itself.
            assert row.state in SETTLED_STATES | {State.PLANNED, State.SENT, State.UNKNOWN}
            if row.state is State.UNKNOWN:
                assert row.check_scheduled, f"{op_id} is unknown with no check scheduled"

    def _check_event_log(self, rows: dict[UUID, Row]) -> None:
        folded: dict[UUID, str | None] = {}
        with self.engine.connect() as conn:
            for event in conn.execute(_EVENTS):
                previous = folded.get(event.operation_id)
                assert event.from_state == previous, (
                    f"{event.operation_id}: event from {event.from_state} after {previous}"
                )
                folded[event.operation_id] = event.to_state
        assert folded == {op_id: row.state.value for op_id, row in rows.items()}

    # --- driving the components ----------------------------------------------------------------

    def _enqueue(self, tool_name: str, n: int) -> UUID:
        key = f"intent-{len(self.intents)}"
        payload = {"n": n, "key": key}
        with self.engine.begin() as conn:
            op = outbox.enqueue(
                conn, tool=tool_name, target="project", payload=payload, intent_key=key
            )
        digest = payload_hash(canonical_json(payload))
        assert op.state is State.PLANNED
        assert op.payload_hash == digest
        self.intents[op.id] = Intent(key, tool_name, payload, digest)
        return op.id

    def _relay(self, *, confirm: bool) -> None:
        publisher = QueuePublisher(self.messages, confirm=confirm)
        config = RelayConfig(republish_after_s=REPUBLISH_S)
        Relay(self.engine, publisher, config, name="property-relay").run_once()

    def _dispatch(self, op_id: UUID, behaviour: Behaviour) -> Outcome:
        self.remote.behaviour = behaviour
        report = dispatch(op_id, engine=self.engine, registry=self.registry)
        assert report.outcome is not Outcome.LOCK_BUSY, "nothing else holds a lock between steps"
        return report.outcome

    def _sweep(self) -> None:
        Sweeper(
            self.engine,
            registry=self.registry,
            config=SweepConfig(sent_timeout_s=SENT_TIMEOUT_S, sent_max_age_s=SENT_MAX_AGE_S),
            request_lookup=self.lookup_requests.append,
        ).run_once()

    def _hang(self) -> None:
        """Time passes while a call is in flight (its dispatcher holds the lock), and the
        sweep runs."""
        self._age(SENT_MAX_AGE_S + 1)
        self._sweep()

    def _lookup(self, op_id: UUID, *, inconclusive: bool) -> None:
        self.remote.lookup_inconclusive = inconclusive
        report = lookup(op_id, engine=self.engine, registry=self.registry)
        assert report.outcome is not LookupOutcome.LOCK_BUSY

    def _age(self, seconds: float) -> None:
        with self.engine.begin() as conn:
            conn.execute(_AGE_ALL, {"s": seconds})
        self.remote.now += seconds

    def _drain_round(self) -> None:
        """Time passes, then every component runs once with no fault and a healthy remote."""
        self._age(DRAIN_STEP_S)
        self._relay(confirm=True)
        while self.messages:
            self._dispatch(self.messages.pop(0), Behaviour.APPLIED)
        self._sweep()
        while self.lookup_requests:
            self._lookup(self.lookup_requests.pop(0), inconclusive=False)

    def _rows(self) -> dict[UUID, Row]:
        with self.engine.connect() as conn:
            return {
                row.id: Row(
                    State(row.state),
                    row.attempts,
                    row.payload,
                    row.payload_hash,
                    row.remote_ref,
                    row.next_check_at is not None,
                )
                for row in conn.execute(_SNAPSHOT)
            }

    def _unsettled(self) -> dict[UUID, str]:
        return {
            op_id: row.state.value
            for op_id, row in self._rows().items()
            if row.state not in SETTLED_STATES
        }


SETTINGS = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_outbox_keeps_its_promises_under_any_schedule(engine: Engine) -> None:
    """Under any schedule of the components, faults and time, no effect doubles and none is lost."""

    class OnTestDatabase(OutboxMachine):
        def __init__(self) -> None:
            super().__init__(engine)

    run_state_machine_as_test(OnTestDatabase, settings=SETTINGS)
