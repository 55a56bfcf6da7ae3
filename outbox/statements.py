"""Every SQL statement of the outbox core, each behind a named function.

Components call these and never build SQL inline. Times come from the database:
statements use ``statement_timestamp()`` (the start of *this* statement, not of the
transaction like ``now()``) where one instant must be written to several columns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any
from uuid import UUID

from sqlalchemy import (
    ColumnElement,
    Text,
    cast,
    func,
    insert,
    literal,
    null,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import INTERVAL, JSONB

from outbox.models import Event, Executor, Operation
from outbox.schema import events, operations
from outbox.states import SETTLED_STATES, TERMINAL_STATES, Actor, Effects, State

#: NOTIFY channel announcing that an operation settled; its payload is the operation id.
SETTLED_CHANNEL = "outbox_settled"

_INSERT_INTENT = text(
    """
    WITH new AS (SELECT outbox.uuid_v7() AS id),
    inserted AS (
        INSERT INTO outbox.operations
            (id, intent_key, tool, target, payload, payload_hash, metadata, requested_by)
        SELECT new.id, coalesce(:intent_key, new.id::text), :tool, :target,
               CAST(:payload AS jsonb), :payload_hash, CAST(:metadata AS jsonb), :requested_by
        FROM new
        ON CONFLICT (intent_key) DO NOTHING
        RETURNING *
    ),
    logged AS (
        INSERT INTO outbox.events (operation_id, from_state, to_state, attempt, actor, reason)
        SELECT id, NULL, state, attempts, 'agent', 'enqueued' FROM inserted
    )
    SELECT * FROM inserted
    """
)


def insert_intent(
    executor: Executor,
    *,
    intent_key: str | None,
    tool: str,
    target: str,
    canonical_payload: str,
    payload_hash: str,
    metadata: Mapping[str, Any],
    requested_by: str | None,
) -> Operation | None:
    """Insert a ``planned`` operation and its first event; ``None`` if the key is taken.

    A concurrent transaction inserting the same key makes this wait for its outcome
    (``ON CONFLICT DO NOTHING``), so racing agents end with one row and no IntegrityError.
    """
    row = (
        executor.execute(
            _INSERT_INTENT,
            {
                "intent_key": intent_key,
                "tool": tool,
                "target": target,
                "payload": canonical_payload,
                "payload_hash": payload_hash,
                "metadata": json.dumps(dict(metadata)),
                "requested_by": requested_by,
            },
        )
        .mappings()
        .one_or_none()
    )
    return Operation.from_row(row) if row is not None else None


def get_operation(executor: Executor, operation_id: UUID) -> Operation | None:
    """The operation with this id, or ``None``."""
    row = executor.execute(select(operations).where(operations.c.id == operation_id))
    found = row.mappings().one_or_none()
    return Operation.from_row(found) if found is not None else None


def find_operation(executor: Executor, intent_key: str) -> Operation | None:
    """The operation recorded under this intent key, or ``None``."""
    row = executor.execute(select(operations).where(operations.c.intent_key == intent_key))
    found = row.mappings().one_or_none()
    return Operation.from_row(found) if found is not None else None


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


def list_events(executor: Executor, operation_id: UUID) -> list[Event]:
    """An operation's audit trail, oldest first."""
    query = select(events).where(events.c.operation_id == operation_id).order_by(events.c.id)
    return [Event.from_row(row) for row in executor.execute(query).mappings()]


def _seconds(value: float) -> ColumnElement[Any]:
    return literal(timedelta(seconds=value), INTERVAL)


def _replay_deadline(from_state: State, effects: Effects) -> ColumnElement[Any]:
    """The deadline of a move into ``planned``: set by a replay, kept by an undelivered attempt."""
    if effects.replay_window_s is not None:
        return operations.c.first_sent_at + _seconds(effects.replay_window_s)
    if from_state is State.SENT:
        # sent->planned means the attempt provably never left: the row is the same replay it
        # was before, and its next attempt must still leave inside the dedup window.
        return operations.c.replay_deadline
    return null()


def _changes(from_state: State, to_state: State, effects: Effects) -> dict[str, Any]:
    """The column values a move writes, by the rules of DESIGN.md's bookkeeping columns."""
    o = operations.c
    now = func.statement_timestamp()
    values: dict[str, Any] = {"state": to_state.value, "updated_at": now}
    from_an_attempt = from_state in (State.SENT, State.UNKNOWN)
    if to_state is State.SENT:
        values |= {
            "attempts": o.attempts + 1,
            "sent_at": now,
            "first_sent_at": func.coalesce(o.first_sent_at, now),
        }
    elif to_state is State.PLANNED:
        values |= {
            "published_at": null(),
            "available_at": now + _seconds(effects.available_in_s),
            "next_check_at": null(),
            "checks": 0,
            "replay_deadline": _replay_deadline(from_state, effects),
        }
    elif to_state is State.UNKNOWN:
        values |= {"next_check_at": now + _seconds(effects.check_in_s)}
        if from_state is State.SENT:
            values["checks"] = 0
    else:
        values["next_check_at"] = null()
    if to_state in TERMINAL_STATES:
        values["resolved_at"] = now
    if to_state in (State.UNKNOWN, State.NEEDS_HUMAN) and from_an_attempt:
        values["maybe_applied"] = True
    if effects.maybe_applied is not None:
        values["maybe_applied"] = effects.maybe_applied
    if effects.remote_ref is not None:
        values["remote_ref"] = effects.remote_ref
    if effects.result is not None:
        values["result"] = literal(effects.result, JSONB)
    if effects.last_error is not None:
        values["last_error"] = effects.last_error
    return values


def move(
    executor: Executor,
    operation_id: UUID,
    *,
    from_state: State,
    to_state: State,
    actor: Actor,
    reason: str,
    attempt: int | None,
    effects: Effects,
    detail: Mapping[str, Any] | None,
) -> Operation | None:
    """The compare-and-set behind :func:`outbox.states.transition`; ``None`` if it missed.

    One statement: the UPDATE, the event INSERT fed by its RETURNING, and (for a move
    into a settled state) a NOTIFY for :func:`outbox.wait`. Not to be called directly.
    """
    o = operations.c
    conditions: list[ColumnElement[bool]] = [o.id == operation_id, o.state == from_state.value]
    if attempt is not None:
        conditions.append(o.attempts == attempt)
    if to_state is State.SENT:
        conditions.append(
            or_(o.replay_deadline.is_(None), func.statement_timestamp() < o.replay_deadline)
        )
    if to_state is State.CANCELLED:
        conditions.append(o.maybe_applied.is_(False))
    moved = (
        update(operations)
        .where(*conditions)
        .values(_changes(from_state, to_state, effects))
        .returning(*operations.c)
        .cte("moved")
    )
    logged = insert(events).from_select(
        ["operation_id", "from_state", "to_state", "attempt", "actor", "reason", "detail"],
        select(
            moved.c.id,
            literal(from_state.value),
            literal(to_state.value),
            moved.c.attempts,
            literal(actor.value),
            literal(reason),
            literal(dict(detail), JSONB) if detail is not None else null(),
        ),
    )
    columns: list[Any] = [moved]
    if to_state in SETTLED_STATES:
        columns.append(func.pg_notify(SETTLED_CHANNEL, cast(moved.c.id, Text)))
    query = select(*columns).add_cte(logged.cte("logged"))
    row = executor.execute(query).mappings().one_or_none()
    return Operation.from_row(row) if row is not None else None
