"""The sagas' statements (docs/sagas.md): their rows, steps and audit trail, the hold and the
release of a step's operation, and the reads behind ``outbox.get_saga`` and the driver.

Only :mod:`outbox.sagas` writes a saga's ``state`` (:func:`move_saga`, a compare-and-set that
appends its event in the same statement); an operation's ``state`` is still written only by
:mod:`outbox.transitions`, which also calls :func:`hold_operation` and
:func:`release_operation` (they change ``available_at``, never ``state``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import text

from outbox.models import Executor, SagaRef
from outbox.sql.columns import HELD_UNTIL
from outbox.states import State


@dataclass(frozen=True, slots=True)
class SagaRow:
    """One row of ``outbox.sagas``."""

    key: str
    state: str
    reason: str | None
    requested_by: str | None
    cancelled_by: str | None
    created_at: datetime
    updated_at: datetime
    next_check_at: datetime
    #: The agent whose saga key it is (``""``: the shared scope).
    agent: str

    @property
    def ref(self) -> SagaRef:
        """The saga's identity: its key in its agent's scope."""
        return SagaRef(self.key, self.agent)

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> SagaRow:
        """From a mapping holding the table's columns."""
        return cls(**{name: row[name] for name in cls.__slots__})


@dataclass(frozen=True, slots=True)
class StepRow:
    """One step with what the saga needs of its operation and of its compensation's."""

    saga_key: str
    agent: str
    position: int
    name: str
    #: The intent key of its operation (stored: sagas opened before 0023 keep their form).
    intent_key: str
    grp: str | None
    pivot: bool
    operation_id: UUID | None
    compensate_tool: str | None
    compensate_target: str | None
    compensate_payload: dict[str, Any] | None
    compensation_operation_id: UUID | None
    approval_ttl_s: float | None
    released_at: datetime | None
    created_at: datetime
    #: The step's operation as it is now (``None``: pruned).
    state: State | None
    remote_ref: str | None
    tool: str | None
    target: str | None
    payload_hash: str | None
    #: Whether its operation waits for the saga (``available_at`` is :data:`HELD_UNTIL`).
    held: bool
    compensation_state: State | None
    compensation_remote_ref: str | None


_CREATE_SAGA = text(
    """
    WITH created AS (
        INSERT INTO outbox.sagas (key, agent, requested_by) VALUES (:key, :agent, :requested_by)
        ON CONFLICT (key, agent) DO NOTHING
        RETURNING *
    ),
    logged AS (
        INSERT INTO outbox.saga_events (saga_key, agent, from_state, to_state, actor, reason)
        SELECT key, agent, NULL, state, 'agent', 'created' FROM created
    )
    SELECT * FROM created
    """
)

_GET_SAGA = text("SELECT * FROM outbox.sagas WHERE key = :key AND agent = :agent")

_LOCK_SAGA = text(
    "SELECT * FROM outbox.sagas WHERE key = :key AND agent = :agent FOR NO KEY UPDATE"
)

_TRY_LOCK_SAGA = text(
    "SELECT * FROM outbox.sagas WHERE key = :key AND agent = :agent FOR NO KEY UPDATE SKIP LOCKED"
)

_AGENTS_OF_KEY = text("SELECT agent FROM outbox.sagas WHERE key = :key ORDER BY agent")


def create_saga(executor: Executor, ref: SagaRef, *, requested_by: str | None) -> SagaRow | None:
    """Insert a ``running`` saga and its first event; ``None`` if the agent's key exists
    already (or is being inserted by a concurrent transaction, whose outcome this waits for)."""
    params = {"key": ref.key, "agent": ref.agent, "requested_by": requested_by}
    row = executor.execute(_CREATE_SAGA, params).mappings().one_or_none()
    return SagaRow.from_row(row) if row is not None else None


def get_saga(executor: Executor, ref: SagaRef) -> SagaRow | None:
    """The saga with this key in this agent's scope, or ``None``."""
    row = executor.execute(_GET_SAGA, _of(ref)).mappings().one_or_none()
    return SagaRow.from_row(row) if row is not None else None


def agents_of_key(executor: Executor, key: str) -> list[str]:
    """The agents that have a saga under ``key`` (an operator's search), by name."""
    return [row.agent for row in executor.execute(_AGENTS_OF_KEY, {"key": key})]


def lock_saga(executor: Executor, ref: SagaRef, *, skip_locked: bool = False) -> SagaRow | None:
    """The saga, its row locked until the caller's transaction ends (``FOR NO KEY UPDATE``:
    new steps' foreign keys are not blocked by it). ``None`` if there is none, or, with
    ``skip_locked``, if another transaction holds it."""
    statement = _TRY_LOCK_SAGA if skip_locked else _LOCK_SAGA
    row = executor.execute(statement, _of(ref)).mappings().one_or_none()
    return SagaRow.from_row(row) if row is not None else None


def _of(ref: SagaRef) -> dict[str, str]:
    return {"key": ref.key, "agent": ref.agent}


_STEPS = text(
    """
    SELECT s.saga_key, s.agent, s.position, s.name, s.intent_key, s.grp, s.pivot,
           s.operation_id,
           s.compensate_tool, s.compensate_target, s.compensate_payload,
           s.compensation_operation_id, s.approval_ttl_s, s.released_at, s.created_at,
           o.state, o.remote_ref, o.tool, o.target, o.payload_hash,
           coalesce(o.available_at >= :held, false) AS held,
           c.state AS compensation_state, c.remote_ref AS compensation_remote_ref
    FROM outbox.saga_steps s
    LEFT JOIN outbox.operations o ON o.id = s.operation_id
    LEFT JOIN outbox.operations c ON c.id = s.compensation_operation_id
    WHERE s.saga_key = :key AND s.agent = :agent
    ORDER BY s.position
    """
)


def steps_of(executor: Executor, ref: SagaRef) -> list[StepRow]:
    """The saga's steps in order, each with its operation's and compensation's state."""
    rows = executor.execute(_STEPS, {**_of(ref), "held": HELD_UNTIL}).mappings()
    steps = []
    for row in rows:
        values = dict(row)
        for name in ("state", "compensation_state"):
            values[name] = State(values[name]) if values[name] is not None else None
        steps.append(StepRow(**values))
    return steps


_INSERT_STEP = text(
    """
    INSERT INTO outbox.saga_steps
        (saga_key, agent, position, name, intent_key, grp, pivot, operation_id,
         compensate_tool, compensate_target, compensate_payload, approval_ttl_s, released_at)
    VALUES (:key, :agent, :position, :name, :intent_key, :grp, :pivot, :operation_id,
            :compensate_tool, :compensate_target, CAST(:compensate_payload AS jsonb),
            :approval_ttl_s, CASE WHEN :released THEN clock_timestamp() END)
    """
)


def insert_step(
    executor: Executor,
    *,
    ref: SagaRef,
    position: int,
    name: str,
    intent_key: str,
    grp: str | None,
    pivot: bool,
    operation_id: UUID,
    compensate_tool: str | None,
    compensate_target: str | None,
    compensate_payload: Mapping[str, Any] | None,
    approval_ttl_s: float | None,
    released: bool,
) -> None:
    """Record one step of the saga (its position and name are unique in it)."""
    executor.execute(
        _INSERT_STEP,
        {
            **_of(ref),
            "position": position,
            "name": name,
            "intent_key": intent_key,
            "grp": grp,
            "pivot": pivot,
            "operation_id": operation_id,
            "compensate_tool": compensate_tool,
            "compensate_target": compensate_target,
            "compensate_payload": (
                json.dumps(dict(compensate_payload)) if compensate_payload is not None else None
            ),
            "approval_ttl_s": approval_ttl_s,
            "released": released,
        },
    )


_SET_COMPENSATION = text(
    """
    UPDATE outbox.saga_steps SET compensation_operation_id = :operation_id
    WHERE saga_key = :key AND agent = :agent AND position = :position
    """
)


def set_compensation(executor: Executor, ref: SagaRef, position: int, operation_id: UUID) -> None:
    """Record the operation that undoes step ``position``."""
    executor.execute(
        _SET_COMPENSATION, {**_of(ref), "position": position, "operation_id": operation_id}
    )


_HOLD_OPERATION = text(
    """
    WITH old AS (
        SELECT id, approval_expires_at - created_at AS ttl FROM outbox.operations
        WHERE id = :operation_id AND state IN ('planned', 'awaiting_approval')
          AND attempts = 0
        FOR NO KEY UPDATE
    )
    UPDATE outbox.operations AS o
    SET available_at = :held,
        approval_expires_at = CASE WHEN o.state = 'awaiting_approval' THEN :held
                                   ELSE o.approval_expires_at END
    FROM old WHERE o.id = old.id
    RETURNING o.state, round(extract(epoch FROM old.ttl)) AS ttl_s
    """
)


@dataclass(frozen=True, slots=True)
class Held:
    """A step's operation put on hold: its state, and its approval's TTL if it awaits one."""

    state: State
    approval_ttl_s: float | None


def hold_operation(executor: Executor, operation_id: UUID) -> Held | None:
    """Hold a just-recorded operation for its saga (``available_at`` and, awaiting approval,
    ``approval_expires_at`` set to :data:`HELD_UNTIL`); ``None`` if it is past ``planned``."""
    row = executor.execute(
        _HOLD_OPERATION, {"operation_id": operation_id, "held": HELD_UNTIL}
    ).one_or_none()
    if row is None:
        return None
    state = State(row.state)
    ttl = float(row.ttl_s) if state is State.AWAITING_APPROVAL and row.ttl_s else None
    return Held(state, ttl)


_RELEASE_OPERATION = text(
    """
    WITH released AS (
        UPDATE outbox.operations
        SET available_at = statement_timestamp(),
            approval_expires_at = CASE
                WHEN state = 'awaiting_approval'
                THEN statement_timestamp()
                     + make_interval(secs => coalesce(CAST(:ttl_s AS double precision), 86400))
                ELSE approval_expires_at END
        WHERE id = :operation_id AND available_at >= :held
          AND state IN ('planned', 'awaiting_approval')
        RETURNING state
    ),
    marked AS (
        UPDATE outbox.saga_steps SET released_at = clock_timestamp()
        WHERE operation_id = :operation_id AND released_at IS NULL
    )
    SELECT state,
           -- Ring an idle relay at commit, as enqueue does.
           (SELECT pg_notify('outbox_planned', '')
            WHERE released.state = 'planned' AND EXISTS (SELECT FROM outbox.relays WHERE idle))
             AS rang
    FROM released
    """
)


def release_operation(
    executor: Executor, operation_id: UUID, *, approval_ttl_s: float | None
) -> State | None:
    """Release a held operation: due now (an idle relay rung at commit); awaiting approval,
    its approval expires ``approval_ttl_s`` (default 24 h) from now. Its state, or ``None``
    if it was not held (released already, or moved on)."""
    row = executor.execute(
        _RELEASE_OPERATION,
        {"operation_id": operation_id, "ttl_s": approval_ttl_s, "held": HELD_UNTIL},
    ).one_or_none()
    return State(row.state) if row is not None else None


_MOVE_SAGA = text(
    """
    WITH moved AS (
        UPDATE outbox.sagas
        SET state = :to_state, reason = :reason, updated_at = clock_timestamp(),
            next_check_at = clock_timestamp(),
            cancelled_by = coalesce(CAST(:cancelled_by AS text), cancelled_by)
        WHERE key = :key AND agent = :agent AND state = :from_state
        RETURNING *
    ),
    logged AS (
        INSERT INTO outbox.saga_events
            (saga_key, agent, from_state, to_state, actor, reason, detail)
        SELECT key, agent, :from_state, :to_state, :actor, :reason, CAST(:detail AS jsonb)
        FROM moved
    )
    SELECT * FROM moved
    """
)


def move_saga(
    executor: Executor,
    ref: SagaRef,
    *,
    from_state: str,
    to_state: str,
    actor: str,
    reason: str,
    detail: Mapping[str, Any] | None = None,
    cancelled_by: str | None = None,
) -> SagaRow | None:
    """Move the saga from ``from_state`` to ``to_state`` and log the event, in one statement;
    ``None`` if it is no longer in ``from_state`` (nothing written)."""
    row = (
        executor.execute(
            _MOVE_SAGA,
            {
                **_of(ref),
                "from_state": from_state,
                "to_state": to_state,
                "actor": actor,
                "reason": reason,
                "detail": json.dumps(dict(detail)) if detail is not None else None,
                "cancelled_by": cancelled_by,
            },
        )
        .mappings()
        .one_or_none()
    )
    return SagaRow.from_row(row) if row is not None else None


_INSERT_EVENT = text(
    """
    INSERT INTO outbox.saga_events (saga_key, agent, from_state, to_state, actor, reason, detail)
    VALUES (:key, :agent, :state, :state, :actor, :reason, CAST(:detail AS jsonb))
    """
)


def insert_note(
    executor: Executor,
    ref: SagaRef,
    *,
    state: str,
    actor: str,
    reason: str,
    detail: Mapping[str, Any] | None = None,
) -> None:
    """Append an event that changes no state (a step released, a compensation started)."""
    executor.execute(
        _INSERT_EVENT,
        {
            **_of(ref),
            "state": state,
            "actor": actor,
            "reason": reason,
            "detail": json.dumps(dict(detail)) if detail is not None else None,
        },
    )


_SET_REASON = text(
    """
    UPDATE outbox.sagas SET reason = :reason, cancelled_by = coalesce(:cancelled_by, cancelled_by)
    WHERE key = :key AND agent = :agent
    """
)


def set_reason(
    executor: Executor, ref: SagaRef, *, reason: str | None, cancelled_by: str | None = None
) -> None:
    """Change what the saga says about why it is where it is (no move)."""
    executor.execute(_SET_REASON, {**_of(ref), "reason": reason, "cancelled_by": cancelled_by})


_CHECK_AT = text(
    """
    UPDATE outbox.sagas SET next_check_at = clock_timestamp() + make_interval(secs => :delay_s)
    WHERE key = :key AND agent = :agent
    """
)


def check_again_in(executor: Executor, ref: SagaRef, *, delay_s: float) -> None:
    """When the periodic pass looks at the saga next (``0``: as soon as it runs)."""
    executor.execute(_CHECK_AT, {**_of(ref), "delay_s": delay_s})


# SKIP LOCKED: a saga row held by the driver (which may be moving this very operation, or
# others of the saga, and so holds their locks) is skipped, never waited for: no deadlock
# with a pass, whose own commit or recheck looks at the saga again.
_CHECK_NOW_OF_OPERATION = text(
    """
    UPDATE outbox.sagas SET next_check_at = clock_timestamp()
    WHERE (key, agent) IN (
        SELECT sagas.key, sagas.agent FROM outbox.sagas
        JOIN outbox.saga_steps s ON s.saga_key = sagas.key AND s.agent = sagas.agent
        WHERE (s.operation_id = :id OR s.compensation_operation_id = :id)
          AND sagas.state IN ('compensating', 'needs_human', 'running')
        FOR NO KEY UPDATE OF sagas SKIP LOCKED
    )
    """
)


def check_now_sagas_of(executor: Executor, operation_id: UUID) -> None:
    """Make the live sagas this operation belongs to due on the sweep's next pass."""
    executor.execute(_CHECK_NOW_OF_OPERATION, {"id": operation_id})


_DUE = text(
    """
    SELECT key, agent FROM outbox.sagas
    WHERE state IN ('compensating', 'needs_human', 'running')
      AND next_check_at <= clock_timestamp()
    ORDER BY next_check_at
    LIMIT :limit
    """
)


def due_sagas(executor: Executor, *, limit: int) -> list[SagaRef]:
    """Live sagas whose next check is due, the longest due first."""
    return [SagaRef(row.key, row.agent) for row in executor.execute(_DUE, {"limit": limit})]


_OF_OPERATIONS = text(
    """
    SELECT DISTINCT saga_key, agent FROM outbox.saga_steps
    WHERE operation_id = ANY(CAST(:ids AS uuid[]))
       OR compensation_operation_id = ANY(CAST(:ids AS uuid[]))
    """
)


def sagas_of_operations(executor: Executor, operation_ids: Sequence[UUID]) -> list[SagaRef]:
    """The sagas these operations are steps or compensations of."""
    rows = executor.execute(_OF_OPERATIONS, {"ids": list(operation_ids)})
    return [SagaRef(row.saga_key, row.agent) for row in rows]


_LIST = text(
    """
    SELECT *,
           (SELECT count(*) FROM outbox.saga_steps s
            WHERE s.saga_key = sagas.key AND s.agent = sagas.agent) AS steps
    FROM outbox.sagas
    WHERE (CAST(:state AS text) IS NULL OR state = :state)
      AND (CAST(:agent AS text) IS NULL OR agent = :agent)
      -- The next page: after the previous page's last saga in this order.
      AND (CAST(:after_at AS timestamptz) IS NULL
           OR created_at < :after_at
           OR (created_at = :after_at AND (key, agent) > (:after_key, :after_agent)))
    ORDER BY created_at DESC, key, agent
    LIMIT :limit
    """
)


@dataclass(frozen=True, slots=True)
class ListedSaga:
    """A saga as listed: its row and how many steps it has."""

    saga: SagaRow
    steps: int


def list_sagas(
    executor: Executor,
    *,
    state: str | None,
    limit: int,
    agent: str | None = None,
    after: tuple[datetime, str, str] | None = None,
) -> list[ListedSaga]:
    """Sagas, newest first (then by key and agent), optionally in one state, optionally only
    ``agent``'s, optionally only those after ``after`` (a saga's ``created_at``, ``key`` and
    ``agent``) in that order."""
    after_at, after_key, after_agent = after if after is not None else (None, None, None)
    params = {
        "state": state,
        "limit": limit,
        "agent": agent,
        "after_at": after_at,
        "after_key": after_key,
        "after_agent": after_agent,
    }
    rows = executor.execute(_LIST, params).mappings()
    return [ListedSaga(SagaRow.from_row(row), int(row["steps"])) for row in rows]


@dataclass(frozen=True, slots=True)
class SagaEventRow:
    """One row of ``outbox.saga_events``."""

    id: int
    saga_key: str
    at: datetime
    from_state: str | None
    to_state: str
    actor: str
    reason: str
    detail: dict[str, Any] | None


_EVENTS = text(
    """
    SELECT id, saga_key, at, from_state, to_state, actor, reason, detail
    FROM outbox.saga_events WHERE saga_key = :key AND agent = :agent ORDER BY id
    """
)


def events_of(executor: Executor, ref: SagaRef) -> list[SagaEventRow]:
    """The saga's audit trail, oldest first."""
    return [SagaEventRow(**row) for row in executor.execute(_EVENTS, _of(ref)).mappings()]


_COUNT_BY_STATE = text("SELECT state, count(*) AS n FROM outbox.sagas GROUP BY state")


def count_by_state(executor: Executor) -> dict[str, int]:
    """How many sagas are in each state (states with none are absent)."""
    return {row.state: int(row.n) for row in executor.execute(_COUNT_BY_STATE)}
