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

Two sweeps at once are safe: every move is made under the operation's lock and fenced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from uuid import UUID

from sqlalchemy import Connection, Engine

from outbox import faults, statements
from outbox.config import Settings, get_settings
from outbox.errors import StaleTransition
from outbox.locks import operation_lock_key
from outbox.states import Actor, State, transition
from reconcilers.decide import Action, decide
from reconcilers.lookup import facts_for
from reconcilers.route import apply_decision, escalate_unroutable
from workers.locking import operation_lock, release
from workers.tools import REGISTRY, ToolRegistry

log = logging.getLogger(__name__)

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
    busy: int = 0  #: someone held the operation's lock: next time


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
        """Sweep stale `sent` rows, then route due `unknown` rows."""
        result = SweepResult()
        self._sweep_sent(result)
        self._route_unknown(result)
        return result

    def _sweep_sent(self, result: SweepResult) -> None:
        with self.engine.connect() as probe:
            try:
                stale = statements.stale_sent(
                    probe,
                    sent_timeout_s=self.config.sent_timeout_s,
                    sent_max_age_s=self.config.sent_max_age_s,
                    limit=self.config.batch_size,
                )
                probe.commit()
                for op_id, attempt, too_old in stale:
                    self._sweep_one(probe, op_id, attempt, too_old=too_old, result=result)
            finally:
                release(probe)

    def _sweep_one(
        self, probe: Connection, op_id: UUID, attempt: int, *, too_old: bool, result: SweepResult
    ) -> None:
        key = operation_lock_key(op_id)
        if statements.try_lock(probe, key):
            probe.commit()
            try:
                self._move_sent(
                    probe,
                    op_id,
                    attempt,
                    State.UNKNOWN,
                    f"dispatcher lost: sent more than {self.config.sent_timeout_s:g}s ago and "
                    "its lock is free",
                )
                result.lost += 1
            except StaleTransition:
                pass
            finally:
                statements.unlock(probe, key)
                probe.commit()
            return
        probe.commit()
        if not too_old:
            result.slow += 1
            return
        holder = statements.lock_holder_pid(probe, key)
        probe.commit()
        try:
            self._move_sent(
                probe,
                op_id,
                attempt,
                State.NEEDS_HUMAN,
                f"in flight for more than OUTBOX_SENT_MAX_AGE ({self.config.sent_max_age_s:g}s):"
                f" the dispatcher (database backend pid {holder}) still holds its lock",
            )
            result.stuck += 1
        except StaleTransition:
            pass

    @staticmethod
    def _move_sent(conn: Connection, op_id: UUID, attempt: int, to: State, reason: str) -> None:
        with conn.begin():
            transition(
                conn,
                op_id,
                from_state=State.SENT,
                to_state=to,
                actor=Actor.SWEEP,
                reason=reason,
                attempt=attempt,
            )
        faults.point("sweep_after_move")
        log.warning(
            "%s attempt %d: %s",
            op_id,
            attempt,
            reason,
            extra={"action": f"sweep_{to.value}", "operation_id": str(op_id)},
        )

    def _route_unknown(self, result: SweepResult) -> None:
        with self.engine.connect() as conn:
            due = statements.due_unknown(conn, limit=self.config.batch_size)
            conn.commit()
        for op_id, tool_name in due:
            self._route_one(op_id, tool_name, result)

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
                result.escalated += int(escalate_unroutable(conn, op_id, tool_name))
                return False
            facts = facts_for(conn, op_id, tool.contract)
            if facts is None or facts.operation.state is not State.UNKNOWN or not facts.check_due:
                return False  # another sweep routed it while we waited for the lock
            decision = decide(facts, tool.contract, lookups_exhausted=False)
            if decision.action is Action.LOOKUP:
                with conn.begin():
                    leased = statements.schedule_check(
                        conn,
                        op_id,
                        attempt=facts.operation.attempts,
                        delay_s=self.config.lookup_lease_s,
                        count_check=False,
                    )
                result.lookups += int(leased)
                return leased
            if apply_decision(conn, facts, decision):
                if decision.action is Action.REPLAY:
                    result.replays += 1
                elif decision.action is Action.WAIT:
                    result.waiting += 1
                else:
                    result.escalated += 1
            return False
