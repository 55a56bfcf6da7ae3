"""The code paths the scale benchmark times on one loaded database: the relay's claim, a relay
pass, a sweep, an idle sweep; and the reset that puts the sweep's rows back between rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from uuid import UUID

from scale_data import SENT_AGO, TOOL, Loaded, vacuum
from sqlalchemy import text

from outbox import sql
from outbox.contracts import ContractTable
from outbox.reconcilers.sweep import SweepConfig, Sweeper
from outbox.relay import OutboundMessage, Relay, RelayConfig
from outbox.tools import Applied, DispatchResult, LookupResult, ToolCall, ToolRegistry, tool

MS = "ms"
#: The relay's batch (RelayConfig's default) and republish delay (OUTBOX_REPUBLISH_AFTER's).
BATCH = 200
REPUBLISH_AFTER_S = 30.0

# Keep them not due for the next round.
_REFRESH_WAITING = text(
    """
    UPDATE outbox.operations
    SET available_at = CASE WHEN state = 'planned' THEN now() + interval '10 minutes'
                            ELSE available_at END,
        sent_at = CASE WHEN state = 'sent' THEN now() ELSE sent_at END,
        next_check_at = CASE WHEN state = 'unknown' THEN now() + interval '10 minutes' END
    WHERE id = ANY(:ids)
    """
)

# Put the sweep's rows back where they were before it (not timed): the lost ones `sent` ten
# minutes ago with a free lock, the routed ones `unknown` with a due check.
_RESET_SENT = text(
    """
    UPDATE outbox.operations
    SET state = 'sent', next_check_at = NULL, maybe_applied = false, checks = 0,
        sent_at = now() - CAST(:sent_ago AS interval),
        first_sent_at = now() - CAST(:sent_ago AS interval), updated_at = now()
    WHERE id = ANY(:ids)
    """
)
_RESET_UNKNOWN = text(
    "UPDATE outbox.operations SET next_check_at = now() - interval '1 minute', checks = 0 "
    "WHERE id = ANY(:ids)"
)


class NullPublisher:
    """A publisher that confirms nothing: the relay records nothing, the rows stay due."""

    def publish(self, messages: Sequence[OutboundMessage]) -> set[UUID]:
        """Confirm none of ``messages``."""
        del messages
        return set()

    def close(self) -> None:
        """Nothing to release."""


def lookup_registry() -> ToolRegistry:
    """A registry (with its own contract table) whose one tool, :data:`TOOL`, has a lookup:
    the decision table routes its `unknown` rows to lookups."""
    registry = ToolRegistry(contracts=ContractTable())

    @tool(TOOL, registry=registry)
    def create_release(call: ToolCall) -> DispatchResult:
        return Applied(remote_ref=f"rel-{call.operation_id}")

    @create_release.lookup
    def find_release(call: ToolCall) -> LookupResult:
        return Applied(remote_ref=f"rel-{call.operation_id}")

    del find_release
    return registry


@dataclass
class Scale:
    """The measurements of one loaded database."""

    db: Loaded
    due: int
    registry: ToolRegistry
    lookups: list[UUID] = field(default_factory=list)

    def sweeper(self) -> Sweeper:
        """A sweeper as beat runs it (batch 500), lookups only counted. Its `sent` timeout
        is 5 minutes, not 60 s, so that the in-flight rows of ``--not-due`` (refreshed once
        a round) stay in flight however long a round takes; the stale rows are 10 minutes
        old either way."""
        return Sweeper(
            self.db.engine,
            registry=self.registry,
            config=SweepConfig(sent_timeout_s=300.0),
            request_lookup=self.lookups.append,
        )

    def claim(self, calls: int) -> float:
        """Median ms of the relay's claim, ``claim_and_mark_due`` (each in a rolled-back
        transaction)."""
        times = []
        with self.db.engine.connect() as conn:
            for _ in range(calls):
                with conn.begin() as tx:
                    started = time.perf_counter()
                    claimed = sql.relay.claim_and_mark_due(
                        conn, limit=BATCH, republish_after_s=REPUBLISH_AFTER_S
                    )
                    times.append(time.perf_counter() - started)
                    tx.rollback()
                if len(claimed) != self.due:
                    raise RuntimeError(f"the claim returned {len(claimed)} rows, not {self.due}")
        return 1000 * statistics.median(times)

    def relay_pass(self, passes: int) -> float:
        """Median ms of ``Relay.run_once`` with a publisher that confirms nothing."""
        relay = Relay(self.db.engine, NullPublisher(), RelayConfig(batch_size=BATCH))
        times = []
        for _ in range(passes):
            started = time.perf_counter()
            result = relay.run_once()
            times.append(time.perf_counter() - started)
            if result.claimed != self.due or result.published:
                raise RuntimeError(f"a relay pass did {result}, not {self.due} claimed")
        return 1000 * statistics.median(times)

    def sweep(self) -> float:
        """ms of one ``Sweeper.run_once`` over the due `sent` and `unknown` rows."""
        self.lookups.clear()
        sweeper = self.sweeper()
        started = time.perf_counter()
        result = sweeper.run_once()
        elapsed = time.perf_counter() - started
        expected = (self.due, 2 * self.due)
        if (result.lost, result.lookups) != expected or len(self.lookups) != 2 * self.due:
            raise RuntimeError(f"the sweep did {result}, not lost/lookups {expected}")
        return 1000 * elapsed

    def idle_sweep(self, runs: int) -> float:
        """Median ms of ``Sweeper.run_once`` with nothing due (right after :meth:`sweep`)."""
        sweeper = self.sweeper()
        times = []
        for _ in range(runs):
            started = time.perf_counter()
            result = sweeper.run_once()
            times.append(time.perf_counter() - started)
            if any(vars(result).values()):
                raise RuntimeError(f"an idle sweep did {result}")
        return 1000 * statistics.median(times)

    def relay_extras(self) -> None:
        """The relay's other statements, rolled back, so that EXPLAIN sees them: its idle
        check, undoing the stamps of rows the broker did not confirm (a pass that confirms
        nothing is what times it; here it has rows to undo) and the look for direct takers."""
        with self.db.engine.connect() as conn, conn.begin() as tx:
            sql.relay.any_due_unpublished(conn)
            claimed = sql.relay.claim_and_mark_due(
                conn, limit=BATCH, republish_after_s=REPUBLISH_AFTER_S
            )
            sql.relay.unmark_published(conn, claimed)
            sql.relay.takers(conn, heartbeat_within_s=30.0)
            tx.rollback()

    def reset(self) -> None:
        """Put the sweep's rows back, then VACUUM (not timed)."""
        with self.db.engine.begin() as conn:
            conn.execute(_RESET_SENT, {"ids": self.db.sent, "sent_ago": SENT_AGO})
            conn.execute(_RESET_UNKNOWN, {"ids": self.db.unknown})
            if self.db.waiting:
                conn.execute(_REFRESH_WAITING, {"ids": self.db.waiting})
        vacuum(self.db.engine, "outbox.operations")
