"""The sweep: finds `sent` rows whose dispatcher is gone and routes `unknown` rows.

``Sweeper.run_once()`` (the ``outbox.sweep`` task, on beat every ``OUTBOX_SWEEP_INTERVAL``):

1. every `sent` row older than ``OUTBOX_SENT_TIMEOUT``: its lock is probed from a connection
   of the sweep's own (a session that holds a lock would see it as free). Free → the
   dispatcher is gone: `unknown` ("dispatcher lost"), moved while holding that lock and
   fenced on the attempt. Held → still in flight, left alone and counted as slow, until
   ``OUTBOX_SENT_MAX_AGE``; then `needs_human`, with the holder's backend pid in the reason;
2. every `unknown` row whose next check is due, under its lock, by the decision table:
   a lookup (sent to the ``lookup`` queue, with a lease of ``OUTBOX_LOOKUP_LEASE`` so it is
   not routed twice), a dedup replay, a wait for the in-flight horizon, or a human.

Two sweeps at once (two beats) are harmless: every move is made under the operation's lock
and fenced, and before probing a `sent` row's lock a sweep takes its *sweep claim* on the row
(:func:`outbox.sql.locks.try_sweep_claim`, a lock no dispatcher takes): a row another sweep
is probing is "busy, next time", so a sweep never mistakes the other's probe for a live
dispatcher.

Each row is handled on its own: an error on one row is logged (``sweep_row_failed``) and
recorded as an event of that row, and the run goes on with the next. A row the sweep failed
on ``max_row_failures`` times at the same attempt goes to a human with the error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from uuid import UUID

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from outbox import approval, faults, sql, storable, tracing, transitions
from outbox.config import Settings, get_settings
from outbox.locks import operation_lock_key
from outbox.logs import Action as LogAction
from outbox.reconcilers.decide import Action, decide
from outbox.reconcilers.lookup import facts_for
from outbox.reconcilers.route import apply_decision_and_commit, escalate_unroutable_and_commit
from outbox.reconcilers.sagas import advance_due_sagas_and_commit
from outbox.states import Actor, State
from outbox.tools import REGISTRY, ToolRegistry
from outbox.workers.locking import operation_lock, release

log = logging.getLogger(__name__)

#: The log action of each move out of `sent` the sweep makes.
_MOVE_ACTIONS = {
    State.UNKNOWN: LogAction.SWEEP_UNKNOWN,
    State.NEEDS_HUMAN: LogAction.SWEEP_NEEDS_HUMAN,
}

RequestLookup = Callable[[UUID], None]


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """Sweep knobs, each with the reason for its default."""

    #: A `sent` row older than this is checked (OUTBOX_SENT_TIMEOUT).
    sent_timeout_s: float = 60.0
    #: A `sent` row still locked after this goes to a human (OUTBOX_SENT_MAX_AGE).
    sent_max_age_s: float = 3600.0
    #: Rows looked at per phase and run: a run stays short; the next one continues.
    batch_size: int = 500
    #: A row sent to the lookup queue is not routed again for this long (its lookup's lease;
    #: OUTBOX_LOOKUP_LEASE): a lost lookup message is asked again when it ends.
    lookup_lease_s: float = 60.0
    #: A row the sweep failed on this many times (at the same attempt, counted in its events)
    #: goes to a human: one failure may be a passing glitch, three in a row are not.
    max_row_failures: int = 3

    @classmethod
    def from_settings(cls, settings: Settings | None = None) -> SweepConfig:
        """The config with the ``OUTBOX_SENT_*`` and ``OUTBOX_LOOKUP_LEASE`` values."""
        settings = settings or get_settings()
        return cls(
            sent_timeout_s=settings.sent_timeout,
            sent_max_age_s=settings.sent_max_age,
            lookup_lease_s=settings.lookup_lease,
        )


@dataclass
class SweepResult:
    """What one :meth:`Sweeper.run_once` did, by kind."""

    lost: int = 0  #: `sent` → `unknown`: the dispatcher is gone
    slow: int = 0  #: `sent` past the timeout, dispatcher alive: left alone
    stuck: int = 0  #: `sent` past the max age, dispatcher alive: → `needs_human`
    lookups: int = 0  #: `unknown` routed to a lookup
    replays: int = 0  #: `unknown` → `planned` under the dedup contract
    waiting: int = 0  #: `unknown`: check again after the in-flight horizon
    escalated: int = 0  #: `unknown` → `needs_human`
    busy: int = 0  #: someone held the operation's lock (or another sweep probes it): next time
    failed: int = 0  #: handling the row raised: recorded on the row, the run went on
    approvals_expired: int = 0  #: `awaiting_approval` past its TTL → `cancelled`
    sagas: int = 0  #: live sagas advanced by their decision table (docs/sagas.md)
    examined: int = 0  #: stale `sent` and due `unknown` rows looked at

    @property
    def moved(self) -> int:
        """The operations this run moved to another state."""
        return self.lost + self.stuck + self.replays + self.escalated + self.approvals_expired


def _counts(result: SweepResult) -> dict[str, int]:
    """The run's non-zero counts by kind (the sweep span's ``outbox.sweep.<kind>``)."""
    kinds = (
        *("lost", "slow", "stuck", "lookups", "replays", "waiting", "escalated", "busy"),
        *("failed", "approvals_expired", "sagas"),
    )
    return {kind: n for kind in kinds if (n := getattr(result, kind))}


class Sweeper:
    """One sweep at a time per instance; any number of instances may run at once."""

    def __init__(
        self,
        engine: Engine,
        *,
        registry: ToolRegistry = REGISTRY,
        config: SweepConfig | None = None,
        request_lookup: RequestLookup | None = None,
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.config = config or SweepConfig.from_settings()
        self.request_lookup = request_lookup

    def run_once(self) -> SweepResult:
        """Sweep stale `sent` rows, route due `unknown` rows, each row on its own, cancel
        the approvals nobody gave within their TTL, then advance the due live sagas."""
        result = SweepResult()
        # One span per run (not per row: a decision about one operation is its own
        # outbox.reconcile span, in that operation's trace, linked to this one).
        with tracing.stored_span(tracing.SWEEP_SPAN, None, None) as span:
            self._sweep_sent(result)
            self._route_unknown(result)
            self._expire_approvals(result)
            self._advance_sagas(result)
            if span is not None:
                span.set_attributes(
                    {
                        tracing.SWEEP_EXAMINED: result.examined,
                        tracing.SWEEP_MOVED: result.moved,
                        **{f"outbox.sweep.{name}": n for name, n in _counts(result).items()},
                    }
                )
        return result

    def _advance_sagas(self, result: SweepResult) -> None:
        """Phase 4: every live saga whose next check is due, each in its own transaction
        (outbox.reconcilers.sagas): what guarantees a saga's progress, nudge or no nudge."""
        done = advance_due_sagas_and_commit(self.engine, limit=self.config.batch_size)
        result.sagas += done.advanced

    def _expire_approvals(self, result: SweepResult) -> None:
        """Phase 3: `awaiting_approval` past its expiry → `cancelled` ("approval expired"),
        each with its ``approval_expired`` webhook; an approval committed first wins."""
        with self.engine.connect() as conn:
            done = approval.expire_due_and_commit(conn, limit=self.config.batch_size)
        result.approvals_expired += done.expired
        if done.expired:
            log.info(
                "%d approval(s) expired: cancelled",
                done.expired,
                extra={"action": LogAction.SWEEP_APPROVAL_EXPIRED, "expired": done.expired},
            )

    def _sweep_sent(self, result: SweepResult) -> None:
        """Phase 1, on one probe connection of the sweep's own. The probe holds session locks
        only (the sweep claim, the operation's lock), never a transaction between steps:
        each step on it below is a transaction of its own, a ``with probe.begin()`` block
        that commits when it ends, and each move commits on its own
        (:func:`outbox.transitions.apply_and_commit`)."""
        with self.engine.connect() as probe:
            try:
                with probe.begin():
                    stale = sql.reconcile.stale_sent(
                        probe,
                        sent_timeout_s=self.config.sent_timeout_s,
                        sent_max_age_s=self.config.sent_max_age_s,
                        limit=self.config.batch_size,
                    )
                result.examined += len(stale)
                for row in stale:
                    op_id = row.id
                    try:
                        self._sweep_one(
                            probe, op_id, row.attempt, too_old=row.too_old, result=result
                        )
                    except Exception as exc:  # noqa: BLE001 -- one row must not stop the run
                        _raise_if_connection_lost(exc)
                        # Whatever the row's handling left behind: no transaction, no lock.
                        probe.rollback()
                        with probe.begin():
                            sql.locks.unlock_all(probe)
                        self._row_failed(op_id, State.SENT, exc, result)
            finally:
                release(probe)

    def _sweep_one(
        self, probe: Connection, op_id: UUID, attempt: int, *, too_old: bool, result: SweepResult
    ) -> None:
        key = operation_lock_key(op_id)
        with probe.begin():
            claimed = sql.locks.try_sweep_claim(probe, key)
        if not claimed:
            result.busy += 1  # another sweep is probing this row: its lock says nothing of ours
            return
        try:
            self._probe_sent(probe, key, op_id, attempt, too_old=too_old, result=result)
        finally:
            if not probe.invalidated:  # a lost connection took its locks with it
                with probe.begin():
                    sql.locks.release_sweep_claim(probe, key)

    def _probe_sent(
        self,
        probe: Connection,
        key: int,
        op_id: UUID,
        attempt: int,
        *,
        too_old: bool,
        result: SweepResult,
    ) -> None:
        with probe.begin():
            locked = sql.locks.try_lock(probe, key)
        if locked:
            try:
                reason = (
                    f"dispatcher lost: sent more than {self.config.sent_timeout_s:g}s ago and "
                    "its lock is free"
                )
                lost = transitions.mark_unknown(
                    op_id, actor=Actor.SWEEP, attempt=attempt, reason=reason
                )
                result.lost += self._moved(probe, lost)
            finally:
                if not probe.invalidated:
                    with probe.begin():
                        sql.locks.unlock(probe, key)
            return
        if not too_old:
            result.slow += 1
            return
        with probe.begin():
            holder = sql.locks.lock_holder_pid(probe, key)
        if holder is None:
            result.slow += 1  # released since we probed: it moved on, or it is lost; next time
            return
        reason = (
            f"in flight for more than OUTBOX_SENT_MAX_AGE ({self.config.sent_max_age_s:g}s):"
            f" its lock is still held, by database backend pid {holder} (not a sweep)"
        )
        stuck = transitions.escalate(
            op_id, from_state=State.SENT, actor=Actor.SWEEP, attempt=attempt, reason=reason
        )
        result.stuck += self._moved(probe, stuck)

    @staticmethod
    def _moved(conn: Connection, move: transitions.Move) -> bool:
        """Commit one move of a `sent` row; whether it applied (not: it moved on meanwhile)."""
        if not isinstance(transitions.apply_and_commit(conn, move), transitions.Moved):
            return False
        faults.point("sweep_after_move")
        log.warning(
            "%s attempt %d: %s",
            move.operation_id,
            move.attempt,
            move.reason,
            extra={
                "action": _MOVE_ACTIONS[move.to_state],
                "operation_id": str(move.operation_id),
            },
        )
        return True

    def _route_unknown(self, result: SweepResult) -> None:
        with self.engine.connect() as conn:
            due = sql.reconcile.due_unknown(conn, limit=self.config.batch_size)
        result.examined += len(due)
        for check in due:
            try:
                self._route_one(check.id, check.tool, result)
            except Exception as exc:  # noqa: BLE001 -- one row must not stop the run
                _raise_if_connection_lost(exc)
                self._row_failed(check.id, State.UNKNOWN, exc, result)

    def _row_failed(self, op_id: UUID, state: State, exc: Exception, result: SweepResult) -> None:
        """Log the error, count it on the row (an event), and past ``max_row_failures`` hand
        the row to a human with it; never raises, so the run goes on."""
        result.failed += 1
        error = storable.error_summary(exc)
        log.error(
            "sweep could not handle %s (%s): %s",
            op_id,
            state.value,
            error,
            extra={"action": LogAction.SWEEP_ROW_FAILED, "operation_id": str(op_id)},
        )
        try:
            with self.engine.begin() as conn:
                current = sql.intents.get_operation(conn, op_id)
                if current is None or current.state is not state:
                    return  # it moved on meanwhile: whatever failed is not its problem now
                transitions.note(
                    conn,
                    op_id,
                    state=state,
                    attempt=current.attempts,
                    actor=Actor.SWEEP,
                    reason=f"the sweep could not handle this operation: {error}",
                    detail={sql.reconcile.SWEEP_FAILURE_KEY: error},
                )
                failures = sql.reconcile.sweep_failures(
                    conn, op_id, state=state, attempt=current.attempts
                )
            if failures >= self.config.max_row_failures:
                self._escalate_failing(
                    op_id,
                    state=state,
                    attempt=current.attempts,
                    failures=failures,
                    error=error,
                    result=result,
                )
        except Exception as again:  # noqa: BLE001 -- logged; the next run tries again
            log.error(  # noqa: TRY400 -- the summary, never a traceback with bound values
                "sweep could not record its failure on %s: %s",
                op_id,
                storable.error_summary(again),
                extra={
                    "action": LogAction.SWEEP_ROW_FAILURE_UNRECORDED,
                    "operation_id": str(op_id),
                },
            )

    def _escalate_failing(
        self,
        op_id: UUID,
        *,
        state: State,
        attempt: int,
        failures: int,
        error: str,
        result: SweepResult,
    ) -> None:
        """A row the sweep keeps failing on goes to a human, fenced on its state and attempt."""
        reason = (
            f"the sweep failed on this operation {failures} times (attempt {attempt}); "
            f"last error: {error}"
        )
        escalation = transitions.escalate(
            op_id,
            from_state=state,
            actor=Actor.SWEEP if state is State.SENT else Actor.RECONCILER,
            attempt=attempt,
            reason=reason,
        )
        with self.engine.connect() as conn:
            if not isinstance(transitions.apply_and_commit(conn, escalation), transitions.Moved):
                return
        result.escalated += 1
        log.error(
            "%s: %s",
            op_id,
            reason,
            extra={"action": LogAction.SWEEP_ROW_ESCALATED, "operation_id": str(op_id)},
        )

    def _route_one(self, op_id: UUID, tool_name: str, result: SweepResult) -> None:
        if self._route_locked(op_id, tool_name, result) and self.request_lookup is not None:
            # Asked after the lock is released, so the lookup does not find it busy.
            self.request_lookup(op_id)

    def _route_locked(self, op_id: UUID, tool_name: str, result: SweepResult) -> bool:
        """Route one row under its lock; whether it needs a lookup."""
        tool = self.registry.get(tool_name)
        with operation_lock(self.engine, op_id) as conn:
            if conn is None:
                result.busy += 1
                return False
            if tool is None:
                result.escalated += int(escalate_unroutable_and_commit(conn, op_id, tool_name))
                return False
            facts = facts_for(conn, op_id, tool.contract)
            if facts is None or facts.operation.state is not State.UNKNOWN or not facts.check_due:
                return False  # another sweep routed it while we waited for the lock
            decision = decide(facts, tool.contract, lookups_exhausted=False)
            if decision.action is Action.LOOKUP:
                with conn.begin():
                    leased = sql.reconcile.schedule_check(
                        conn,
                        op_id,
                        attempt=facts.operation.attempts,
                        delay_s=self.config.lookup_lease_s,
                        count_check=False,
                    )
                result.lookups += int(leased)
                return leased
            if apply_decision_and_commit(conn, facts, decision):
                if decision.action is Action.REPLAY:
                    result.replays += 1
                elif decision.action is Action.WAIT:
                    result.waiting += 1
                else:
                    result.escalated += 1
            return False


def _raise_if_connection_lost(exc: Exception) -> None:
    """A lost database connection is not the row's fault: the run stops, the next retries."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        raise exc
