"""Lookups: ask the remote whether an `unknown` operation's effect exists, then act on it.

Under the operation's lock (the same one dispatchers take):

* applied (the declared ref resolves) → `confirmed`, the evidence in the event;
* failed at the remote → `failed`;
* not applied, after the in-flight horizon → `planned`: a replay with the same key;
* not applied before the horizon → check again after it (not counted as a check);
* inconclusive → check again with capped exponential backoff and jitter; after the tool's
  ``max_checks`` the dedup rule or a human decides (:mod:`outbox.reconcilers.decide`).

A lookup that finds the operation already decided (an operator was faster) keeps its
evidence as an event, with a warning, and confirms it only if it still waits for a verdict.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from uuid import UUID

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from outbox import faults, guard_state, sql, tracing, transitions
from outbox.backoff import exponential_s, jittered
from outbox.contracts import ToolContract
from outbox.guards import GuardKey
from outbox.logs import Action as LogAction
from outbox.reconcilers.decide import Action, decide, usable_window_s
from outbox.reconcilers.route import apply_decision_and_commit, escalate_unroutable_and_commit
from outbox.sql.reconcile import ReconcileFacts
from outbox.states import Actor, State
from outbox.tools import REGISTRY, Tool, ToolCall, ToolRegistry, run_lookup
from outbox.tools.results import (
    Applied,
    FailedRemotely,
    Inconclusive,
    LookupResult,
    NotApplied,
)
from outbox.workers.locking import operation_lock

log = logging.getLogger(__name__)


class LookupOutcome(enum.StrEnum):
    """How one :func:`lookup` ended."""

    LOCK_BUSY = "lock_busy"
    GONE = "gone"  #: no such operation (another deployment's, or deleted): logged, counted
    NOT_UNKNOWN = "not_unknown"  #: already decided; nothing asked
    CONFIRMED = "confirmed"
    FAILED = "failed"
    REPLANNED = "replanned"  #: not applied after the horizon: replay with the same key
    WAITING = "waiting"  #: not applied before the horizon: check again after it
    RECHECK = "recheck"  #: inconclusive: check again later
    DEFERRED = "deferred"  #: the tool's lookup breaker is open: asked later, not a check
    ROUTED = "routed"  #: lookups exhausted or impossible: the decision table took over
    LATE = "late"  #: someone decided while we asked; our evidence is an event


@dataclass(frozen=True)
class LookupReport:
    """What :func:`lookup` did."""

    operation_id: UUID
    outcome: LookupOutcome
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class LookupConfig:
    """Lookup knobs, each with the reason for its default."""

    #: First wait after an inconclusive answer; doubles per check.
    base_backoff_s: float = 5.0
    #: Longest wait between checks, so an operation is never forgotten for long.
    max_backoff_s: float = 300.0


def lookup(
    operation_id: UUID | str,
    *,
    engine: Engine,
    registry: ToolRegistry = REGISTRY,
    config: LookupConfig | None = None,
) -> LookupReport:
    """Ask the remote about one `unknown` operation and record what it said."""
    op_id = UUID(str(operation_id))
    with operation_lock(engine, op_id) as conn:
        if conn is None:
            return LookupReport(op_id, LookupOutcome.LOCK_BUSY)
        return _inspect(conn, op_id, registry, config or LookupConfig())


def facts_for(conn: Connection, op_id: UUID, contract: ToolContract) -> ReconcileFacts | None:
    """The operation's decision facts under ``contract``, read in a transaction of their own
    that ends with the read (``conn`` must have none open): the moves made on them next are
    each committed on their own. Writes nothing and never commits the caller's work."""
    with conn.begin():
        return sql.reconcile.reconcile_facts(
            conn,
            op_id,
            horizon_s=contract.inflight_horizon_s,
            usable_window_s=usable_window_s(contract),
        )


def _unknown_operation(conn: Connection, op_id: UUID) -> LookupReport:
    """A lookup message for an operation this database does not have: another deployment's
    (a broker queue shared by mistake) or one pruned since. Dropped, but never silently."""
    log.warning(
        "a lookup message names %s, which is not in this database: another deployment's "
        "message (do two share the broker's queues?), or an operation pruned since",
        op_id,
        extra={"action": LogAction.LOOKUP_UNKNOWN_OPERATION, "operation_id": str(op_id)},
    )
    with conn.begin():
        sql.notify.notify_unknown_operation(conn, "lookup")
    return LookupReport(op_id, LookupOutcome.GONE)


def _inspect(
    conn: Connection, op_id: UUID, registry: ToolRegistry, config: LookupConfig
) -> LookupReport:
    with conn.begin():
        current = sql.intents.get_operation(conn, op_id)
    if current is None:
        return _unknown_operation(conn, op_id)
    tool = registry.get(current.tool)
    if current.state is not State.UNKNOWN:
        return LookupReport(op_id, LookupOutcome.NOT_UNKNOWN, current.state.value)
    if tool is None:
        moved = escalate_unroutable_and_commit(conn, op_id, current.tool)
        outcome = LookupOutcome.ROUTED if moved else LookupOutcome.NOT_UNKNOWN
        return LookupReport(op_id, outcome, "tool not registered")
    facts = facts_for(conn, op_id, tool.contract)
    if facts is None or facts.operation.state is not State.UNKNOWN:
        return LookupReport(op_id, LookupOutcome.NOT_UNKNOWN)
    decision = decide(facts, tool.contract, lookups_exhausted=False)
    if decision.action is not Action.LOOKUP:
        apply_decision_and_commit(conn, facts, decision)
        return LookupReport(op_id, LookupOutcome.ROUTED, decision.reason)
    return _ask(conn, facts, tool, config)


def _ask(conn: Connection, facts: ReconcileFacts, tool: Tool, config: LookupConfig) -> LookupReport:
    """Ask the remote (unless the tool's lookup breaker defers it) and record the answer."""
    op_id = facts.operation.id
    held = guard_state.lookup_admit_committed(
        conn, tool.contract, operation_id=op_id, target=facts.operation.target
    )
    if held is not None:
        return _deferred(conn, facts, held)
    # The lookup's span, in the trace of the agent that enqueued it, hours later maybe.
    with tracing.operation_span(LOOKUP_SPAN, facts.operation) as span:
        with tracing.operation_span(
            CALL_SPAN,
            facts.operation,
            kind="client",
            child=True,
            attributes=tool.span_attributes("lookup") if tracing.active() else None,
        ) as call_span:
            result = run_lookup(tool, _call(facts, tool))
            tracing.result(call_span, type(result).__name__)
        faults.point("lookup_after_call")
        try:
            report = _record(conn, facts, tool, result, config)
        except Exception as exc:  # whatever refused the write, the call itself happened
            if isinstance(exc, DBAPIError) and exc.connection_invalidated:
                raise  # the lock went with the connection; the lookup's lease asks again
            report = _unrecordable(conn, facts, tool.contract, exc, config)
        tracing.outcome(span, report.outcome.value)
    faults.point("lookup_after_commit")
    _count_for_breaker(conn, facts, tool.contract, result)
    return report


#: The span of one lookup of an ``unknown`` operation, and of its tool call.
LOOKUP_SPAN = "outbox.lookup"
CALL_SPAN = "outbox.tool.lookup"


def _deferred(conn: Connection, facts: ReconcileFacts, held: guard_state.Hold) -> LookupReport:
    """The lookup breaker is open: check again when it may half-open; not counted."""
    op = facts.operation
    with conn.begin():
        sql.reconcile.schedule_check(
            conn,
            op.id,
            attempt=op.attempts,
            delay_s=held.delay_s,
            count_check=False,
            last_error=held.reason.replace("held: circuit", "lookup deferred: circuit", 1),
        )
    return LookupReport(op.id, LookupOutcome.DEFERRED, held.reason)


def _count_for_breaker(
    conn: Connection, facts: ReconcileFacts, contract: ToolContract, result: LookupResult
) -> None:
    """Count the lookup's answer against the tool's lookup breaker, after the verdict's own
    commit (bookkeeping: it never changes the verdict)."""
    breaker = contract.breaker
    if breaker is None:
        return
    op = facts.operation
    guard_state.record_outcome_committed(
        conn,
        breaker,
        scope=guard_state.LOOKUP,
        key=GuardKey.of(op.tool, op.target, breaker.per),
        verdict=guard_state.lookup_verdict(not isinstance(result, Inconclusive)),
        operation_id=op.id,
    )


def _call(facts: ReconcileFacts, tool: Tool) -> ToolCall:
    op = facts.operation
    return ToolCall(
        operation_id=str(op.id),
        intent_key=op.intent_key,
        tool=op.tool,
        target=op.target,
        payload=op.payload,
        attempt=op.attempts,
        timeout_s=tool.contract.timeout_s,
        # The lookup call span's context, else the agent's stored one (outbox.tracing).
        trace=tracing.current_context(op),
    )


def _record(
    conn: Connection,
    facts: ReconcileFacts,
    tool: Tool,
    result: LookupResult,
    config: LookupConfig,
) -> LookupReport:
    op = facts.operation
    contract = tool.contract
    if isinstance(result, Applied):
        applied = transitions.confirm(
            op.id,
            from_state=State.UNKNOWN,
            actor=Actor.RECONCILER,
            attempt=op.attempts,
            reason=f"lookup: applied at the remote ({result.remote_ref})",
            remote_ref=result.remote_ref,
            result=result.result,
        )
        if not _moved(conn, applied):
            return _late(conn, op.id, op.attempts, result)
        return LookupReport(op.id, LookupOutcome.CONFIRMED, result.remote_ref)
    if isinstance(result, FailedRemotely):
        failed = transitions.fail(
            op.id,
            from_state=State.UNKNOWN,
            actor=Actor.RECONCILER,
            attempt=op.attempts,
            reason=f"lookup: failed at the remote: {result.reason}",
            last_error=result.reason,
        )
        if not _moved(conn, failed):
            return _late(conn, op.id, op.attempts, result)
        return LookupReport(op.id, LookupOutcome.FAILED, result.reason)
    if isinstance(result, NotApplied):
        return _not_applied(conn, facts, contract, result)
    return _inconclusive(conn, facts, contract, result.reason, config)


#: The log action of each move a lookup makes.
_MOVE_ACTIONS = {
    State.CONFIRMED: LogAction.LOOKUP_CONFIRMED,
    State.FAILED: LogAction.LOOKUP_FAILED,
    State.PLANNED: LogAction.LOOKUP_PLANNED,
    State.NEEDS_HUMAN: LogAction.LOOKUP_NEEDS_HUMAN,
}


def _moved(conn: Connection, move: transitions.Move) -> bool:
    """Commit one lookup move; whether it applied (``False``: the row moved on meanwhile)."""
    if not isinstance(transitions.apply_and_commit(conn, move), transitions.Moved):
        return False
    log.info(
        "%s: %s",
        move.operation_id,
        move.reason,
        extra={"action": _MOVE_ACTIONS[move.to_state], "operation_id": str(move.operation_id)},
    )
    return True


def _not_applied(
    conn: Connection, facts: ReconcileFacts, contract: ToolContract, result: NotApplied
) -> LookupReport:
    op = facts.operation
    if not facts.horizon_passed:
        with conn.begin():
            sql.reconcile.schedule_check(
                conn,
                op.id,
                attempt=op.attempts,
                at_horizon_s=contract.inflight_horizon_s,
                count_check=False,
                last_error="lookup: not applied yet; the last attempt may still be in flight",
            )
        return LookupReport(op.id, LookupOutcome.WAITING, str(facts.horizon_at))
    if op.attempts_in_budget >= contract.max_attempts:
        reason = f"lookup: not applied, and max_attempts ({contract.max_attempts}) reached"
        escalation = transitions.escalate(
            op.id,
            from_state=State.UNKNOWN,
            actor=Actor.RECONCILER,
            attempt=op.attempts,
            reason=reason,
            not_applied=True,
        )
        if not _moved(conn, escalation):
            return _late(conn, op.id, op.attempts, result)
        return LookupReport(op.id, LookupOutcome.ROUTED, reason)
    replay = transitions.replan(
        op.id,
        from_state=State.UNKNOWN,
        actor=Actor.RECONCILER,
        attempt=op.attempts,
        reason="lookup: not applied after the in-flight horizon; replay with the same key",
        not_applied=True,
    )
    if not _moved(conn, replay):
        return _late(conn, op.id, op.attempts, result)
    return LookupReport(op.id, LookupOutcome.REPLANNED)


def _inconclusive(
    conn: Connection,
    facts: ReconcileFacts,
    contract: ToolContract,
    why: str,
    config: LookupConfig,
) -> LookupReport:
    op = facts.operation
    checks = op.checks + 1
    backoff = exponential_s(checks, base_s=config.base_backoff_s, max_s=config.max_backoff_s)
    with conn.begin():
        sql.reconcile.schedule_check(
            conn,
            op.id,
            attempt=op.attempts,
            delay_s=jittered(backoff),
            count_check=True,
            last_error=f"lookup inconclusive: {why}",
        )
    if checks < contract.max_checks:
        return LookupReport(op.id, LookupOutcome.RECHECK, why)
    refreshed = facts_for(conn, op.id, contract)
    if refreshed is None or refreshed.operation.state is not State.UNKNOWN:
        return LookupReport(op.id, LookupOutcome.NOT_UNKNOWN)
    decision = decide(refreshed, contract, lookups_exhausted=True)
    apply_decision_and_commit(conn, refreshed, decision)
    return LookupReport(op.id, LookupOutcome.ROUTED, decision.reason)


def _unrecordable(
    conn: Connection,
    facts: ReconcileFacts,
    contract: ToolContract,
    exc: Exception,
    config: LookupConfig,
) -> LookupReport:
    """The answer's write failed (a value the database refuses, a constraint): the check still
    happened, so it counts as an inconclusive one with a reason that can always be written,
    and after ``max_checks`` the decision table (a human, or a dedup replay) takes over."""
    error = type(exc.orig).__name__ if isinstance(exc, DBAPIError) else type(exc).__name__
    why = f"the outcome could not be recorded: {error}"
    log.error(
        "lookup of %s: %s",
        facts.operation.id,
        why,
        extra={
            "action": LogAction.LOOKUP_OUTCOME_UNRECORDED,
            "operation_id": str(facts.operation.id),
        },
    )
    if conn.in_transaction():
        conn.rollback()
    return _inconclusive(conn, facts, contract, why, config)


def _late(conn: Connection, op_id: UUID, attempt: int, result: LookupResult) -> LookupReport:
    """Someone decided while we asked: keep the evidence, and let it confirm only a row that
    still waits for a verdict at the same attempt (:mod:`outbox.transitions`' one rule)."""
    applied = result if isinstance(result, Applied) else None
    kept = transitions.keep_late_evidence_and_commit(
        conn,
        op_id,
        attempt=attempt,
        noted_by=Actor.RECONCILER,
        note_reason=f"lookup evidence after the operation moved on: {result!r}",
        remote_ref=applied.remote_ref if applied is not None else None,
        result=applied.result if applied is not None else None,
        confirm_reason=f"lookup: applied at the remote ({applied.remote_ref})" if applied else "",
    )
    if kept.current is None:
        return LookupReport(op_id, LookupOutcome.GONE)
    log.warning(
        "lookup of %s lost the race to another decision; evidence kept: %r",
        op_id,
        result,
        extra={"action": LogAction.LOOKUP_LATE, "operation_id": str(op_id)},
    )
    return LookupReport(op_id, LookupOutcome.LATE, repr(result))
