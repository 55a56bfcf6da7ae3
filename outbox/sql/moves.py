"""The statements that change an operation's ``state``, and the note that changes none.

Only :mod:`outbox.transitions` calls this module: it decides which move is allowed and
which columns it writes; here is how that is said in SQL. A move is one statement: the
compare-and-set UPDATE, the event INSERT fed by its RETURNING, and (for a move into a
settled state, while a :func:`outbox.wait` waits for it) a NOTIFY. Times come from the
database: ``statement_timestamp()`` (the start of *this* statement) wherever one instant is
written to several columns.

The statement is built once per :class:`MoveShape` (which states, actor, fence and columns)
and reused with bound values, run as a :class:`~outbox.driver.DriverStatement`: building it
was most of a dispatcher's CPU, and the `sent` move and the confirm are on the hot path.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from sqlalchemy import (
    BigInteger,
    Boolean,
    ColumnElement,
    Integer,
    Text,
    bindparam,
    case,
    cast,
    exists,
    false,
    func,
    insert,
    literal,
    literal_column,
    not_,
    null,
    or_,
    select,
    text,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, INTERVAL, JSONB, TIMESTAMP
from sqlalchemy.dialects.postgresql import UUID as PG_UUID
from sqlalchemy.sql.expression import FromClause, Grouping

from outbox.driver import DriverStatement
from outbox.models import Executor, Operation
from outbox.schema import events, operations, waiters
from outbox.sql import guards
from outbox.sql.columns import HELD_UNTIL, OPERATION_COLUMNS
from outbox.sql.locks import mark_session_locks
from outbox.sql.notify import SETTLED_CHANNEL
from outbox.states import SETTLED_STATES, TERMINAL_STATES, Actor, State


@dataclass(frozen=True)
class MoveShape:
    """What decides a move statement's SQL; everything else is a bound parameter.

    The bound parameters, by name: ``operation_id``, ``reason`` always; ``attempt`` when
    ``fenced``; ``available_in`` (an interval) entering ``planned``, ``replay_window`` with
    ``replay_window``; ``check_in`` entering ``unknown``; ``remote_ref``, ``result``,
    ``last_error`` and ``detail`` when their flag is set.
    """

    from_state: State
    to_state: State
    actor: Actor
    fenced: bool
    remote_ref: bool = False
    result: bool = False
    last_error: bool = False
    #: Authoritative evidence that no attempt applied: ``maybe_applied`` is cleared.
    not_applied: bool = False
    replay_window: bool = False
    detail: bool = False
    #: A person's decision on an approval: ``decided_by`` (bound) and ``decided_at`` written.
    decided: bool = False
    #: An approval: ``approved_hash`` (bound) must be the stored payload hash, the approval
    #: must not have expired, and the hash is kept as ``approved_payload_hash``.
    approval: bool = False
    #: Entering ``awaiting_approval``: ``approval_ttl`` (an interval) sets the expiry.
    approval_ttl: bool = False
    #: The `sent` move of a tool with guards: the guards' admission (``outbox.guard_admit``,
    #: its ``g_*`` parameters) in the same statement, the move only if it admits.
    guarded: bool = False
    #: The `sent` move made by a dispatcher's lock step (:func:`move_at_lock`): the
    #: operation's advisory lock taken first in the same statement, and every check a
    #: dispatcher makes before a send that the database can hold in the compare-and-set
    #: (:class:`SendTerms`). Its event's reason is written from the new attempt number.
    at_lock: bool = False


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


def _changes(shape: MoveShape) -> dict[str, Any]:  # noqa: PLR0912 -- one rule per branch
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
        due: ColumnElement[Any] = now + _interval("available_in")
        if from_state is State.AWAITING_APPROVAL:
            # A saga's held step (docs/sagas.md) approved early stays held: only the saga's
            # driver releases it, when the steps before it are confirmed.
            held = literal(HELD_UNTIL, TIMESTAMP(timezone=True))
            due = case((o.available_at >= held, o.available_at), else_=due)
        values |= {
            "published_at": null(),
            "available_at": due,
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
    if to_state is State.AWAITING_APPROVAL:
        values |= {
            "approval_required": true(),
            "approval_expires_at": now + _interval("approval_ttl"),
        }
    if shape.decided:
        values |= {"decided_by": bindparam("decided_by", type_=Text), "decided_at": now}
    if shape.approval:
        values["approved_payload_hash"] = o.payload_hash
    if to_state in (State.UNKNOWN, State.NEEDS_HUMAN) and from_an_attempt:
        values["maybe_applied"] = true()
    if shape.not_applied:
        values["maybe_applied"] = false()
    if shape.remote_ref:
        values["remote_ref"] = bindparam("remote_ref", type_=Text)
    if shape.result:
        values["result"] = bindparam("result", type_=JSONB)
    if shape.last_error:
        values["last_error"] = bindparam("last_error", type_=Text)
    return values


#: The start of the event reason a `sent` move at the lock writes (the attempt number follows),
#: as the dispatcher's own `sent` move words it.
_DISPATCHING = literal("dispatching attempt ", Text)


@dataclass(frozen=True, slots=True)
class SendTerms:
    """The tools a dispatcher may send at its lock step, and each one's limits: the
    checks before a send that the `sent` compare-and-set holds (:attr:`MoveShape.at_lock`).

    Parallel tuples, one entry per tool: its name, its ``max_attempts`` and whether it
    requires an approval. A row whose tool is not here is not moved (the dispatcher then
    reads it and decides in Python, as for a tool with guards).
    """

    tools: tuple[str, ...]
    max_attempts: tuple[int, ...]
    approval_required: tuple[bool, ...]

    def __post_init__(self) -> None:
        if not len(self.tools) == len(self.max_attempts) == len(self.approval_required):
            raise ValueError("SendTerms: one max_attempts and one approval_required per tool")

    def params(self) -> dict[str, Any]:
        """The statement's ``send_*`` parameters."""
        return {
            "send_tools": list(self.tools),
            "send_max_attempts": list(self.max_attempts),
            "send_approval": list(self.approval_required),
        }


@dataclass(frozen=True, slots=True)
class LockedMove:
    """What a `sent` move at the lock did (:func:`move_at_lock`)."""

    #: The operation's advisory lock was taken (and is held by the session now).
    taken: bool
    #: The session's ``synchronous_commit`` when the statement committed (always ``on``).
    synchronous_commit: str
    #: The operation as moved to `sent`, or ``None``: not moved (lock busy, or a check the
    #: statement holds said no: the caller reads the row and decides).
    moved: Operation | None


# The lock step's own statement (``outbox.sql.locks``' lock-and-read, without the read).
_DISPATCH_LOCK = text(
    """
    SELECT pg_try_advisory_lock(:key) AS taken,
           set_config('synchronous_commit', 'on', false) AS synchronous_commit
    -- An aggregate consumes its input before the lock is taken: the session's previous
    -- locks (the previous operation's) are released first when asked.
    FROM (SELECT count(*) FROM (SELECT pg_advisory_unlock_all() WHERE :unlock_first) AS u)
      AS unlocked
    """
).bindparams(bindparam("key", type_=BigInteger), bindparam("unlock_first", type_=Boolean))


def _dispatch_lock() -> Any:
    """The CTE taking the operation's session advisory lock (``key``), the session's previous
    locks released first when ``unlock_first``, and ``synchronous_commit`` set on for the
    session: the statement's own commit is durable (the setting is read at commit), as
    every later one on the connection."""
    columns = _DISPATCH_LOCK.columns(
        literal_column("taken", Boolean), literal_column("synchronous_commit", Text)
    )
    return columns.cte("lk").prefix_with("MATERIALIZED")


def send_conditions(table: FromClause = operations) -> list[ColumnElement[bool]]:
    """The checks a dispatcher makes before a send, as conditions on the row of ``table``
    (the ones it makes in Python, ``outbox.workers.dispatch._ready_to_send``, in the same
    order): its tool among :class:`SendTerms`' tools, under that tool's ``max_attempts``
    (attempts since the budget's base), not awaiting an approval it lacks (first attempt
    only), and due. The replay deadline is the `sent` move's own condition. A worker's direct
    take makes the same `sent` move in its own statement (``outbox.sql.relay``'s ``moved``
    step, written out: no SQL is built from strings), and these conditions rendered on
    ``outbox.operations AS o`` must appear there word for word
    (tests/unit/test_sql_in_one_place.py; tests/integration/test_sent_at_lock.py and
    test_handoff.py refuse each in each)."""
    o = table.c
    # Each array an explicit CAST of an untyped parameter: the same SQL whether compiled for
    # the driver (``%(x)s``) or for a text statement (``:x``, where a ``::`` cast right after
    # the name would hide it from SQLAlchemy's parser).
    tools = cast(bindparam("send_tools"), ARRAY(Text))
    at = func.array_position(tools, o.tool)
    # Parenthesised: PostgreSQL reads no subscript right after a CAST(...).
    max_attempts = Grouping(cast(bindparam("send_max_attempts"), ARRAY(Integer)))[at]
    approval = Grouping(cast(bindparam("send_approval"), ARRAY(Boolean)))[at]
    return [
        at.is_not(None),
        o.attempts - o.attempt_budget_base < max_attempts,
        not_(
            approval
            & (o.attempts == literal_column("0", Integer))
            & o.approved_payload_hash.is_distinct_from(o.payload_hash)
        ),
        o.available_at <= func.clock_timestamp(),
    ]


@functools.cache
def _move_statement(shape: MoveShape) -> DriverStatement:
    """The one-statement compare-and-set of ``shape``, built once per shape and reused."""
    o = operations.c
    conditions: list[ColumnElement[bool]] = [
        o.id == bindparam("operation_id", type_=PG_UUID(as_uuid=True)),
        # COLLATE "C": the same equality (a deterministic collation compares bytes), but
        # no partial index on ``state`` matches it. A move is by primary key; planned with
        # its values (the first runs of a prepared statement) on a table never analysed (a
        # new deployment; every benchmark round), PostgreSQL otherwise took the partial
        # index of the from-state (``ix_operations_sent_since`` for an outcome) and read
        # every entry it ever held: 2.1 ms against 0.36 by key, for 6 of 97 outcome moves
        # sampled over a flat run (change 44, docs/performance.md).
        o.state.collate("C") == shape.from_state.value,
    ]
    if shape.fenced:
        conditions.append(o.attempts == bindparam("attempt", type_=Integer))
    admission = None
    lock = _dispatch_lock() if shape.at_lock else None
    if lock is not None:
        # First, the lock (a one-time filter, run before the row is read): the row is read
        # and moved only by the lock's holder. A row a transaction committed after this
        # statement's snapshot (the lock's previous holder's last move) is read again at
        # its newest version, the conditions tested on it (READ COMMITTED's recheck).
        conditions.insert(0, select(lock.c.taken).scalar_subquery())
        conditions.extend(send_conditions())
    if shape.guarded:
        # First, a condition on no column (a one-time filter, run before the row is read):
        # the function takes the cap's lock and reads on snapshots of its own, after it.
        admission = select(guards.admit_call()).cte("admission")
        conditions.insert(0, select(admission.c.admitted).scalar_subquery())
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
    if shape.approval:
        # Bound to the payload the approver saw, and only while the approval may be given.
        conditions.append(o.payload_hash == bindparam("approved_hash", type_=Text))
        conditions.append(o.approval_expires_at > func.statement_timestamp())
    if shape.from_state is State.AWAITING_APPROVAL and shape.actor is Actor.SWEEP:
        conditions.append(o.approval_expires_at <= func.statement_timestamp())
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
            _DISPATCHING.concat(cast(moved.c.attempts, Text))
            if shape.at_lock
            else bindparam("reason", type_=Text),
            bindparam("detail", type_=JSONB) if shape.detail else null(),
        ),
    )
    columns: list[Any] = [moved]
    names = list(OPERATION_COLUMNS)
    if lock is not None:
        # The lock's row whether or not the move happened: whether it was taken.
        statement = select(lock.c.taken, lock.c.synchronous_commit, moved)
        statement = statement.select_from(lock.outerjoin(moved, true()))
        names = ["taken", "synchronous_commit", *names]
        return DriverStatement.of(statement.add_cte(logged.cte("logged")), names)
    if admission is not None:
        # The admission's row whether or not the move happened: why it was refused.
        statement = select(*[admission.c[name] for name in guards.ADMITTED_COLUMNS], moved)
        statement = statement.select_from(admission.outerjoin(moved, true()))
        names = [*guards.ADMITTED_COLUMNS, *names]
        return DriverStatement.of(statement.add_cte(logged.cte("logged")), names)
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


def move(executor: Executor, shape: MoveShape, params: Mapping[str, Any]) -> Operation | None:
    """Run the move of ``shape`` with ``params`` in ``executor``'s transaction (never
    commits): the operation as moved, or ``None`` if the compare-and-set missed."""
    row = _move_statement(shape).fetch_one(executor, params)
    return Operation.from_row(row) if row is not None else None


def move_at_lock(
    executor: Executor, shape: MoveShape, params: Mapping[str, Any], terms: SendTerms
) -> LockedMove:
    """Run the `sent` move at the lock (:attr:`MoveShape.at_lock`), with ``params`` (also
    ``key``: the lock; ``unlock_first``: release the session's locks first) and ``terms``, in
    one statement on an autocommit connection: when it returns, the lock is held if taken,
    and a move it made is committed durably. The connection is marked first for the pool's
    reset (the lock outlives any error after it was granted)."""
    mark_session_locks(executor)
    row = _move_statement(shape).fetch_one(executor, {**params, **terms.params()})
    assert row is not None  # noqa: S101 -- the lock's row, always
    moved = Operation.from_row(row) if row["id"] is not None else None
    return LockedMove(bool(row["taken"]), str(row["synchronous_commit"]), moved)


def move_admitted(
    executor: Executor, shape: MoveShape, params: Mapping[str, Any], admission: guards.Admission
) -> tuple[Operation | None, guards.Admitted]:
    """Run the guarded move of ``shape`` (:attr:`MoveShape.guarded`) with ``params`` and the
    guards of ``admission``, in ``executor``'s transaction (never commits): the operation as
    moved (``None``: refused, or the compare-and-set missed) and what the guards said."""
    row = _move_statement(shape).fetch_one(executor, {**params, **admission.params()})
    assert row is not None  # noqa: S101 -- the admission's row, always
    admitted = guards.Admitted.of(row, rate=admission.rate is not None)
    moved = Operation.from_row(row) if row["id"] is not None else None
    return moved, admitted


def insert_note(
    executor: Executor,
    operation_id: UUID,
    *,
    state: State,
    attempt: int,
    actor: Actor,
    reason: str,
    detail: Mapping[str, Any] | None,
) -> None:
    """Append an event that changes no state (``from_state = to_state = state``)."""
    executor.execute(
        insert(events).values(
            operation_id=operation_id,
            from_state=state.value,
            to_state=state.value,
            attempt=attempt,
            actor=actor.value,
            reason=reason,
            detail=detail,
        )
    )
