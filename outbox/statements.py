"""The statements of a move: the compare-and-set behind :func:`outbox.states.transition`, and
the event a non-move records (the rest of the SQL is in :mod:`outbox.sql`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from uuid import UUID

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Integer,
    Text,
    bindparam,
    cast,
    exists,
    func,
    insert,
    literal,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import INTERVAL, JSONB
from sqlalchemy.dialects.postgresql import UUID as PG_UUID

from outbox import storable
from outbox.driver import DriverStatement
from outbox.models import Executor, Operation
from outbox.schema import events, operations, waiters
from outbox.sql.columns import OPERATION_COLUMNS as _OPERATION_COLUMNS
from outbox.sql.notify import SETTLED_CHANNEL
from outbox.states import SETTLED_STATES, TERMINAL_STATES, Actor, Effects, State


def _interval(name: str) -> ColumnElement[Any]:
    return bindparam(name, type_=INTERVAL)


def _replay_deadline(from_state: State, has_replay_window: bool) -> ColumnElement[Any]:
    """The deadline of a move into ``planned``: set by a replay, kept by an undelivered attempt."""
    if has_replay_window:
        return operations.c.first_sent_at + _interval("replay_window")
    if from_state is State.SENT:
        # sent->planned means the attempt provably never left: the row is the same replay it
        # was before, and its next attempt must still leave inside the dedup window.
        return operations.c.replay_deadline
    return null()


@dataclass(frozen=True)
class _MoveShape:
    """What decides a move statement's SQL; everything else is a bound parameter."""

    from_state: State
    to_state: State
    actor: Actor
    fenced: bool
    remote_ref: bool
    result: bool
    last_error: bool
    maybe_applied: bool
    replay_window: bool
    detail: bool


def _changes(shape: _MoveShape) -> dict[str, Any]:
    """The column values a move writes, by the rules of DESIGN.md's bookkeeping columns."""
    o = operations.c
    from_state, to_state = shape.from_state, shape.to_state
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
            "available_at": now + _interval("available_in"),
            "next_check_at": null(),
            "checks": 0,
            "replay_deadline": _replay_deadline(from_state, shape.replay_window),
        }
        if shape.actor is Actor.OPERATOR:
            # A person authorised this replay: earlier attempts no longer count against
            # max_attempts, or the dispatcher would send it straight back to them.
            values["attempt_budget_base"] = o.attempts
    elif to_state is State.UNKNOWN:
        values |= {"next_check_at": now + _interval("check_in")}
        if from_state is State.SENT:
            values["checks"] = 0
    else:
        values["next_check_at"] = null()
    if to_state in TERMINAL_STATES:
        values["resolved_at"] = now
    if to_state in (State.UNKNOWN, State.NEEDS_HUMAN) and from_an_attempt:
        values["maybe_applied"] = True
    if shape.maybe_applied:
        values["maybe_applied"] = bindparam("maybe_applied", type_=Boolean)
    if shape.remote_ref:
        values["remote_ref"] = bindparam("remote_ref", type_=Text)
    if shape.result:
        values["result"] = bindparam("result", type_=JSONB)
    if shape.last_error:
        values["last_error"] = bindparam("last_error", type_=Text)
    return values


@functools.cache
def _move_statement(shape: _MoveShape) -> DriverStatement:
    """The one-statement compare-and-set of ``shape``, built once per shape and reused."""
    o = operations.c
    conditions: list[ColumnElement[bool]] = [
        o.id == bindparam("operation_id", type_=PG_UUID(as_uuid=True)),
        o.state == shape.from_state.value,
    ]
    if shape.fenced:
        conditions.append(o.attempts == bindparam("attempt", type_=Integer))
    if shape.to_state is State.SENT:
        conditions.append(
            or_(o.replay_deadline.is_(None), func.statement_timestamp() < o.replay_deadline)
        )
        # Never wait on a row lock here (a relay's claim, an agent's open cancel): sent_at is
        # the statement's start, so a wait inside it would eat the send deadline and stretch
        # the in-flight horizon. A held row raises lock_not_available at once, nothing
        # written; the dispatcher waits with wait_for_row_lock (no attempt yet) and tries again.
        row = operations.alias("row_lock")
        conditions.append(
            o.id.in_(
                select(row.c.id)
                .where(row.c.id == bindparam("operation_id", type_=PG_UUID(as_uuid=True)))
                .with_for_update(nowait=True, key_share=True)
            )
        )
    if shape.to_state is State.CANCELLED:
        conditions.append(o.maybe_applied.is_(False))
    moved = (
        update(operations)
        .where(*conditions)
        .values(_changes(shape))
        .returning(*operations.c)
        .cte("moved")
    )
    logged = insert(events).from_select(
        ["operation_id", "from_state", "to_state", "attempt", "actor", "reason", "detail"],
        select(
            moved.c.id,
            literal(shape.from_state.value),
            literal(shape.to_state.value),
            moved.c.attempts,
            literal(shape.actor.value),
            bindparam("reason", type_=Text),
            bindparam("detail", type_=JSONB) if shape.detail else null(),
        ),
    )
    columns: list[Any] = [moved]
    names = list(_OPERATION_COLUMNS)
    if shape.to_state in SETTLED_STATES:
        # Only while someone waits for this operation (outbox.waiters): a NOTIFY holds a
        # cluster-wide lock from before the commit until it is flushed, so one on every
        # settled move made the workers' outcome commits queue behind one another.
        notify = (
            select(func.pg_notify(SETTLED_CHANNEL, cast(moved.c.id, Text)))
            .where(exists().where(waiters.c.operation_id == moved.c.id))
            .scalar_subquery()
        )
        columns.append(notify.label("notified"))
        names.append("notified")
    return DriverStatement.of(select(*columns).add_cte(logged.cte("logged")), names)


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
    into a settled state, while a :func:`outbox.wait` waits for it) a NOTIFY. Not to be
    called directly. The statement is built once per shape (which states, actor, fence and
    effects are present) and reused with bound values: building it was most of a
    dispatcher's CPU.
    """
    shape = _MoveShape(
        from_state=from_state,
        to_state=to_state,
        actor=actor,
        fenced=attempt is not None,
        remote_ref=effects.remote_ref is not None,
        result=effects.result is not None,
        last_error=effects.last_error is not None,
        maybe_applied=effects.maybe_applied is not None,
        replay_window=effects.replay_window_s is not None,
        detail=detail is not None,
    )
    params: dict[str, Any] = {"operation_id": operation_id, "reason": reason}
    if attempt is not None:
        params["attempt"] = attempt
    if to_state is State.PLANNED:
        params["available_in"] = timedelta(seconds=effects.available_in_s)
        if effects.replay_window_s is not None:
            params["replay_window"] = timedelta(seconds=effects.replay_window_s)
    if to_state is State.UNKNOWN:
        params["check_in"] = timedelta(seconds=effects.check_in_s)
    if effects.maybe_applied is not None:
        params["maybe_applied"] = effects.maybe_applied
    if effects.remote_ref is not None:
        params["remote_ref"] = effects.remote_ref
    if effects.result is not None:
        params["result"] = effects.result
    if effects.last_error is not None:
        params["last_error"] = effects.last_error
    if detail is not None:
        params["detail"] = dict(detail)
    row = _move_statement(shape).fetch_one(executor, params)
    return Operation.from_row(row) if row is not None else None


def record_event(
    executor: Executor,
    operation_id: UUID,
    *,
    state: State,
    attempt: int,
    actor: Actor,
    reason: str,
    detail: Mapping[str, Any] | None = None,
) -> None:
    """Append an event that changes no state (a late outcome, evidence that lost a race).

    ``reason`` and ``detail`` are made storable (:mod:`outbox.storable`): they quote remotes.
    """
    executor.execute(
        insert(events).values(
            operation_id=operation_id,
            from_state=state.value,
            to_state=state.value,
            attempt=attempt,
            actor=actor.value,
            reason=storable.text(reason),
            detail=storable.json_mapping(detail) if detail is not None else None,
        )
    )
