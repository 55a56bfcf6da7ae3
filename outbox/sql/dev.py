"""Statements only the dev tooling runs: the demo's and chaos's reports, the scenario's reset.

:mod:`outbox.dev` runs them on a database it made or was told it owns (never a production
outbox): counts by state for the progress lines, each operation's verdict for the final
report, cutting a dispatcher's connection (chaos), and emptying the tables (a scenario).
A run's own operations are those whose ``intent_key`` starts with the run's prefix, which is
matched with ``LIKE`` (the dev tooling's prefixes hold no ``%`` or ``_``).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text

from outbox.models import Executor


@dataclass(frozen=True, slots=True)
class Outcome:
    """Where one operation ended, as the dev tooling's reports judge it."""

    id: str
    intent_key: str
    tool: str
    state: str
    remote_ref: str | None


_STATE_COUNTS = text("SELECT state, count(*) AS n FROM outbox.operations GROUP BY state")

_STATE_COUNTS_OF_PREFIX = text(
    "SELECT state, count(*) AS n FROM outbox.operations "
    "WHERE intent_key LIKE (:prefix || '%') GROUP BY state"
)

_OUTCOMES = text(
    "SELECT id::text AS id, intent_key, tool, state, remote_ref FROM outbox.operations "
    "ORDER BY created_at"
)

_OUTCOMES_OF_PREFIX = text(
    "SELECT id::text AS id, intent_key, tool, state, remote_ref FROM outbox.operations "
    "WHERE intent_key LIKE (:prefix || '%') ORDER BY created_at"
)

_TERMINATE_BACKEND = text("SELECT pg_terminate_backend(:pid)")

# CASCADE: events and webhook deliveries reference the operations.
_EMPTY_OPERATIONS = text("TRUNCATE outbox.operations, outbox.pruned_intents CASCADE")


def state_counts(executor: Executor, *, prefix: str | None = None) -> dict[str, int]:
    """How many operations are in each state (only those whose intent key starts with
    ``prefix``, when given)."""
    if prefix is None:
        rows = executor.execute(_STATE_COUNTS)
    else:
        rows = executor.execute(_STATE_COUNTS_OF_PREFIX, {"prefix": prefix})
    return {str(row.state): int(row.n) for row in rows}


def outcomes(executor: Executor, *, prefix: str | None = None) -> list[Outcome]:
    """Every operation's outcome, oldest first (only those whose intent key starts with
    ``prefix``, when given)."""
    if prefix is None:
        rows = executor.execute(_OUTCOMES)
    else:
        rows = executor.execute(_OUTCOMES_OF_PREFIX, {"prefix": prefix})
    return [
        Outcome(
            id=row.id,
            intent_key=row.intent_key,
            tool=row.tool,
            state=row.state,
            remote_ref=row.remote_ref,
        )
        for row in rows
    ]


def terminate_backend(executor: Executor, pid: int) -> bool:
    """Terminate the server process ``pid`` (its connection drops); whether it was signalled."""
    return bool(executor.execute(_TERMINATE_BACKEND, {"pid": pid}).scalar_one())


def empty_operations(executor: Executor) -> None:
    """Delete every operation, its events and deliveries, and every pruned intent."""
    executor.execute(_EMPTY_OPERATIONS)
