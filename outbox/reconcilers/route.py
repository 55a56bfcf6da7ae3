"""Carry out a decision of the table for an `unknown` operation (under its lock)."""

from __future__ import annotations

import logging
from uuid import UUID

from sqlalchemy import Connection

from outbox import sql, tracing, transitions
from outbox.logs import Action as LogAction
from outbox.reconcilers.decide import Action, Decision
from outbox.sql.reconcile import ReconcileFacts
from outbox.states import Actor, State

log = logging.getLogger(__name__)

#: The log action of each decision carried out.
_DECISION_ACTIONS = {
    Action.LOOKUP: LogAction.RECONCILE_LOOKUP,
    Action.REPLAY: LogAction.RECONCILE_REPLAY,
    Action.WAIT: LogAction.RECONCILE_WAIT,
    Action.HUMAN: LogAction.RECONCILE_HUMAN,
}


def apply_decision_and_commit(conn: Connection, facts: ReconcileFacts, decision: Decision) -> bool:
    """Make the move a REPLAY, HUMAN or WAIT decision calls for, committed; whether it
    applied.

    Fenced on the state and attempt the facts were read at: a row that moved on meanwhile
    is left alone. LOOKUP is the caller's to arrange (it runs elsewhere).
    """
    # A span in the agent's trace: a replay or an escalation hours after the attempt.
    with tracing.operation_span(
        RECONCILE_SPAN, facts.operation, attributes={"outbox.decision": str(decision.action)}
    ) as span:
        applied = _apply_decision_and_commit(conn, facts, decision)
        if span is not None:
            span.set_attribute("outbox.applied", applied)
            if applied and decision.action is not Action.WAIT:
                moved_to = State.PLANNED if decision.action is Action.REPLAY else State.NEEDS_HUMAN
                span.add_event(f"outbox.state.{moved_to}", {"outbox.reason": decision.reason})
        return applied


#: The span of a decision carried out for an `unknown` operation (replay, escalation, wait).
RECONCILE_SPAN = "outbox.reconcile"


def _apply_decision_and_commit(conn: Connection, facts: ReconcileFacts, decision: Decision) -> bool:
    op = facts.operation
    if decision.action is Action.WAIT:
        with conn.begin():
            return sql.reconcile.schedule_check(
                conn,
                op.id,
                attempt=op.attempts,
                at_horizon_s=decision.recheck_after_sent_s,
                count_check=False,
            )
    if decision.action is Action.REPLAY:
        replay = transitions.replan(
            op.id,
            from_state=State.UNKNOWN,
            actor=Actor.RECONCILER,
            attempt=op.attempts,
            reason=decision.reason,
            replay_window_s=decision.replay_window_s,
        )
        if not isinstance(transitions.apply_and_commit(conn, replay), transitions.Moved):
            return False
    elif decision.action is Action.HUMAN:
        escalation = transitions.escalate(
            op.id,
            from_state=State.UNKNOWN,
            actor=Actor.RECONCILER,
            attempt=op.attempts,
            reason=decision.reason,
        )
        if not isinstance(transitions.apply_and_commit(conn, escalation), transitions.Moved):
            return False
    else:
        raise ValueError(f"apply_decision_and_commit cannot carry out {decision.action}")
    log.info(
        "%s: %s",
        op.id,
        decision.reason,
        extra={"action": _DECISION_ACTIONS[decision.action], "operation_id": str(op.id)},
    )
    return True


def escalate_unroutable_and_commit(conn: Connection, operation_id: UUID, tool: str) -> bool:
    """An `unknown` operation whose tool this process does not know goes to a human,
    committed. Re-reads the row under the caller's lock; whether it moved.
    """
    with conn.begin():
        current = sql.intents.get_operation(conn, operation_id)
    if current is None or current.state is not State.UNKNOWN:
        return False
    escalation = transitions.escalate(
        operation_id,
        from_state=State.UNKNOWN,
        actor=Actor.RECONCILER,
        attempt=current.attempts,
        reason=f"tool {tool!r} is not registered in the reconciler",
    )
    return isinstance(transitions.apply_and_commit(conn, escalation), transitions.Moved)
