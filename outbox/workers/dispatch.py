"""The dispatch protocol (DESIGN.md), as a plain function: :func:`dispatch`.

1. One connection for this attempt, shared with nothing; the operation's session advisory
   lock on it (a miss: another component owns the operation).
2. On that connection, compare-and-set ``planned → sent`` with ``synchronous_commit=on``,
   committed before any byte leaves. A row found in ``sent`` means its dispatcher is gone:
   it moves to ``unknown`` and the remote is never called from here.
   The compare-and-set never waits on a row lock (a relay's claim still open): the wait
   happens before it, outside the attempt, so it neither counts as an attempt nor eats the
   send deadline.
3. The send deadline (from the start of the `sent` commit), then the tool call under one
   total deadline, no retries inside; the call carries the deadline, checked again by the
   transport (or a Python tool) right before its first byte.
   For a tool without guards, steps 1 and 2 are one statement
   (:func:`outbox.transitions.lock_and_mark_sent_and_commit`): the lock first, then the
   compare-and-set with every check the database can hold (the tool registered here, its
   ``max_attempts``, its approval, due, the replay deadline); the one it cannot, the payload
   against its hashes (canonical JSON, in Python), comes right after that commit and before
   any byte leaves: a row that fails it goes back to `planned` as never sent, then to a
   person. Any other case (a check said no, the row held by another transaction) reads the
   row with the lock kept and decides here, as for a tool with guards.
4. The outcome, classified and committed fenced by the attempt number; a write that misses
   (the sweep moved on) is kept as a "late outcome" event, and confirms the operation if it
   still waits at that attempt for a verdict.
5. The lock is released (or the connection discarded) whatever happened.

A message is only a doorbell: every branch here is safe for a lost, duplicated or
reordered message, and for a ``kill -9`` at any line.

Round trips are the dispatcher's cost, so the lock connection is in autocommit mode: the
lock with the `sent` move or with the read (the row read after the lock was granted, in the
same statement), each move (one statement: the compare-and-set, its event and any NOTIFY)
and the unlock are one round trip each, every move committed durably by its own statement.
A move that also writes webhook deliveries runs in an explicit transaction instead, so the
deliveries commit with it or not at all.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from dataclasses import dataclass
from uuid import UUID

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from outbox import faults, guard_state, sql, tracing, transitions, webhooks
from outbox.backoff import exponential_s, jittered
from outbox.canonical import canonical_json, intent_hash, payload_hash
from outbox.contracts import ToolContract
from outbox.errors import ReplayDeadlinePassed
from outbox.guards import GuardKey
from outbox.logs import Action
from outbox.models import Operation
from outbox.sql.locks import DispatchView
from outbox.states import Actor, State
from outbox.tools import REGISTRY, Tool, ToolCall, run_dispatch
from outbox.tools.registry import ToolRegistry
from outbox.tools.results import (
    Ambiguous,
    Applied,
    DispatchResult,
    NotDelivered,
    NotSent,
    Rejected,
)
from outbox.transitions import Move, Moved, SendTerms
from outbox.workers.locking import DispatchLocks, Found, SentAtLock

log = logging.getLogger(__name__)


class Outcome(enum.StrEnum):
    """How one :func:`dispatch` call ended."""

    LOCK_BUSY = "lock_busy"  #: another component holds the operation: try again shortly
    DEFERRED = "deferred"  #: no time left in this message for a whole attempt: nothing written
    GONE = "gone"  #: no such operation (another deployment's, or deleted): logged, counted
    NOT_DUE = "not_due"  #: still backing off; the relay publishes it again when due
    HELD = "held"  #: a guard (breaker, rate, concurrency) held it: still planned, no attempt
    NOT_PLANNED = "not_planned"  #: a duplicate message: someone already moved it on
    DISPATCHER_LOST = "dispatcher_lost"  #: found in `sent`: moved to `unknown`, not called
    NEEDS_HUMAN = "needs_human"  #: cannot be dispatched (unknown tool, limits, deadline)
    AWAITING_APPROVAL = "awaiting_approval"  #: its tool requires an approval it does not have
    NOT_SENT = "not_sent"  #: the send deadline passed after the `sent` commit: not called
    CONFIRMED = "confirmed"
    FAILED = "failed"
    UNKNOWN = "unknown"
    REPLANNED = "replanned"  #: provably not delivered: back to `planned` with backoff
    LATE = "late"  #: the outcome arrived after the row moved on; kept as an event


@dataclass(frozen=True)
class DispatchReport:
    """What :func:`dispatch` did, for the task's log line and for tests."""

    operation_id: UUID
    outcome: Outcome
    attempt: int | None = None
    detail: str = ""
    #: The operation is a saga's step or compensation (its metadata names the saga): the
    #: task nudges the saga's driver once the outcome is committed.
    saga: bool = False


@dataclass(frozen=True, kw_only=True)
class DispatchConfig:
    """Dispatcher knobs, each with the reason for its default."""

    #: First backoff after a provably undelivered attempt; doubles per attempt.
    base_backoff_s: float = 1.0
    #: Ceiling of that backoff, so a remote back from an outage is retried promptly.
    max_backoff_s: float = 60.0
    #: Longest wait, before an attempt, for the operation's row while another transaction
    #: holds it (a relay whose claim is not committed yet: milliseconds as a rule); past
    #: it the message is put back (LOCK_BUSY), no attempt counted.
    row_lock_wait_s: float = 5.0
    #: Time an attempt needs beyond its tool's send deadline and timeout (the commits
    #: around the call), when a message checks it still has room for one (``finish_by``).
    attempt_margin_s: float = 2.0
    #: Move the operation to `sent` in the statement that takes its lock (one round trip
    #: fewer), for the tools whose every check before a send the database can hold: the ones
    #: without guards (their admission is a statement of its own), and only while no webhook
    #: subscribes to the `sent` move. Every other case reads the row and decides in Python.
    send_at_lock: bool = True


def dispatch(
    operation_id: UUID | str,
    *,
    engine: Engine,
    registry: ToolRegistry = REGISTRY,
    config: DispatchConfig | None = None,
    locks: DispatchLocks | None = None,
    finish_by: float | None = None,
) -> DispatchReport:
    """Make at most one attempt of one operation, by the dispatch protocol.

    ``locks``: the :class:`DispatchLocks` of the message this operation came in, so the
    previous operation's lock is released in the statement that takes this one (default:
    a connection of its own, released on return).
    ``finish_by``: a ``time.monotonic()`` instant the attempt must end by (the message's
    hard time limit); an attempt that could not (send deadline + timeout + margin) is not
    started: :attr:`Outcome.DEFERRED`, nothing written.
    """
    op_id = UUID(str(operation_id))
    config = config or DispatchConfig()
    terms = send_terms(registry, config, finish_by) if config.send_at_lock else None
    with (
        contextlib.nullcontext(locks) if locks is not None else DispatchLocks(engine) as held,
        held.lock(op_id, send=terms) as locked,
    ):
        if locked is None:
            return DispatchReport(op_id, Outcome.LOCK_BUSY)
        faults.point("after_lock")
        conn, found = locked
        return _attempt(
            engine, conn, op_id, found, registry=registry, config=config, finish_by=finish_by
        )


def send_terms(
    registry: ToolRegistry = REGISTRY,
    config: DispatchConfig | None = None,
    finish_by: float | None = None,
) -> SendTerms | None:
    """The tools this worker may move to `sent` at the lock (:attr:`DispatchConfig.send_at_lock`)
    or at a direct take, with their limits; ``None`` if none may. A tool whose whole attempt
    would not end by ``finish_by`` is left out: its operation is read and deferred as before."""
    config = config or DispatchConfig()
    if webhooks.subscribed_events(State.PLANNED, State.SENT, Actor.DISPATCHER):
        return None
    now = time.monotonic()
    names: list[str] = []
    max_attempts: list[int] = []
    approval: list[bool] = []
    for name in registry.names():
        tool = registry.get(name)
        if tool is None or tool.contract.guarded:
            continue
        contract = tool.contract
        needed = contract.send_deadline_s + contract.timeout_s + config.attempt_margin_s
        if finish_by is not None and now + needed > finish_by:
            continue
        names.append(name)
        max_attempts.append(contract.max_attempts)
        approval.append(contract.approval_required)
    if not names:
        return None
    return SendTerms(tuple(names), tuple(max_attempts), tuple(approval))


def _attempt(
    engine: Engine,
    conn: Connection,
    op_id: UUID,
    found: Found,
    *,
    registry: ToolRegistry,
    config: DispatchConfig,
    finish_by: float | None,
) -> DispatchReport:
    if found is None:
        return _unknown_operation(conn, op_id)
    # The attempt's span, in the trace of the agent that enqueued the operation (a no-op
    # without an SDK tracer provider): docs/observability.md.
    with tracing.operation_span(DISPATCH_SPAN, found.operation, kind="consumer") as span:
        report = _attempt_in_span(
            engine, conn, found, span, registry=registry, config=config, finish_by=finish_by
        )
        tracing.outcome(span, report.outcome.value, attempt=report.attempt)
        return report


#: The span of one dispatch message's work on one operation, and of its tool call.
DISPATCH_SPAN = "outbox.dispatch"
CALL_SPAN = "outbox.tool.call"


def _attempt_in_span(
    engine: Engine,
    conn: Connection,
    found: DispatchView | SentAtLock,
    span: tracing.Span | None,
    *,
    registry: ToolRegistry,
    config: DispatchConfig,
    finish_by: float | None,
) -> DispatchReport:
    op_id = found.operation.id
    observed = guard_state.Observed()
    if isinstance(found, SentAtLock):
        committed = _sent_at_lock(conn, found, registry)
    else:
        ready = _ready_to_send(conn, found.operation, found.due, found.replay_expired, registry)
        if isinstance(ready, DispatchReport):
            return ready
        op, tool = ready
        committed = _commit_sent(conn, op, tool, config, finish_by, observed=observed)
    if isinstance(committed, DispatchReport):
        return committed
    sent, tool, send_by = committed
    tracing.state_event(span, sent)
    if time.monotonic() > send_by:
        return _not_sent(conn, sent, tool.contract)
    with tracing.operation_span(
        CALL_SPAN,
        sent,
        kind="client",
        child=True,
        attributes=tool.span_attributes("dispatch") if tracing.active() else None,
    ) as call_span:
        result = run_dispatch(
            tool,
            ToolCall(
                operation_id=str(op_id),
                intent_key=sent.intent_key,
                tool=sent.tool,
                target=sent.target,
                payload=sent.payload,
                attempt=sent.attempts,
                timeout_s=tool.contract.timeout_s,
                send_by=send_by,
                # The call span's context (the remote's spans are its children), else the
                # agent's stored one: the remote joins the agent's trace either way.
                trace=tracing.current_context(sent),
            ),
        )
        tracing.result(call_span, type(result).__name__)
    faults.point("after_call")
    try:
        report = _settle(conn, sent, result, tool.contract, config)
    except DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
        # Our connection died during the call (and with it our lock): the attempt's outcome
        # is still the truth about attempt k, so record it on a fresh connection, fenced by
        # the attempt number exactly as before; if the sweep got there first it is kept as
        # a late outcome.
        with engine.connect() as fresh:
            report = _settle(fresh, sent, result, tool.contract, config)
    faults.point("after_outcome_commit")
    if tool.contract.breaker is not None:
        _count_for_breaker(
            engine, conn, sent, tool.contract, report, quiet_at_admission=observed.breaker_quiet
        )
    return report


def _count_for_breaker(
    engine: Engine,
    conn: Connection,
    sent: Operation,
    contract: ToolContract,
    report: DispatchReport,
    *,
    quiet_at_admission: bool,
) -> None:
    """Count the attempt's outcome against its breaker, after the outcome's own commit.

    Bookkeeping that never changes the outcome (already committed): a lost connection is
    retried on a fresh one; a worker killed here loses one count (a probe whose success is
    lost is replaced when its lease runs out)."""
    breaker = contract.breaker
    assert breaker is not None  # noqa: S101 -- the caller checked
    verdict = guard_state.verdict_of(report.outcome.value)
    key = GuardKey.of(sent.tool, sent.target, breaker.per)
    try:
        guard_state.record_outcome_committed(
            conn,
            breaker,
            scope=guard_state.DISPATCH,
            key=key,
            verdict=verdict,
            operation_id=sent.id,
            quiet_at_admission=quiet_at_admission,
        )
    except DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
        with engine.connect() as fresh:
            guard_state.record_outcome_committed(
                fresh,
                breaker,
                scope=guard_state.DISPATCH,
                key=key,
                verdict=verdict,
                operation_id=sent.id,
            )


def _settle(
    conn: Connection,
    sent: Operation,
    result: DispatchResult,
    contract: ToolContract,
    config: DispatchConfig,
) -> DispatchReport:
    """Commit what the call ended in: "not sent" when the send deadline stopped it before
    its first byte, otherwise the classified outcome."""
    if isinstance(result, NotSent):
        return _not_sent(conn, sent, contract, f"{result.reason} (checked before the first byte)")
    return _record_outcome(conn, sent, result, config)


def _unknown_operation(conn: Connection, op_id: UUID) -> DispatchReport:
    """A message for an operation this database does not have: another deployment's (a
    broker queue shared by mistake) or one pruned since. Dropped, but never silently."""
    log.warning(
        "a dispatch message names %s, which is not in this database: another deployment's "
        "message (do two share the broker's queues?), or an operation pruned since",
        op_id,
        extra={"action": Action.DISPATCH_UNKNOWN_OPERATION, "operation_id": str(op_id)},
    )
    sql.notify.notify_unknown_operation(conn, "dispatch")
    return DispatchReport(op_id, Outcome.GONE)


def _ready_to_send(  # noqa: PLR0911 -- one return per reason not to send, in order
    conn: Connection, op: Operation, due: bool, replay_expired: bool, registry: ToolRegistry
) -> tuple[Operation, Tool] | DispatchReport:
    """The checks before the `sent` commit: the operation and its tool, or why not."""
    if op.state is State.SENT:
        return _dispatcher_lost(conn, op)
    if op.state is not State.PLANNED:
        return DispatchReport(op.id, Outcome.NOT_PLANNED, op.attempts, op.state.value)
    tool = registry.get(op.tool)
    if tool is None:
        return _to_human(conn, op, f"tool {op.tool!r} is not registered on this worker")
    if _needs_approval(op, tool.contract):
        return _to_approval(conn, op, tool.contract)
    if op.attempts_in_budget >= tool.contract.max_attempts:
        return _to_human(conn, op, f"max_attempts ({tool.contract.max_attempts}) reached")
    if not due:
        return DispatchReport(op.id, Outcome.NOT_DUE, op.attempts)
    if (tampered := _tampered(op)) is not None:
        return _to_human(conn, op, tampered)
    if replay_expired:
        return _to_human(conn, op, _deadline_reason(op))
    return op, tool


def _tampered(op: Operation) -> str | None:
    """Why the row is not the intent that was enqueued, or ``None`` if it is.

    Tool, target and payload never change after enqueue (the database refuses it: migration
    0010); if the row says otherwise, someone with the rights to drop that trigger edited it,
    and a send would do something else under the same key.
    """
    digest = payload_hash(canonical_json(op.payload))
    if digest != op.payload_hash:
        return "the stored payload no longer matches its payload hash"
    if intent_hash(op.tool, op.target, digest) != op.intent_hash:
        return "the stored tool or target no longer matches the intent hash written at enqueue"
    return None


def _commit_sent(
    conn: Connection,
    op: Operation,
    tool: Tool,
    config: DispatchConfig,
    finish_by: float | None,
    *,
    observed: guard_state.Observed,
) -> tuple[Operation, Tool, float] | DispatchReport:
    """Compare-and-set `planned -> sent`, durably committed before anything is sent: the
    operation as sent, its tool, and the monotonic instant its first byte must leave by.

    The deadline runs from the start of the statement that committed, which writes
    ``sent_at`` as its own start (``statement_timestamp()``): measured from there, the last
    byte may leave no later than ``sent_at + send_deadline_s``, which the in-flight horizon
    covers. That statement never waits on a row lock (it fails at once instead); the wait
    for another transaction's row lock (a relay's claim not yet committed) happens between
    tries, outside the attempt, so it neither eats the deadline nor counts as an attempt.
    """
    contract = tool.contract
    wait_until = time.monotonic() + config.row_lock_wait_s
    while True:
        started = time.monotonic()
        needed = contract.send_deadline_s + contract.timeout_s + config.attempt_margin_s
        if finish_by is not None and started + needed > finish_by:
            return DispatchReport(op.id, Outcome.DEFERRED, op.attempts, "no time left")
        try:
            # One statement, committed by itself with synchronous_commit=on (checked with
            # the lock): when it returns, the row says `sent` on disk.
            moved = _mark_sent(conn, op, contract, observed)
        except DBAPIError as exc:
            if not sql.locks.is_row_lock_busy(exc):
                raise
            if not _row_freed(conn, op.id, wait_until - time.monotonic()):
                reason = "its row stayed locked by another transaction"
                return DispatchReport(op.id, Outcome.LOCK_BUSY, op.attempts, reason)
            continue
        break
    if isinstance(moved, guard_state.Hold):
        return _held(conn, op, moved)
    if isinstance(moved, ReplayDeadlinePassed):
        return _to_human(conn, op, _deadline_reason(op))
    if not isinstance(moved, Moved):
        return DispatchReport(op.id, Outcome.NOT_PLANNED, op.attempts, str(moved))
    sent = moved.operation
    _committed_sent(sent)
    return sent, tool, started + contract.send_deadline_s


def _committed_sent(sent: Operation) -> None:
    faults.point("after_sent_commit")
    log.info(
        "attempt %d of %s committed as sent",
        sent.attempts,
        sent.id,
        extra={"action": Action.DISPATCH_SENT, "operation_id": str(sent.id), "tool": sent.tool},
    )


def _sent_at_lock(
    conn: Connection, found: SentAtLock, registry: ToolRegistry
) -> tuple[Operation, Tool, float] | DispatchReport:
    """An operation the lock step moved to `sent` (its checks held by that statement): the
    one check the database cannot make, the payload against its hashes, made now, before any
    byte leaves. A row that fails it was never sent: back to `planned` with that evidence,
    then to a person, as the check before the commit sends it."""
    sent = found.operation
    tool = registry.get(sent.tool)
    if tool is None or tool.contract.guarded:  # the registry changed since the terms were made
        return return_unsent(conn, sent, f"not sent: tool {sent.tool!r} changed on this worker")
    _committed_sent(sent)
    if (tampered := _tampered(sent)) is not None:
        return escalate_never_sent(conn, sent, tampered)
    return sent, tool, found.started + tool.contract.send_deadline_s


def escalate_never_sent(conn: Connection, sent: Operation, reason: str) -> DispatchReport:
    """An attempt committed `sent` that must not be made (``reason``): back to `planned`
    with "not sent" as its evidence (no byte left), then to a person, each a compare-and-set
    at its attempt (a row another component moved meanwhile is left where it is)."""
    back = return_unsent(conn, sent, f"not sent: {reason}")
    if back.outcome is not Outcome.NOT_SENT:
        return back
    return _to_human(conn, sent, reason)  # from `planned`, at the same attempt


def _mark_sent(
    conn: Connection, op: Operation, contract: ToolContract, observed: guard_state.Observed
) -> Moved | guard_state.Hold | Exception:
    """The `sent` move, one statement.

    With guards, their admission is part of that statement (``outbox.guard_admit``): the
    breaker's read, the concurrency cap's count of `sent` rows under the key's lock (held
    until the move commits: two dispatchers cannot both see room for one), the rate's token;
    the move happens only if they all admit it. A breaker that is not closed is asked again
    with the move in one transaction, where its probe may be claimed.
    """
    move = transitions.mark_sent(
        op.id, attempt=op.attempts, reason=f"dispatching attempt {op.attempts + 1}"
    )
    if not contract.guarded:
        return transitions.apply_and_commit(conn, move)
    asked = transitions.apply_admitted_and_commit(
        conn, move, guard_state.admission(contract, op.target)
    )
    observed.breaker_quiet = asked.admitted.breaker_quiet
    if asked.moved is not None:
        return asked.moved
    if not guard_state.breaker_refused(asked.admitted):
        held = guard_state.refusal(contract, op.target, asked.admitted)
        assert held is not None  # noqa: S101 -- refused by the cap or the rate
        return held
    return transitions.apply_guarded_and_commit(
        conn,
        move,
        lambda tx: guard_state.admit(
            tx, contract, operation_id=op.id, target=op.target, observed=observed
        ),
    )


def _held(conn: Connection, op: Operation, hold: guard_state.Hold) -> DispatchReport:
    """A guard refused the attempt: the operation stays `planned`, due again when the guard
    may let it through; not an attempt, not an escalation."""
    if not transitions.hold_and_commit(
        conn, op.id, attempt=op.attempts, delay_s=hold.delay_s, reason=hold.reason
    ):
        return DispatchReport(op.id, Outcome.NOT_PLANNED, op.attempts, "moved on while held")
    log.info(
        "%s held by the %s guard of %s for %.3fs",
        op.id,
        hold.guard,
        hold.key,
        hold.delay_s,
        extra={
            "action": Action.DISPATCH_HELD,
            "operation_id": str(op.id),
            "guard": hold.guard,
            "guard_key": str(hold.key),
        },
    )
    return DispatchReport(op.id, Outcome.HELD, op.attempts, hold.reason)


def _row_freed(conn: Connection, op_id: UUID, timeout_s: float) -> bool:
    """Wait (at most ``timeout_s``) for another transaction's lock on the row to go."""
    if timeout_s <= 0:
        return False
    try:
        sql.locks.wait_for_row_lock(conn, op_id, timeout_s=timeout_s)
    except DBAPIError as exc:
        conn.rollback()
        if sql.locks.is_row_lock_busy(exc):
            return False
        raise
    conn.commit()
    return True


def _deadline_reason(op: Operation) -> str:
    return f"the dedup window closed before the replay left (replay deadline {op.replay_deadline})"


def _dispatcher_lost(conn: Connection, op: Operation) -> DispatchReport:
    """A message found the attempt in `sent` while we hold the lock: its dispatcher is gone."""
    reason = "dispatcher lost: a message found the attempt in sent with its lock free"
    lost = transitions.mark_unknown(
        op.id, actor=Actor.DISPATCHER, attempt=op.attempts, reason=reason
    )
    if not isinstance(missed := transitions.apply_and_commit(conn, lost), Moved):
        return DispatchReport(op.id, Outcome.NOT_PLANNED, op.attempts, str(missed))
    log.warning(
        "attempt %d of %s lost its dispatcher; handed to the reconciler",
        op.attempts,
        op.id,
        extra={"action": Action.DISPATCH_LOST, "operation_id": str(op.id)},
    )
    return DispatchReport(op.id, Outcome.DISPATCHER_LOST, op.attempts)


def _needs_approval(op: Operation, contract: ToolContract) -> bool:
    """Whether the tool requires an approval this row does not hold. Only before its first
    attempt: a row already sent under the tool's former policy is retried as it was released
    (the database refuses an attempted row back in ``awaiting_approval``)."""
    return (
        contract.approval_required
        and op.attempts == 0
        and op.approved_payload_hash != op.payload_hash
    )


def _to_approval(conn: Connection, op: Operation, contract: ToolContract) -> DispatchReport:
    """The tool requires approval and the row has none (enqueued before the tool's policy
    reached the database): back to a person instead of a send."""
    reason = f"tool {op.tool!r} requires approval before any send; the operation has none"
    move = transitions.await_approval(
        op.id, attempt=op.attempts, approval_ttl_s=contract.approval_ttl_s, reason=reason
    )
    if not isinstance(missed := transitions.apply_and_commit(conn, move), Moved):
        return DispatchReport(op.id, Outcome.NOT_PLANNED, op.attempts, str(missed))
    log.warning(
        "%s awaits approval: %s",
        op.id,
        reason,
        extra={"action": Action.DISPATCH_AWAITING_APPROVAL, "operation_id": str(op.id)},
    )
    return DispatchReport(op.id, Outcome.AWAITING_APPROVAL, op.attempts, reason)


def _to_human(conn: Connection, op: Operation, reason: str) -> DispatchReport:
    escalation = transitions.escalate(
        op.id, from_state=State.PLANNED, actor=Actor.DISPATCHER, attempt=op.attempts, reason=reason
    )
    if not isinstance(missed := transitions.apply_and_commit(conn, escalation), Moved):
        return DispatchReport(op.id, Outcome.NOT_PLANNED, op.attempts, str(missed))
    log.warning(
        "%s needs a human: %s",
        op.id,
        reason,
        extra={"action": Action.DISPATCH_NEEDS_HUMAN, "operation_id": str(op.id)},
    )
    return DispatchReport(op.id, Outcome.NEEDS_HUMAN, op.attempts, reason)


def _not_sent(
    conn: Connection, sent: Operation, contract: ToolContract, reason: str | None = None
) -> DispatchReport:
    reason = reason or (
        f"not sent: more than send_deadline_s ({contract.send_deadline_s:g}s) since sent"
    )
    return return_unsent(conn, sent, reason)


def return_unsent(conn: Connection, sent: Operation, reason: str) -> DispatchReport:
    """``sent -> planned``: this attempt provably never left (``reason`` says why); due at
    once. A compare-and-set at its attempt, committed by itself."""
    back = transitions.replan(
        sent.id,
        from_state=State.SENT,
        actor=Actor.DISPATCHER,
        attempt=sent.attempts,
        reason=reason,
        last_error=reason,
    )
    if not isinstance(missed := transitions.apply_and_commit(conn, back), Moved):
        return DispatchReport(sent.id, Outcome.LATE, sent.attempts, str(missed))
    return DispatchReport(sent.id, Outcome.NOT_SENT, sent.attempts, reason)


def _classify(
    sent: Operation, result: DispatchResult, config: DispatchConfig
) -> tuple[Move, Outcome]:
    """The move an outcome of ``sent``'s attempt calls for, and the outcome it reports."""
    op_id, attempt, actor = sent.id, sent.attempts, Actor.DISPATCHER
    if isinstance(result, Applied):
        applied = transitions.confirm(
            op_id,
            from_state=State.SENT,
            actor=actor,
            attempt=attempt,
            reason="applied at the remote",
            remote_ref=result.remote_ref,
            result=result.result,
        )
        return applied, Outcome.CONFIRMED
    if isinstance(result, Rejected):
        if sent.maybe_applied:
            reason = f"refused, but an earlier attempt may have applied: {result.reason}"
            doubt = transitions.mark_unknown(
                op_id, actor=actor, attempt=attempt, reason=reason, last_error=reason
            )
            return doubt, Outcome.UNKNOWN
        refused = transitions.fail(
            op_id,
            from_state=State.SENT,
            actor=actor,
            attempt=attempt,
            reason=f"refused: {result.reason}",
            last_error=result.reason,
            result=result.result,
        )
        return refused, Outcome.FAILED
    if isinstance(result, NotDelivered):
        backoff = exponential_s(attempt, base_s=config.base_backoff_s, max_s=config.max_backoff_s)
        again = transitions.replan(
            op_id,
            from_state=State.SENT,
            actor=actor,
            attempt=attempt,
            reason=f"not delivered: {result.reason}",
            last_error=result.reason,
            available_in_s=jittered(backoff),
        )
        return again, Outcome.REPLANNED
    why = result.reason if isinstance(result, Ambiguous) else repr(result)
    ambiguous = transitions.mark_unknown(
        op_id, actor=actor, attempt=attempt, reason=f"ambiguous: {why}", last_error=why
    )
    return ambiguous, Outcome.UNKNOWN


#: The log action of each outcome an attempt records (the ones ``_classify`` returns).
_OUTCOME_ACTIONS = {
    Outcome.CONFIRMED: Action.DISPATCH_CONFIRMED,
    Outcome.FAILED: Action.DISPATCH_FAILED,
    Outcome.UNKNOWN: Action.DISPATCH_UNKNOWN,
    Outcome.REPLANNED: Action.DISPATCH_REPLANNED,
}


def _record_outcome(
    conn: Connection, sent: Operation, result: DispatchResult, config: DispatchConfig
) -> DispatchReport:
    move, outcome = _classify(sent, result, config)
    reason = move.reason
    try:
        moved = transitions.apply_and_commit(conn, move)
    except Exception as exc:  # whatever refused the write, the call itself happened
        if isinstance(exc, DBAPIError) and exc.connection_invalidated:
            raise  # the caller records it again on a fresh connection
        return _unrecordable_outcome(conn, sent, outcome, exc)
    if not isinstance(moved, Moved):
        return _late_outcome(conn, sent, result, reason)
    log.info(
        "attempt %d of %s: %s",
        sent.attempts,
        sent.id,
        reason,
        extra={"action": _OUTCOME_ACTIONS[outcome], "operation_id": str(sent.id)},
    )
    return DispatchReport(sent.id, outcome, sent.attempts, reason, saga="saga" in sent.metadata)


def _unrecordable_outcome(
    conn: Connection, sent: Operation, outcome: Outcome, exc: Exception
) -> DispatchReport:
    """The outcome's write failed (a value the database refuses, a constraint): the attempt
    still happened, so it must not stay `sent` until the sweep notices; `unknown` (maybe
    applied) hands it to the reconciler, with a reason that can always be written."""
    error = type(exc.orig).__name__ if isinstance(exc, DBAPIError) else type(exc).__name__
    reason = f"the outcome ({outcome.value}) could not be recorded: {error}"
    log.error(
        "attempt %d of %s: %s",
        sent.attempts,
        sent.id,
        reason,
        extra={"action": Action.DISPATCH_OUTCOME_UNRECORDED, "operation_id": str(sent.id)},
    )
    if conn.in_transaction():
        conn.rollback()
    doubt = transitions.mark_unknown(
        sent.id, actor=Actor.DISPATCHER, attempt=sent.attempts, reason=reason, last_error=reason
    )
    if not isinstance(transitions.apply_and_commit(conn, doubt), Moved):
        return DispatchReport(sent.id, Outcome.LATE, sent.attempts, reason)
    return DispatchReport(sent.id, Outcome.UNKNOWN, sent.attempts, reason)


def _late_outcome(
    conn: Connection, sent: Operation, result: DispatchResult, reason: str
) -> DispatchReport:
    """The row moved on while we were calling (the sweep took it): keep what we learnt."""
    attempt = sent.attempts
    applied = result if isinstance(result, Applied) else None
    kept = transitions.keep_late_evidence_and_commit(
        conn,
        sent.id,
        attempt=attempt,
        noted_by=Actor.DISPATCHER,
        note_reason=f"late outcome of attempt {attempt}: {reason}",
        remote_ref=applied.remote_ref if applied is not None else None,
        result=applied.result if applied is not None else None,
        confirm_reason=f"late outcome of attempt {attempt}: applied",
    )
    if kept.current is None:
        return DispatchReport(sent.id, Outcome.GONE, attempt)
    log.warning(
        "late outcome of attempt %d of %s: %s",
        attempt,
        sent.id,
        reason,
        extra={"action": Action.DISPATCH_LATE, "operation_id": str(sent.id)},
    )
    return DispatchReport(sent.id, Outcome.LATE, attempt, reason)
