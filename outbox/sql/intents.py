"""The agent's statements: insert intents, read operations, their events and pruned intents,
and the waiters a settled move notifies."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from sqlalchemy import bindparam, select, text

from outbox.driver import DriverStatement
from outbox.ids import new_operation_id
from outbox.locks import operation_lock_key
from outbox.models import Event, Executor, IntentKey, Operation, PrunedIntent
from outbox.schema import events, operations
from outbox.sql.budgets import BudgetDefinition
from outbox.states import State

_INSERT_INTENT = DriverStatement.of(
    text(
        """
    WITH new AS (
        -- The id and its lock key come from enqueue (outbox.ids; migration 0027).
        SELECT CAST(:id AS uuid) AS id, CAST(:lock_key AS bigint) AS lock_key,
               -- The tool's approval policy (a primary-key probe): an agent process usually
               -- loads no tools, so what the workers loaded reaches enqueue through here.
               (CAST(:require_approval AS boolean)
                OR coalesce(policy.approval_required, false)) AS approval,
               coalesce(CAST(:approval_ttl_s AS double precision), policy.approval_ttl_s,
                        86400) AS ttl_s,
               -- A budgeted tool is inserted by the budget path (outbox.budgets), under its
               -- keys' locks: here nothing is inserted. No budgets: one scan of an empty table.
               EXISTS (SELECT FROM outbox.budgets WHERE :tool = ANY(budgets.tools))
                 AS budgeted
        FROM (SELECT) AS one
        LEFT JOIN outbox.tool_policies AS policy ON policy.tool = :tool
    ),
    inserted AS (
        INSERT INTO outbox.operations
            (id, lock_key, intent_key, agent, tool, target, payload, payload_hash, intent_hash,
             metadata, requested_by, traceparent, tracestate, state, approval_required,
             approval_expires_at)
        SELECT new.id, new.lock_key, coalesce(:intent_key, new.id::text), :agent, :tool,
               :target,
               CAST(:payload AS jsonb), :payload_hash, :intent_hash, CAST(:metadata AS jsonb),
               :requested_by, :traceparent, :tracestate,
               CASE WHEN new.approval THEN 'awaiting_approval' ELSE 'planned' END,
               new.approval,
               CASE WHEN new.approval
                    THEN statement_timestamp() + make_interval(secs => new.ttl_s) END
        FROM new
        -- A key whose operation was pruned is done (for its agent; for every agent if it was
        -- pruned before agents were recorded): one primary-key range probe, in this statement.
        WHERE NOT new.budgeted
          AND NOT EXISTS (SELECT FROM outbox.pruned_intents
                          WHERE intent_key = :intent_key AND (agent = :agent OR all_agents))
        ON CONFLICT (intent_key, agent) DO NOTHING
        RETURNING *
    ),
    logged AS (
        INSERT INTO outbox.events (operation_id, from_state, to_state, attempt, actor, reason)
        SELECT id, NULL, state, attempts, 'agent', 'enqueued' FROM inserted
    )
    -- Only what the database chose: the rest of the new row is what the caller passed and
    -- the columns' defaults (reading all of it back was a third of enqueue's CPU).
    SELECT inserted.id, inserted.intent_key, inserted.created_at, inserted.updated_at,
           inserted.available_at, inserted.state, inserted.approval_expires_at,
           -- Ring the relay only while one sleeps: NOTIFY serialises commits cluster-wide,
           -- so a busy relay (which polls anyway) must not cost the agent's commit that lock.
           -- (Nor for an operation awaiting approval: no relay publishes it.)
           (SELECT pg_notify('outbox_planned', '')
            WHERE inserted.state = 'planned' AND EXISTS (SELECT FROM outbox.relays WHERE idle))
             AS rang,
           new.budgeted,
           -- What the budget path needs first, in this round trip (budgeted tools only).
           CASE WHEN new.budgeted THEN
             (SELECT json_agg(json_build_object(
                         'name', b.name, 'tools', b.tools, 'counted_by', b.counted_by,
                         'window_s', b.window_s, 'max_operations', b.max_operations,
                         'cost_path', b.cost_path, 'max_cost', b.max_cost) ORDER BY b.name)
              FROM outbox.budgets AS b WHERE :tool = ANY(b.tools))
           END AS budgets
    FROM new LEFT JOIN inserted ON inserted.id = new.id
    """
    ),
    [
        "id",
        "intent_key",
        "created_at",
        "updated_at",
        "available_at",
        "state",
        "approval_expires_at",
        "rang",
        "budgeted",
        "budgets",
    ],
)


@dataclass(frozen=True, slots=True)
class Budgeted:
    """The intent's tool has budgets: nothing was inserted; the budget path inserts it."""

    #: The published budgets covering the tool, by name.
    definitions: list[BudgetDefinition]


def insert_intent(
    executor: Executor,
    *,
    intent_key: str | None,
    agent: str,
    tool: str,
    target: str,
    canonical_payload: str,
    payload_hash: str,
    intent_hash: str,
    metadata: Mapping[str, Any],
    requested_by: str | None,
    require_approval: bool = False,
    approval_ttl_s: float | None = None,
    traceparent: str | None = None,
    tracestate: str | None = None,
) -> Operation | Budgeted | None:
    """Insert a ``planned`` operation and its first event; ``None`` if ``agent``'s key is
    taken (by an operation, or by a pruned one: :func:`find_pruned_intents`); :class:`Budgeted`,
    inserting nothing, if a published budget covers the tool.

    It is inserted ``awaiting_approval`` instead when ``require_approval`` or the tool's
    policy in ``outbox.tool_policies`` says so, expiring ``approval_ttl_s`` from now (default:
    the policy's TTL, else 24 h).

    A concurrent transaction inserting the same key makes this wait for its outcome
    (``ON CONFLICT DO NOTHING``), so racing agents end with one row and no IntegrityError.
    """
    operation_id = new_operation_id()
    row = _INSERT_INTENT.fetch_one(
        executor,
        {
            "id": operation_id,
            "lock_key": operation_lock_key(operation_id),
            "intent_key": intent_key,
            "agent": agent,
            "tool": tool,
            "target": target,
            "payload": canonical_payload,
            "payload_hash": payload_hash,
            "intent_hash": intent_hash,
            "metadata": json.dumps(dict(metadata)),
            "requested_by": requested_by,
            "require_approval": require_approval,
            "approval_ttl_s": approval_ttl_s,
            "traceparent": traceparent,
            "tracestate": tracestate,
        },
    )
    if row is None:
        return None
    if row["budgeted"]:
        return Budgeted([BudgetDefinition(**d) for d in row["budgets"] or []])
    if row["id"] is None:
        return None
    state = State(row["state"])
    return Operation(
        id=row["id"],
        intent_key=row["intent_key"],
        agent=agent,
        tool=tool,
        target=target,
        payload=json.loads(canonical_payload),
        payload_hash=payload_hash,
        state=state,
        attempts=0,
        checks=0,
        maybe_applied=False,
        remote_ref=None,
        result=None,
        last_error=None,
        metadata=dict(metadata),
        requested_by=requested_by,
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        available_at=row["available_at"],
        published_at=None,
        first_sent_at=None,
        sent_at=None,
        next_check_at=None,
        replay_deadline=None,
        resolved_at=None,
        attempt_budget_base=0,
        intent_hash=intent_hash,
        approval_required=state is State.AWAITING_APPROVAL,
        approval_expires_at=row["approval_expires_at"],
        traceparent=traceparent,
        tracestate=tracestate,
    )


@dataclass(frozen=True, slots=True)
class UsageRow:
    """What the intent at ``position`` (from 0) of a batch uses of one budget key."""

    position: int
    budget: str
    key: str
    cost: float


@dataclass(frozen=True, slots=True)
class InsertedIntents:
    """What :func:`insert_intents` did: each inserted intent's operation by position (from 0),
    and the positions skipped because a budget covers their tool (the budget path's)."""

    operations: dict[int, Operation]
    budgeted: list[int]


_INSERT_INTENTS = text(
    """
    WITH input AS (
        SELECT * FROM unnest(
            CAST(:intent_keys AS text[]), CAST(:agents AS text[]), CAST(:tools AS text[]),
            CAST(:targets AS text[]),
            CAST(:payloads AS jsonb[]), CAST(:payload_hashes AS text[]),
            CAST(:intent_hashes AS text[]), CAST(:metadata AS jsonb[]),
            CAST(:requested_by AS text[]), CAST(:require_approval AS boolean[]),
            CAST(:approval_ttl_s AS double precision[]), CAST(:traceparents AS text[]),
            CAST(:tracestates AS text[]), CAST(:ids AS uuid[]), CAST(:lock_keys AS bigint[])
        ) WITH ORDINALITY
          AS i(intent_key, agent, tool, target, payload, payload_hash, intent_hash, metadata,
               requested_by, require_approval, approval_ttl_s, traceparent, tracestate, id,
               lock_key, n)
    ),
    new AS (
        -- Each tool's approval policy, one primary-key probe per intent (see _INSERT_INTENT).
        SELECT input.*,
               (input.require_approval OR coalesce(policy.approval_required, false)) AS approval,
               coalesce(input.approval_ttl_s, policy.approval_ttl_s, 86400) AS ttl_s,
               -- Skipped when budgeted, unless the budget path checked it (outbox.budgets).
               (NOT CAST(:budgets_checked AS boolean)
                AND EXISTS (SELECT FROM outbox.budgets WHERE input.tool = ANY(budgets.tools)))
                 AS budgeted
        FROM input LEFT JOIN outbox.tool_policies AS policy ON policy.tool = input.tool
    ),
    inserted AS (
        INSERT INTO outbox.operations
            (id, lock_key, intent_key, agent, tool, target, payload, payload_hash, intent_hash,
             metadata, requested_by, traceparent, tracestate, state, approval_required,
             approval_expires_at)
        SELECT id, lock_key, coalesce(intent_key, id::text), agent, tool, target, payload,
               payload_hash, intent_hash, metadata, requested_by, traceparent, tracestate,
               CASE WHEN approval THEN 'awaiting_approval' ELSE 'planned' END, approval,
               CASE WHEN approval THEN statement_timestamp() + make_interval(secs => ttl_s) END
        FROM new
        WHERE NOT new.budgeted
          AND NOT EXISTS (SELECT FROM outbox.pruned_intents p
                          WHERE p.intent_key = new.intent_key
                            AND (p.agent = new.agent OR p.all_agents))
        ORDER BY n
        ON CONFLICT (intent_key, agent) DO NOTHING
        RETURNING *
    ),
    logged AS (
        INSERT INTO outbox.events (operation_id, from_state, to_state, attempt, actor, reason)
        SELECT id, NULL, state, attempts, 'agent', 'enqueued' FROM inserted
    ),
    -- What each inserted operation uses of its budgets (only a re-key-free insert counts).
    used AS (
        INSERT INTO outbox.budget_usage (budget, key, operation_id, cost)
        SELECT u.budget, u.key, inserted.id, u.cost
        FROM unnest(CAST(:usage_positions AS bigint[]), CAST(:usage_budgets AS text[]),
                    CAST(:usage_keys AS text[]), CAST(:usage_costs AS double precision[]))
               AS u(n, budget, key, cost)
        JOIN new ON new.n = u.n
        JOIN inserted ON inserted.id = new.id
    ),
    rang AS (
        SELECT pg_notify('outbox_planned', '')
        WHERE EXISTS (SELECT FROM inserted WHERE state = 'planned')
          AND EXISTS (SELECT FROM outbox.relays WHERE idle)
    )
    SELECT inserted.*, new.n AS position, new.budgeted, (SELECT count(*) FROM rang) AS rang
    FROM new LEFT JOIN inserted ON inserted.id = new.id
    WHERE inserted.id IS NOT NULL OR new.budgeted
    ORDER BY new.n
    """
)


def insert_intents(
    executor: Executor,
    *,
    intent_keys: Sequence[str | None],
    agents: Sequence[str],
    tools: Sequence[str],
    targets: Sequence[str],
    canonical_payloads: Sequence[str],
    payload_hashes: Sequence[str],
    intent_hashes: Sequence[str],
    metadata: Sequence[str],
    requested_by: Sequence[str | None],
    require_approval: Sequence[bool] | None = None,
    approval_ttl_s: Sequence[float | None] | None = None,
    traceparents: Sequence[str | None] | None = None,
    tracestates: Sequence[str | None] | None = None,
    usage: Sequence[UsageRow] = (),
    budgets_checked: bool = False,
) -> InsertedIntents:
    """Insert many ``planned`` operations and their first events in one statement.

    Each is inserted ``awaiting_approval`` when its ``require_approval`` or its tool's policy
    says so (see :func:`insert_intent`). Keys already taken (or being inserted by a
    concurrent transaction, which this waits for), and keys of pruned operations, are
    skipped, and so are intents whose tool a published budget covers, unless ``usage`` is
    given (the budget path, which checked them under their keys' locks: each inserted
    intent's rows are written to ``outbox.budget_usage``, none for a skipped one).
    """
    ids = [new_operation_id() for _ in tools]
    rows = executor.execute(
        _INSERT_INTENTS,
        {
            "ids": ids,
            "lock_keys": [operation_lock_key(one) for one in ids],
            "intent_keys": list(intent_keys),
            "agents": list(agents),
            "tools": list(tools),
            "targets": list(targets),
            "payloads": list(canonical_payloads),
            "payload_hashes": list(payload_hashes),
            "intent_hashes": list(intent_hashes),
            "metadata": list(metadata),
            "requested_by": list(requested_by),
            "require_approval": list(require_approval or [False] * len(tools)),
            "approval_ttl_s": list(approval_ttl_s or [None] * len(tools)),
            "traceparents": list(traceparents or [None] * len(tools)),
            "tracestates": list(tracestates or [None] * len(tools)),
            "budgets_checked": budgets_checked,
            "usage_positions": [u.position + 1 for u in usage],
            "usage_budgets": [u.budget for u in usage],
            "usage_keys": [u.key for u in usage],
            "usage_costs": [u.cost for u in usage],
        },
    )
    inserted: dict[int, Operation] = {}
    budgeted: list[int] = []
    for row in rows.mappings():
        position = int(row["position"]) - 1
        if row["budgeted"]:
            budgeted.append(position)
        else:
            inserted[position] = Operation.from_row(row)
    return InsertedIntents(inserted, budgeted)


_FIND_OPERATIONS = text(
    "SELECT o.* "
    "FROM unnest(CAST(:intent_keys AS text[]), CAST(:agents AS text[])) AS k(intent_key, agent) "
    "JOIN outbox.operations AS o ON o.intent_key = k.intent_key AND o.agent = k.agent"
)


def find_operations(executor: Executor, keys: Sequence[IntentKey]) -> list[Operation]:
    """The operations recorded under these agents' intent keys (those that exist)."""
    rows = executor.execute(_FIND_OPERATIONS, _scoped(keys))
    return [Operation.from_row(row) for row in rows.mappings()]


# A row pruned before agents were recorded (all_agents) answers for every agent's key: it is
# returned with the agent that asked, so the caller matches it like any other.
_FIND_PRUNED_INTENTS = text(
    "SELECT p.*, k.agent AS asked_by "
    "FROM unnest(CAST(:intent_keys AS text[]), CAST(:agents AS text[])) AS k(intent_key, agent) "
    "JOIN outbox.pruned_intents AS p "
    "ON p.intent_key = k.intent_key AND (p.agent = k.agent OR p.all_agents)"
)


def find_pruned_intents(executor: Executor, keys: Sequence[IntentKey]) -> list[PrunedIntent]:
    """What is kept of the pruned operations recorded under these agents' intent keys (those
    pruned). A row pruned before agents were recorded (``all_agents``) is found for every
    agent, as the agent that asked."""
    rows = executor.execute(_FIND_PRUNED_INTENTS, _scoped(keys))
    return [PrunedIntent.from_row({**row, "agent": row["asked_by"]}) for row in rows.mappings()]


def _scoped(keys: Sequence[IntentKey]) -> dict[str, list[str]]:
    return {"intent_keys": [k.key for k in keys], "agents": [k.agent for k in keys]}


_GET_OPERATION = select(operations).where(operations.c.id == bindparam("operation_id"))


def get_operation(executor: Executor, operation_id: UUID) -> Operation | None:
    """The operation with this id, or ``None``."""
    row = executor.execute(_GET_OPERATION, {"operation_id": operation_id})
    found = row.mappings().one_or_none()
    return Operation.from_row(found) if found is not None else None


_FIND_OPERATION = select(operations).where(
    operations.c.intent_key == bindparam("intent_key"), operations.c.agent == bindparam("agent")
)


def find_operation(executor: Executor, intent_key: str, *, agent: str) -> Operation | None:
    """The operation recorded under ``agent``'s intent key, or ``None``."""
    row = executor.execute(_FIND_OPERATION, {"intent_key": intent_key, "agent": agent})
    found = row.mappings().one_or_none()
    return Operation.from_row(found) if found is not None else None


_FIND_EVERY_AGENTS = (
    select(operations)
    .where(operations.c.intent_key == bindparam("intent_key"))
    .order_by(operations.c.agent)
)


def find_every_agents(executor: Executor, intent_key: str) -> list[Operation]:
    """Every agent's operation recorded under ``intent_key``, by agent (the unique index's
    leading column answers it)."""
    rows = executor.execute(_FIND_EVERY_AGENTS, {"intent_key": intent_key})
    return [Operation.from_row(row) for row in rows.mappings()]


def list_operations(
    executor: Executor,
    *,
    state: State | None = None,
    tool: str | None = None,
    limit: int = 50,
) -> list[Operation]:
    """The newest operations first (ids are UUIDv7, so id order is creation order)."""
    query = select(operations).order_by(operations.c.id.desc()).limit(limit)
    if state is not None:
        query = query.where(operations.c.state == state.value)
    if tool is not None:
        query = query.where(operations.c.tool == tool)
    return [Operation.from_row(row) for row in executor.execute(query).mappings()]


_LIST_EVENTS = (
    select(events).where(events.c.operation_id == bindparam("operation_id")).order_by(events.c.id)
)


def list_events(executor: Executor, operation_id: UUID) -> list[Event]:
    """An operation's audit trail, oldest first."""
    rows = executor.execute(_LIST_EVENTS, {"operation_id": operation_id})
    return [Event.from_row(row) for row in rows.mappings()]


_REGISTER_WAITER = text(
    "WITH gone AS (DELETE FROM outbox.waiters WHERE backend_pid NOT IN "
    "(SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL)) "
    "INSERT INTO outbox.waiters (operation_id, backend_pid) "
    "VALUES (:operation_id, pg_backend_pid()) ON CONFLICT DO NOTHING"
)


def register_waiter(executor: Executor, operation_id: UUID) -> None:
    """Ask settled moves of ``operation_id`` to NOTIFY this session (until forget_waiter).

    Also drops rows of sessions that ended without forgetting theirs (a killed waiter):
    each would cost its operation one needless NOTIFY.
    """
    executor.execute(_REGISTER_WAITER, {"operation_id": operation_id})


_FORGET_WAITER = text(
    "DELETE FROM outbox.waiters "
    "WHERE operation_id = :operation_id AND backend_pid = pg_backend_pid()"
)


def forget_waiter(executor: Executor, operation_id: UUID) -> None:
    """Undo :func:`register_waiter` for this session."""
    executor.execute(_FORGET_WAITER, {"operation_id": operation_id})


_GET_OPERATIONS = select(operations).where(
    operations.c.id.in_(bindparam("operation_ids", expanding=True))
)


def get_operations(executor: Executor, operation_ids: Sequence[UUID]) -> list[Operation]:
    """The operations with these ids (those that exist), in no particular order: the
    re-reads of many waiters (:mod:`outbox.aio`) in one round trip."""
    rows = executor.execute(_GET_OPERATIONS, {"operation_ids": list(operation_ids)})
    return [Operation.from_row(row) for row in rows.mappings()]


_REGISTER_WAITERS = text(
    "WITH gone AS (DELETE FROM outbox.waiters WHERE backend_pid NOT IN "
    "(SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL)) "
    "INSERT INTO outbox.waiters (operation_id, backend_pid) "
    "SELECT operation_id, pg_backend_pid() "
    "FROM unnest(CAST(:operation_ids AS uuid[])) AS operation_id ON CONFLICT DO NOTHING"
)


def register_waiters(executor: Executor, operation_ids: Sequence[UUID]) -> None:
    """:func:`register_waiter` for many operations in one statement (:mod:`outbox.aio`)."""
    executor.execute(_REGISTER_WAITERS, {"operation_ids": list(operation_ids)})


_FORGET_WAITERS = text(
    "DELETE FROM outbox.waiters "
    "WHERE operation_id = ANY(CAST(:operation_ids AS uuid[])) AND backend_pid = pg_backend_pid()"
)


def forget_waiters(executor: Executor, operation_ids: Sequence[UUID]) -> None:
    """:func:`forget_waiter` for many operations in one statement (:mod:`outbox.aio`)."""
    executor.execute(_FORGET_WAITERS, {"operation_ids": list(operation_ids)})
