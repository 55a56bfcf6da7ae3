"""Every change of an operation's ``state``: the one module that writes that column.

One named function per transition builds its :class:`Move` and takes only the columns
that belong to it (:func:`mark_sent`, :func:`confirm`, :func:`fail`, :func:`mark_unknown`,
:func:`replan`, :func:`escalate`, :func:`cancel`, :func:`approve`, :func:`reject`,
:func:`expire_approval`, :func:`await_approval`); a :class:`Move` built any other way with
a column its target state does not take is refused (``ValueError``), never silently cut.

A move runs in one of two ways, named for who commits:

* :func:`apply` joins the caller's transaction and never commits (the agent's
  :func:`outbox.cancel`, an operator's :func:`outbox.resolve`);
* :func:`apply_and_commit` commits the move on its own, and returns the
  :class:`~outbox.errors.StaleTransition` instead of raising it when the row moved on
  (the dispatcher, the sweep and the reconcilers, which act on that answer).

Either way the move is a compare-and-set on the state the caller saw (and the attempt
number, where an attempt is concerned) that appends its event in the same statement
(:mod:`outbox.sql.moves`), and writes its webhook delivery rows in the same transaction
(:func:`outbox.webhooks.record_for_move`). A move that is not allowed, or misses, raises a
typed error and writes nothing. The rule for evidence that arrives after the row moved on is
:func:`keep_late_evidence_and_commit`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar
from uuid import UUID

from sqlalchemy import Connection

from outbox import storable, webhooks
from outbox.errors import (
    NotCancellable,
    OperationNotFound,
    ReplayDeadlinePassed,
    StaleTransition,
)
from outbox.models import Executor, Operation
from outbox.sql import guards as guard_sql
from outbox.sql import intents
from outbox.sql import moves as sql
from outbox.sql import relay as relay_sql
from outbox.sql import sagas as saga_sql
from outbox.sql.moves import SendTerms
from outbox.states import (
    COLUMNS_FOR,
    Actor,
    State,
    check_allowed,
    check_remote_ref,
    may_take_late_evidence,
)

__all__ = [
    "AdmittedMove",
    "LateEvidence",
    "LockedSend",
    "Move",
    "Moved",
    "SendTerms",
    "apply",
    "apply_admitted_and_commit",
    "apply_and_commit",
    "apply_guarded_and_commit",
    "approve",
    "await_approval",
    "cancel",
    "confirm",
    "escalate",
    "expire_approval",
    "fail",
    "hold_and_commit",
    "hold_for_saga",
    "keep_late_evidence_and_commit",
    "lock_and_mark_sent_and_commit",
    "mark_sent",
    "mark_unknown",
    "note",
    "reject",
    "release_for_saga",
    "replan",
    "take_and_mark_sent",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Move:
    """One requested move: who, from where to where, why, and the columns it writes.

    Build it with the named function of its transition. Columns a move into ``to_state``
    does not take (:data:`outbox.states.COLUMNS_FOR`) raise ``ValueError`` here.
    """

    operation_id: UUID
    from_state: State
    to_state: State
    actor: Actor
    reason: str
    #: The attempt the caller saw; ``None`` for a move not fenced on one (a cancel).
    attempt: int | None
    detail: Mapping[str, Any] | None = None
    #: The remote's identifier for the effect; required to enter ``confirmed``.
    remote_ref: str | None = None
    #: The remote's answer (JSON), kept for the operator.
    result: Any = None
    #: Why the last attempt or check did not succeed, for people.
    last_error: str | None = None
    #: Authoritative evidence that no attempt applied: ``maybe_applied`` is cleared.
    not_applied: bool = False
    #: Entering ``planned``: seconds before it becomes due again (backoff).
    available_in_s: float = 0.0
    #: Entering ``planned`` for a dedup replay: the replay must leave before
    #: ``first_sent_at`` + this many seconds (the window minus the safety margin).
    replay_window_s: float | None = None
    #: Entering ``unknown``: seconds before the reconciler's first check.
    check_in_s: float = 0.0
    #: Leaving ``awaiting_approval`` by a person's (or the sweep's) decision: who decided.
    decided_by: str | None = None
    #: An approval: the payload hash the approver saw (must be the stored one).
    approved_payload_hash: str | None = None
    #: Entering ``awaiting_approval``: seconds until the approval expires.
    approval_ttl_s: float | None = None

    def __post_init__(self) -> None:
        allowed = COLUMNS_FOR[self.to_state]
        given = {
            name
            for name, value, unset in (
                ("remote_ref", self.remote_ref, None),
                ("result", self.result, None),
                ("last_error", self.last_error, None),
                ("not_applied", self.not_applied, False),
                ("available_in_s", self.available_in_s, 0.0),
                ("replay_window_s", self.replay_window_s, None),
                ("check_in_s", self.check_in_s, 0.0),
                ("decided_by", self.decided_by, None),
                ("approved_payload_hash", self.approved_payload_hash, None),
                ("approval_ttl_s", self.approval_ttl_s, None),
            )
            if value != unset
        }
        if extra := sorted(given - allowed):
            raise ValueError(
                f"a move to {self.to_state.value} does not write {', '.join(extra)}; "
                f"it writes only: {', '.join(sorted(allowed)) or 'nothing but its state'}"
            )


@dataclass(frozen=True, slots=True)
class Moved:
    """A move that happened: the operation as it now is, and where it came from."""

    operation: Operation
    from_state: State
    actor: Actor

    @property
    def to_state(self) -> State:
        """The state the operation was moved into."""
        return self.operation.state


# --- one named function per transition -----------------------------------------------------


def mark_sent(operation_id: UUID, *, attempt: int | None, reason: str) -> Move:
    """``planned -> sent`` by the dispatcher, before any byte leaves; fenced on ``attempt``
    (the attempts so far). Refused (:class:`ReplayDeadlinePassed`) once a replay's deadline
    has passed; never waits on another transaction's row lock (``lock_not_available``)."""
    return Move(
        operation_id=operation_id,
        from_state=State.PLANNED,
        to_state=State.SENT,
        actor=Actor.DISPATCHER,
        reason=reason,
        attempt=attempt,
    )


def confirm(
    operation_id: UUID,
    *,
    from_state: State,
    actor: Actor,
    attempt: int | None,
    reason: str,
    remote_ref: str,
    result: Any = None,
    detail: Mapping[str, Any] | None = None,
) -> Move:
    """Into ``confirmed``: the effect exists at the remote as ``remote_ref`` (required)."""
    return Move(
        operation_id=operation_id,
        from_state=from_state,
        to_state=State.CONFIRMED,
        actor=actor,
        reason=reason,
        attempt=attempt,
        detail=detail,
        remote_ref=remote_ref,
        result=result,
    )


def fail(
    operation_id: UUID,
    *,
    from_state: State,
    actor: Actor,
    attempt: int | None,
    reason: str,
    last_error: str | None = None,
    result: Any = None,
    detail: Mapping[str, Any] | None = None,
) -> Move:
    """Into ``failed``: authoritatively not applied, so ``maybe_applied`` is cleared."""
    return Move(
        operation_id=operation_id,
        from_state=from_state,
        to_state=State.FAILED,
        actor=actor,
        reason=reason,
        attempt=attempt,
        detail=detail,
        last_error=last_error,
        result=result,
        not_applied=True,
    )


def mark_unknown(
    operation_id: UUID,
    *,
    actor: Actor,
    attempt: int | None,
    reason: str,
    last_error: str | None = None,
    check_in_s: float = 0.0,
    detail: Mapping[str, Any] | None = None,
) -> Move:
    """``sent -> unknown``: the attempt's outcome cannot be told yet; ``maybe_applied`` is
    set and the reconciler's first check is due in ``check_in_s``."""
    return Move(
        operation_id=operation_id,
        from_state=State.SENT,
        to_state=State.UNKNOWN,
        actor=actor,
        reason=reason,
        attempt=attempt,
        detail=detail,
        last_error=last_error,
        check_in_s=check_in_s,
    )


def replan(
    operation_id: UUID,
    *,
    from_state: State,
    actor: Actor,
    attempt: int | None,
    reason: str,
    last_error: str | None = None,
    available_in_s: float = 0.0,
    replay_window_s: float | None = None,
    not_applied: bool = False,
    detail: Mapping[str, Any] | None = None,
) -> Move:
    """Back to ``planned``, due in ``available_in_s``: an attempt that provably never left,
    a dedup replay (``replay_window_s``: it must leave before ``first_sent_at`` + that), or
    authoritative evidence that nothing applied (``not_applied`` clears ``maybe_applied``)."""
    return Move(
        operation_id=operation_id,
        from_state=from_state,
        to_state=State.PLANNED,
        actor=actor,
        reason=reason,
        attempt=attempt,
        detail=detail,
        last_error=last_error,
        available_in_s=available_in_s,
        replay_window_s=replay_window_s,
        not_applied=not_applied,
    )


def escalate(
    operation_id: UUID,
    *,
    from_state: State,
    actor: Actor,
    attempt: int | None,
    reason: str,
    not_applied: bool = False,
    detail: Mapping[str, Any] | None = None,
) -> Move:
    """Into ``needs_human``: an operator must decide. From an attempt (``sent``,
    ``unknown``) ``maybe_applied`` is set, unless ``not_applied`` says nothing applied."""
    return Move(
        operation_id=operation_id,
        from_state=from_state,
        to_state=State.NEEDS_HUMAN,
        actor=actor,
        reason=reason,
        attempt=attempt,
        detail=detail,
        not_applied=not_applied,
    )


def cancel(operation_id: UUID, *, reason: str, from_state: State = State.PLANNED) -> Move:
    """``planned`` (or ``awaiting_approval``) ``-> cancelled`` by the agent; refused
    (:class:`NotCancellable`) when an earlier attempt may have applied."""
    return Move(
        operation_id=operation_id,
        from_state=from_state,
        to_state=State.CANCELLED,
        actor=Actor.AGENT,
        reason=reason,
        attempt=None,
    )


def approve(
    operation_id: UUID,
    *,
    decided_by: str,
    approved_payload_hash: str,
    reason: str,
    detail: Mapping[str, Any] | None = None,
) -> Move:
    """``awaiting_approval -> planned`` by an operator, due at once: only while the stored
    payload hash is ``approved_payload_hash`` (the payload the approver saw) and the approval
    has not expired (database clock). Records who, when and the hash: single-use."""
    return Move(
        operation_id=operation_id,
        from_state=State.AWAITING_APPROVAL,
        to_state=State.PLANNED,
        actor=Actor.OPERATOR,
        reason=reason,
        attempt=0,
        detail=detail,
        decided_by=decided_by,
        approved_payload_hash=approved_payload_hash,
    )


def reject(
    operation_id: UUID, *, decided_by: str, reason: str, detail: Mapping[str, Any] | None = None
) -> Move:
    """``awaiting_approval -> cancelled`` by an operator, who is recorded with the time."""
    return Move(
        operation_id=operation_id,
        from_state=State.AWAITING_APPROVAL,
        to_state=State.CANCELLED,
        actor=Actor.OPERATOR,
        reason=reason,
        attempt=0,
        detail=detail,
        decided_by=decided_by,
    )


def expire_approval(operation_id: UUID) -> Move:
    """``awaiting_approval -> cancelled`` by the sweep, only once the approval's expiry has
    passed (database clock): ``approval expired``."""
    return Move(
        operation_id=operation_id,
        from_state=State.AWAITING_APPROVAL,
        to_state=State.CANCELLED,
        actor=Actor.SWEEP,
        reason="approval expired",
        attempt=0,
    )


def await_approval(operation_id: UUID, *, attempt: int, approval_ttl_s: float, reason: str) -> Move:
    """``planned -> awaiting_approval`` by the dispatcher: its tool requires approval and the
    row has none (it was enqueued before the tool's policy reached the database). The row is
    marked as requiring approval, expiring ``approval_ttl_s`` from now."""
    return Move(
        operation_id=operation_id,
        from_state=State.PLANNED,
        to_state=State.AWAITING_APPROVAL,
        actor=Actor.DISPATCHER,
        reason=reason,
        attempt=attempt,
        approval_ttl_s=approval_ttl_s,
    )


# --- running a move -------------------------------------------------------------------------


def apply(executor: Executor, move: Move) -> Moved:
    """Make ``move`` inside the caller's transaction; never commits.

    Raises :class:`~outbox.errors.TransitionNotAllowed` for a move the table forbids to its
    actor (or a confirm without a ``remote_ref``), :class:`StaleTransition` when the row is
    no longer where the caller saw it, :class:`ReplayDeadlinePassed` when a replay would
    leave after its deadline, :class:`NotCancellable` when a cancel meets an attempt that
    may have applied, and :class:`OperationNotFound`. In every one of these cases nothing
    is written.

    The reason, the detail and the remote's values are made storable first
    (:mod:`outbox.storable`): a NUL byte in a remote's answer must not make the move raise.
    """
    reason = storable.text(move.reason)
    moved = sql.move(executor, _shape(move), _params(move, reason))
    if moved is None:
        raise _why_missed(executor, move)
    return _moved(executor, move, moved, reason)


def _shape(move: Move, *, guarded: bool = False) -> sql.MoveShape:
    """The statement shape of ``move``, once the table allows it to its actor."""
    check_allowed(move.from_state, move.to_state, move.actor)
    check_remote_ref(move.from_state, move.to_state, move.actor, move.remote_ref)
    return sql.MoveShape(
        from_state=move.from_state,
        to_state=move.to_state,
        actor=move.actor,
        fenced=move.attempt is not None,
        remote_ref=move.remote_ref is not None,
        result=move.result is not None,
        last_error=move.last_error is not None,
        not_applied=move.not_applied,
        replay_window=move.replay_window_s is not None,
        detail=move.detail is not None,
        decided=move.decided_by is not None,
        approval=move.approved_payload_hash is not None,
        approval_ttl=move.approval_ttl_s is not None,
        guarded=guarded,
    )


def _moved(executor: Executor, move: Move, moved: Operation, reason: str) -> Moved:
    """A move that happened: its webhook deliveries written in the same transaction."""
    webhooks.record_for_move(
        executor,
        moved,
        from_state=move.from_state,
        to_state=move.to_state,
        actor=move.actor,
        reason=reason,
    )
    if move.actor in _DECIDERS and "saga" in moved.metadata:
        # A person's or the agent's word on a saga's operation (resolve, approve, reject,
        # cancel): its saga is looked at on the sweep's next pass, not after its recheck
        # delay. Workers nudge it themselves after they commit.
        saga_sql.check_now_sagas_of(executor, moved.id)
    return Moved(moved, move.from_state, move.actor)


_DECIDERS = frozenset({Actor.OPERATOR, Actor.AGENT})


def _params(move: Move, reason: str) -> dict[str, Any]:
    """The bound values of ``move``'s statement (see :class:`outbox.sql.moves.MoveShape`)."""
    params: dict[str, Any] = {"operation_id": move.operation_id, "reason": reason}
    if move.attempt is not None:
        params["attempt"] = move.attempt
    if move.to_state is State.PLANNED:
        params["available_in"] = timedelta(seconds=move.available_in_s)
        if move.replay_window_s is not None:
            params["replay_window"] = timedelta(seconds=move.replay_window_s)
    elif move.to_state is State.UNKNOWN:
        params["check_in"] = timedelta(seconds=move.check_in_s)
    if move.remote_ref is not None:
        params["remote_ref"] = storable.text(move.remote_ref)
    if move.result is not None:
        params["result"] = storable.json_value(move.result)
    if move.last_error is not None:
        params["last_error"] = storable.text(move.last_error)
    if move.detail is not None:
        params["detail"] = storable.json_mapping(move.detail)
    if move.decided_by is not None:
        params["decided_by"] = storable.text(move.decided_by)
    if move.approved_payload_hash is not None:
        params["approved_hash"] = move.approved_payload_hash
    if move.approval_ttl_s is not None:
        params["approval_ttl"] = timedelta(seconds=move.approval_ttl_s)
    return params


def apply_and_commit(conn: Connection, move: Move) -> Moved | StaleTransition:
    """Make ``move`` and commit it on its own; the :class:`StaleTransition` (returned, not
    raised; nothing written) when the row is no longer where the caller saw it.

    ``conn`` must have no transaction open. Any other refusal raises, as :func:`apply`.
    """
    try:
        with _own_transaction(conn, move):
            return apply(conn, move)
    except StaleTransition as missed:
        return missed


Refusal = TypeVar("Refusal")


def apply_guarded_and_commit(
    conn: Connection, move: Move, admit: Callable[[Connection], Refusal | None]
) -> Moved | StaleTransition | Refusal:
    """As :func:`apply_and_commit`, with ``admit`` (the tool's guards) asked first in the
    same transaction: a refusal it returns rolls everything back (no token taken, no probe
    claimed) and is returned; otherwise the move and the guards' writes commit together.
    Always a real transaction, even on an AUTOCOMMIT connection."""
    try:
        with _own_transaction(conn, move, force=True):
            refused = admit(conn)
            if refused is not None:
                conn.rollback()
                return refused
            return apply(conn, move)
    except StaleTransition as missed:
        return missed


@dataclass(frozen=True, slots=True)
class LockedSend:
    """What :func:`lock_and_mark_sent_and_commit` did."""

    #: The operation's advisory lock was taken: the connection holds it now.
    taken: bool
    #: The session's ``synchronous_commit`` as the statement committed (``on``).
    synchronous_commit: str
    #: The `sent` move, committed durably; ``None`` if nothing moved (the lock was busy,
    #: or a check said no: read the row and decide).
    moved: Moved | None


#: The `sent` move of a dispatcher's lock step: not fenced (its checks are in the statement).
_SENT_AT_LOCK = sql.MoveShape(
    from_state=State.PLANNED,
    to_state=State.SENT,
    actor=Actor.DISPATCHER,
    fenced=False,
    at_lock=True,
)


def lock_and_mark_sent_and_commit(
    conn: Connection, operation_id: UUID, *, lock_key: int, unlock_first: bool, terms: SendTerms
) -> LockedSend:
    """Take ``operation_id``'s advisory lock and, once it is held, move the operation
    ``planned -> sent`` if every check ``terms`` holds passes, in one statement committed
    durably by itself (the dispatcher's lock step and `sent` move as one round trip).

    ``conn`` must be in AUTOCOMMIT mode, and no webhook may subscribe to the `sent` move
    (its delivery rows would need the move's transaction): :exc:`ValueError` otherwise.
    ``unlock_first``: release the session's advisory locks before taking this one (the
    previous operation's). The row is tested at its newest committed version; a row another
    transaction holds raises ``lock_not_available`` at once, nothing written (the lock may
    be held by then: the caller's connection is marked for the pool's reset).
    """
    _check_sent_by_itself(conn)
    params = {"operation_id": operation_id, "key": lock_key, "unlock_first": unlock_first}
    locked = sql.move_at_lock(conn, _SENT_AT_LOCK, params, terms)
    moved = None
    if locked.moved is not None:
        moved = Moved(locked.moved, State.PLANNED, Actor.DISPATCHER)
    return LockedSend(locked.taken, locked.synchronous_commit, moved)


def _check_sent_by_itself(conn: Connection) -> None:
    """A `sent` move made inside a lock step or a take commits by itself: the dispatcher may
    make it, on an AUTOCOMMIT connection, and no webhook subscribes to it (its delivery rows
    would need the move's transaction); :exc:`ValueError` otherwise."""
    check_allowed(State.PLANNED, State.SENT, Actor.DISPATCHER)
    if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
        raise ValueError("a `sent` move at the lock commits by itself: AUTOCOMMIT only")
    if webhooks.subscribed_events(State.PLANNED, State.SENT, Actor.DISPATCHER):
        raise ValueError("a webhook subscribes to the `sent` move: it needs a transaction")


def take_and_mark_sent(
    conn: Connection, *, republish_after_s: float, terms: SendTerms
) -> relay_sql.DueTake:
    """A worker's direct take of one due operation (:func:`outbox.sql.relay.take_due`, with
    its lock) that also moves it ``planned -> sent`` once the lock is held, if every check
    ``terms`` holds passes: one statement, committed durably by itself (``DueTake.sent``).

    ``conn`` must be in AUTOCOMMIT mode and no webhook may subscribe to the `sent` move:
    :exc:`ValueError` otherwise, as :func:`lock_and_mark_sent_and_commit`. A take whose row
    carried a lock key that is not its own reports it moved but not locked: the caller must
    send it back (nothing was sent) without the lock it thought it took.
    """
    _check_sent_by_itself(conn)
    return relay_sql.take_due(
        conn, limit=1, republish_after_s=republish_after_s, lock=True, send=terms
    )


@dataclass(frozen=True, slots=True)
class AdmittedMove:
    """A `sent` move asked of the guards in its own statement: the move (``None``: the
    guards refused it, nothing written) and what the guards said."""

    moved: Moved | StaleTransition | None
    admitted: guard_sql.Admitted


def apply_admitted_and_commit(
    conn: Connection, move: Move, admission: guard_sql.Admission
) -> AdmittedMove:
    """Make the `sent` ``move`` only if the guards of ``admission`` admit it, in one statement
    with their admission (``outbox.guard_admit``: with a cap, the key's lock is held until
    this commits), and commit. A refusal writes nothing (no token taken). An admitted move
    whose compare-and-set misses (a duplicate message) returns the
    :class:`StaleTransition` and has used a token for nothing (it only ever sends less)."""
    reason = storable.text(move.reason)
    shape = _shape(move, guarded=True)
    missed: StaleTransition | None = None
    with _own_transaction(conn, move):
        row, admitted = sql.move_admitted(conn, shape, _params(move, reason), admission)
        if not admitted.admitted:
            return AdmittedMove(None, admitted)
        if row is not None:
            return AdmittedMove(_moved(conn, move, row, reason), admitted)
        why = _why_missed(conn, move)
        if not isinstance(why, StaleTransition):
            raise why
        missed = why
    return AdmittedMove(missed, admitted)


def hold_and_commit(
    conn: Connection, operation_id: UUID, *, attempt: int, delay_s: float, reason: str
) -> bool:
    """Keep a ``planned`` operation ``planned`` and push its ``available_at`` ``delay_s`` out
    (a guard held it): not a move, no attempt, no event; ``published_at`` is cleared so the
    relay publishes it again when due. Whether the row was still ``planned`` at ``attempt``.
    ``conn`` must have no transaction open."""
    with _own_transaction(conn, None):
        held = guard_sql.hold(
            conn, operation_id, attempt=attempt, delay_s=delay_s, reason=storable.text(reason)
        )
    return held is not None


def hold_for_saga(executor: Executor, operation_id: UUID) -> saga_sql.Held | None:
    """Hold a just-recorded saga step (``planned`` or ``awaiting_approval``, no attempt):
    ``available_at`` (and an approval's expiry) set to :data:`outbox.sql.columns.HELD_UNTIL`,
    so no relay publishes it, no dispatcher sends it and its approval cannot expire. Not a
    move: no event (the saga's own trail says it). In the caller's transaction; never commits.
    What it held (its state and approval TTL), or ``None`` if the row is past ``planned``."""
    return saga_sql.hold_operation(executor, operation_id)


def release_for_saga(
    executor: Executor, operation_id: UUID, *, approval_ttl_s: float | None
) -> State | None:
    """Release a held saga step: due now (an idle relay rung at commit); one still awaiting
    approval gets a fresh approval TTL of ``approval_ttl_s`` from now. Not a move. In the
    caller's transaction; never commits. Its state, or ``None`` if it was not held."""
    return saga_sql.release_operation(executor, operation_id, approval_ttl_s=approval_ttl_s)


@contextmanager
def _own_transaction(conn: Connection, move: Move | None, *, force: bool = False) -> Iterator[None]:
    """The transaction ``move`` commits in, on ``conn``.

    A connection in AUTOCOMMIT mode (the dispatcher's lock connection: one round trip per
    move) commits each statement by itself, and a move is one statement, so there is
    nothing to wrap. Except when the move also writes webhook delivery rows (the webhook
    settings, ``OUTBOX_WEBHOOK_URL`` and ``OUTBOX_WEBHOOK_EVENTS``, subscribe to an event it
    makes): the move and its deliveries must commit together, so for that move alone the
    connection leaves AUTOCOMMIT for one real transaction, and returns to it after. This is
    the only place the isolation level changes, and it depends on those settings on purpose.
    """
    autocommit = conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
    subscribed = move is not None and webhooks.subscribed_events(
        move.from_state, move.to_state, move.actor
    )
    if autocommit and (force or subscribed):
        conn.commit()  # ends SQLAlchemy's autobegun (autocommit) transaction: nothing to send
        conn.execution_options(isolation_level=conn.default_isolation_level)
        try:
            with conn.begin():
                yield
        finally:
            conn.execution_options(isolation_level="AUTOCOMMIT")
    else:
        with conn.begin():
            yield


def _why_missed(executor: Executor, move: Move) -> Exception:
    """Why the compare-and-set of ``move`` matched no row, read from the row as it is now."""
    operation_id, from_state, attempt = move.operation_id, move.from_state, move.attempt
    current = intents.get_operation(executor, operation_id)
    if current is None:
        return OperationNotFound(f"no operation {operation_id}", operation_id=operation_id)
    where_seen = current.state is from_state and attempt in (None, current.attempts)
    if where_seen and move.to_state is State.SENT:
        return ReplayDeadlinePassed(
            f"operation {operation_id}: the dedup window closed before the replay left "
            f"(replay deadline {current.replay_deadline})",
            operation_id=operation_id,
            expected=(from_state, attempt),
            actual=(current.state, current.attempts),
        )
    if where_seen and move.to_state is State.CANCELLED and move.from_state is State.PLANNED:
        return NotCancellable(
            f"operation {operation_id} cannot be cancelled: attempt {current.attempts} may "
            "have reached the remote; resolve it instead",
            operation_id=operation_id,
        )
    expected = from_state.value + (f" at attempt {attempt}" if attempt is not None else "")
    return StaleTransition(
        f"operation {operation_id} is {current.state.value} at attempt {current.attempts}, "
        f"not {expected}; nothing was changed",
        operation_id=operation_id,
        expected=(from_state, attempt),
        actual=(current.state, current.attempts),
    )


# --- events that change no state ----------------------------------------------------------


def note(
    executor: Executor,
    operation_id: UUID,
    *,
    state: State,
    attempt: int,
    actor: Actor,
    reason: str,
    detail: Mapping[str, Any] | None = None,
) -> None:
    """Append an event that changes no state (a late outcome, evidence that lost a race, a
    sweep's failure), in the caller's transaction; never commits.

    ``reason`` and ``detail`` are made storable (:mod:`outbox.storable`): they quote remotes.
    """
    sql.insert_note(
        executor,
        operation_id,
        state=state,
        attempt=attempt,
        actor=actor,
        reason=storable.text(reason),
        detail=storable.json_mapping(detail) if detail is not None else None,
    )


@dataclass(frozen=True, slots=True)
class LateEvidence:
    """What :func:`keep_late_evidence_and_commit` did."""

    #: The operation as it was when the evidence was kept; ``None``: it no longer exists.
    current: Operation | None
    #: Whether the evidence confirmed it (it still waited for a verdict at that attempt).
    confirmed: bool


def keep_late_evidence_and_commit(
    conn: Connection,
    operation_id: UUID,
    *,
    attempt: int,
    noted_by: Actor,
    note_reason: str,
    remote_ref: str | None = None,
    result: Any = None,
    confirm_reason: str = "",
) -> LateEvidence:
    """The one rule for evidence about ``attempt`` that arrives after the row moved on: keep
    it, and confirm only a row that still waits for a verdict at that attempt.

    The evidence is kept as an event (``note_reason``, by ``noted_by``) on the row as it is
    now, committed. ``remote_ref`` given means the remote says the effect applied: if the
    row still waits for a verdict (``unknown`` or ``needs_human``) at that same attempt, it
    is confirmed (actor ``evidence``, ``confirm_reason``), committed; a decision made in
    between wins, and the evidence stays in the event. ``conn`` must have no transaction
    open.
    """
    with conn.begin():
        current = intents.get_operation(conn, operation_id)
        if current is None:
            return LateEvidence(None, confirmed=False)
        note(
            conn,
            operation_id,
            state=current.state,
            attempt=attempt,
            actor=noted_by,
            reason=note_reason,
        )
    if remote_ref is None or not may_take_late_evidence(current.state, current.attempts, attempt):
        return LateEvidence(current, confirmed=False)
    moved = apply_and_commit(
        conn,
        confirm(
            operation_id,
            from_state=current.state,
            actor=Actor.EVIDENCE,
            attempt=attempt,
            reason=confirm_reason,
            remote_ref=remote_ref,
            result=result,
        ),
    )
    return LateEvidence(current, confirmed=isinstance(moved, Moved))
