"""What the console's pages show, read in one transaction each (sync: run through
``run_sync`` on the request's connection, like the API's handlers)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from outbox import api, sagas, sql
from outbox.models import Delivery, Event, Executor, Operation
from outbox.resolve import RESOLVABLE_STATES, waiting_reasons
from outbox.saga_attention import STATE_HELP, Blocker, blockers
from outbox.saga_rules import SagaState
from outbox.sagas import SagaSummary, SagaView
from outbox.sql.console import DecidedRate
from outbox.states import Actor, State

#: The overview's rate of decided operations is over this many seconds.
DECIDED_WINDOW_S = 300.0
#: ... counted among this many newest events at most (the statement's bound).
DECIDED_MAX_EVENTS = 100_000
#: The queue page lists this many operations at most.
QUEUE_LIMIT = 200
#: An operation page lists this many webhook deliveries at most.
DELIVERIES_LIMIT = 50
#: The actors whose events are lookups' answers: the reconciler's, and evidence it brought.
LOOKUP_ACTORS = frozenset({Actor.RECONCILER.value, Actor.EVIDENCE.value})
#: The sagas page lists this many sagas at most.
SAGAS_LIMIT = 200


@dataclass(frozen=True, slots=True)
class StateLine:
    """One state on the overview: how many operations are in it, and since when the oldest
    of a live state waits (seconds; ``None`` for an empty or terminal state)."""

    state: State
    count: int
    oldest_s: float | None


@dataclass(frozen=True, slots=True)
class Overview:
    """The overview page."""

    states: list[StateLine]
    decided: DecidedRate
    now: datetime


@dataclass(frozen=True, slots=True)
class Waiting:
    """One operation of the queue: why it waits, and for how long (seconds)."""

    operation: Operation
    reason: str
    waited_s: float
    #: For one awaiting approval: seconds until its approval expires (the sweep cancels it).
    expires_in_s: float | None


@dataclass(frozen=True, slots=True)
class OperationView:
    """An operation page: the row, its trail, its webhooks, the last lookup's answer."""

    operation: Operation
    events: list[Event]
    deliveries: list[Delivery]
    #: The newest event a lookup (or evidence) wrote, if any.
    last_lookup: Event | None
    #: Why it is where it is: the reason of the move into its current state.
    reason: str | None
    #: The payload as indented JSON, keys sorted (what the hash was computed over).
    payload_json: str
    #: The newest event's id: a form carries it, so a stale one can say what happened since.
    newest_event_id: int
    now: datetime

    @property
    def saga_key(self) -> str | None:
        """The saga this operation is a step (or a compensation) of, if any."""
        key = self.operation.metadata.get("saga")
        return key if isinstance(key, str) and key and self.saga_role is not None else None

    @property
    def saga_role(self) -> str | None:
        """What it is in its saga: ``step NAME`` or ``the undo of step NAME``."""
        step = self.operation.metadata.get("saga_step")
        if isinstance(step, str):
            return f"step {step}"
        undone = self.operation.metadata.get("saga_compensates")
        if isinstance(undone, str):
            return f"the undo of step {undone}"
        return None

    @property
    def resolvable(self) -> bool:
        """Whether the page offers resolve (unknown or needs_human)."""
        return self.operation.state in RESOLVABLE_STATES

    @property
    def approvable(self) -> bool:
        """Whether the page offers approve and reject."""
        return self.operation.state is State.AWAITING_APPROVAL


def read_overview(session: Executor) -> Overview:
    """Operations by state, the oldest wait of each live state, the recent decided rate."""
    counts: dict[str, int] = {}
    for line in sql.metrics.operation_counts(session):
        counts[line.state] = counts.get(line.state, 0) + line.n
    oldest = sql.metrics.oldest_waits(session)
    states = []
    for state in State:
        since = oldest.since.get(state)
        states.append(
            StateLine(
                state=state,
                count=counts.get(state.value, 0),
                oldest_s=(oldest.now - since).total_seconds() if since is not None else None,
            )
        )
    decided = sql.console.decided_rate(
        session, window_s=DECIDED_WINDOW_S, max_events=DECIDED_MAX_EVENTS
    )
    return Overview(states=states, decided=decided, now=oldest.now)


def read_queue(session: Executor) -> list[Waiting]:
    """The operations waiting for a person, the longest-waiting first, with why."""
    now = sql.deployment.clock(session)
    found = sql.console.waiting_operations(session, limit=QUEUE_LIMIT)
    reasons = waiting_reasons(session, [op.id for op in found])
    return [
        Waiting(
            operation=op,
            reason=reasons.get(op.id, op.last_error or ""),
            waited_s=(now - op.updated_at).total_seconds(),
            expires_in_s=(
                (op.approval_expires_at - now).total_seconds()
                if op.state is State.AWAITING_APPROVAL and op.approval_expires_at is not None
                else None
            ),
        )
        for op in found
    ]


def read_operation(session: Executor, operation_id: UUID) -> OperationView | None:
    """Everything the operation page shows; ``None`` if there is no such operation."""
    op = api.get(session, operation_id)
    if op is None:
        return None
    trail = sql.intents.list_events(session, op.id)
    deliveries = sql.webhooks.list_deliveries(session, operation_id=op.id, limit=DELIVERIES_LIMIT)
    lookups = [event for event in trail if event.actor in LOOKUP_ACTORS]
    return OperationView(
        operation=op,
        events=trail,
        deliveries=deliveries,
        last_lookup=lookups[-1] if lookups else None,
        reason=waiting_reasons(session, [op.id]).get(op.id),
        payload_json=json.dumps(op.payload, indent=2, sort_keys=True, ensure_ascii=False),
        newest_event_id=trail[-1].id if trail else 0,
        now=sql.deployment.clock(session),
    )


def find_operations(session: Executor, text: str) -> list[Operation]:
    """The operation whose id is ``text``, else every agent's operation whose intent key it is
    (an intent key left to its default is the operation's id, so both readings agree)."""
    text = text.strip()
    if not text:
        return []
    try:
        found = api.get(session, UUID(text))
    except ValueError:
        found = None
    return [found] if found is not None else api.find_every_agents(session, text)


@dataclass(frozen=True, slots=True)
class SagaList:
    """The sagas page: the sagas (newest first), optionally only those in one state."""

    sagas: list[SagaSummary]
    state: SagaState | None
    #: How many sagas are in each state (every state, zero included).
    counts: dict[SagaState, int]
    now: datetime


@dataclass(frozen=True, slots=True)
class SagaPage:
    """A saga page: the saga, what its state means, what waits for a person."""

    saga: SagaView
    meaning: str
    blockers: list[Blocker]
    now: datetime

    @property
    def cancellable(self) -> bool:
        """Whether the page offers cancel (only a running saga can be cancelled)."""
        return self.saga.state is SagaState.RUNNING


def read_sagas(session: Executor, state: SagaState | None) -> SagaList:
    """The newest sagas (at most :data:`SAGAS_LIMIT`), only those in ``state`` if given."""
    counted = sql.sagas.count_by_state(session)
    return SagaList(
        sagas=sagas.list_sagas(session, state=state, limit=SAGAS_LIMIT),
        state=state,
        counts={known: counted.get(known.value, 0) for known in SagaState},
        now=sql.deployment.clock(session),
    )


def saga_agents(session: Executor, key: str) -> list[str]:
    """The agents that have a saga under ``key`` (each agent's same key is its own saga)."""
    return sagas.agents_of_saga_key(session, key)


def read_saga(session: Executor, key: str, agent: str | None) -> SagaPage | list[str] | None:
    """Everything the saga page shows: ``agent``'s saga ``key``, else the one agent's that
    has it; ``None`` if there is no such saga; the agents, when several have one under
    ``key`` and none was named."""
    if agent is None:
        agents = saga_agents(session, key)
        if len(agents) > 1:
            return agents
        agent = agents[0] if agents else ""
    found = sagas.get_saga(session, key, agent=agent)
    if found is None:
        return None
    return SagaPage(
        saga=found,
        meaning=STATE_HELP[found.state],
        blockers=blockers(found),
        now=sql.deployment.clock(session),
    )
