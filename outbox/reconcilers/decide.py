"""The reconciler's decision table (DESIGN.md) for an operation whose outcome is unknown.

A pure function of the tool's contract and facts the database computed with its own clock:
no I/O, so every row of the table is a unit test. Inspect first (a lookup); replay only under
the remote's dedup contract, with the same key and payload; otherwise a person decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from outbox.contracts import ToolContract
from outbox.sql.reconcile import ReconcileFacts


class Action(StrEnum):
    """What to do with an `unknown` operation now."""

    LOOKUP = "lookup"  #: ask the remote whether the effect exists
    REPLAY = "replay"  #: back to `planned` under the dedup contract, with a replay deadline
    WAIT = "wait"  #: check again once the in-flight horizon has passed
    HUMAN = "human"  #: `needs_human`, with the reason


@dataclass(frozen=True)
class Decision:
    """An action and the reason a person reads in the event log."""

    action: Action
    reason: str
    #: For REPLAY: seconds after ``first_sent_at`` by which the replay must leave.
    replay_window_s: float | None = None
    #: For WAIT: check again this many seconds after ``sent_at`` (the in-flight horizon).
    recheck_after_sent_s: float | None = None


def usable_window_s(contract: ToolContract) -> float | None:
    """The dedup window minus its safety margin, or ``None`` without a contract."""
    if contract.dedup is None:
        return None
    return contract.dedup.window_s - contract.dedup.margin_s


def decide(facts: ReconcileFacts, contract: ToolContract, *, lookups_exhausted: bool) -> Decision:
    """The decision-table row for an `unknown` operation."""
    op = facts.operation
    if contract.has_lookup and not lookups_exhausted and op.checks < contract.max_checks:
        return Decision(Action.LOOKUP, "asking the remote whether the effect exists")
    return _without_lookup(facts, contract)


def _without_lookup(facts: ReconcileFacts, contract: ToolContract) -> Decision:
    op = facts.operation
    why_no_lookup = f"lookup inconclusive {op.checks} times" if contract.has_lookup else "no lookup"
    dedup = contract.dedup
    if dedup is None:
        return Decision(Action.HUMAN, f"{why_no_lookup} and no dedup contract")
    if not facts.window_open:
        return Decision(
            Action.HUMAN,
            f"{why_no_lookup}, and the dedup window expired at {facts.window_closes_at}",
        )
    if op.attempts_in_budget >= contract.max_attempts:
        return Decision(
            Action.HUMAN, f"{why_no_lookup}, and max_attempts ({contract.max_attempts}) reached"
        )
    if facts.horizon_passed or dedup.concurrent_safe:
        return Decision(
            Action.REPLAY,
            f"{why_no_lookup}: replay with the same key inside the dedup window "
            f"(closes at {facts.window_closes_at})",
            replay_window_s=usable_window_s(contract),
        )
    if (
        facts.horizon_at is not None
        and facts.window_closes_at is not None
        and facts.horizon_at >= facts.window_closes_at
    ):
        return Decision(
            Action.HUMAN,
            f"{why_no_lookup}, and the dedup window closes at {facts.window_closes_at}, before "
            f"the previous attempt's in-flight horizon ({facts.horizon_at})",
        )
    return Decision(
        Action.WAIT,
        "the previous attempt may still be in flight; checking again after its horizon",
        recheck_after_sent_s=contract.inflight_horizon_s,
    )
