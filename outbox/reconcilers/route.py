"""Carry out a decision of the table for an `unknown` operation (under its lock)."""

from __future__ import annotations

import logging
from uuid import UUID

from sqlalchemy import Connection

from outbox import sql
from outbox.errors import StaleTransition
from outbox.reconcilers.decide import Action, Decision
from outbox.sql.reconcile import ReconcileFacts
from outbox.states import Actor, Effects, State, transition

log = logging.getLogger(__name__)


def apply_decision(conn: Connection, facts: ReconcileFacts, decision: Decision) -> bool:
    """Make the move a REPLAY, HUMAN or WAIT decision calls for; whether it applied.

    Fenced on the state and attempt the facts were read at: a row that moved on meanwhile
    is left alone. LOOKUP is the caller's to arrange (it runs elsewhere).
    """
    op = facts.operation
    try:
        with conn.begin():
            if decision.action is Action.REPLAY:
                transition(
                    conn,
                    op.id,
                    from_state=State.UNKNOWN,
                    to_state=State.PLANNED,
                    actor=Actor.RECONCILER,
                    reason=decision.reason,
                    attempt=op.attempts,
                    effects=Effects(replay_window_s=decision.replay_window_s),
                )
            elif decision.action is Action.HUMAN:
                transition(
                    conn,
                    op.id,
                    from_state=State.UNKNOWN,
                    to_state=State.NEEDS_HUMAN,
                    actor=Actor.RECONCILER,
                    reason=decision.reason,
                    attempt=op.attempts,
                )
            elif decision.action is Action.WAIT:
                return sql.reconcile.schedule_check(
                    conn,
                    op.id,
                    attempt=op.attempts,
                    at_horizon_s=decision.recheck_after_sent_s,
                    count_check=False,
                )
            else:
                raise ValueError(f"apply_decision cannot carry out {decision.action}")
    except StaleTransition:
        return False
    log.info(
        "%s: %s",
        op.id,
        decision.reason,
        extra={"action": f"reconcile_{decision.action.value}", "operation_id": str(op.id)},
    )
    return True


def escalate_unroutable(conn: Connection, operation_id: UUID, tool: str) -> bool:
    """An `unknown` operation whose tool this process does not know goes to a human.

    Re-reads the row under the caller's lock; whether it moved.
    """
    current = sql.intents.get_operation(conn, operation_id)
    conn.commit()
    if current is None or current.state is not State.UNKNOWN:
        return False
    try:
        with conn.begin():
            transition(
                conn,
                operation_id,
                from_state=State.UNKNOWN,
                to_state=State.NEEDS_HUMAN,
                actor=Actor.RECONCILER,
                reason=f"tool {tool!r} is not registered in the reconciler",
                attempt=current.attempts,
            )
    except StaleTransition:
        return False
    return True
