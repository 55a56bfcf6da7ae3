"""The statements of budgets: their published definitions, the per-key locks, the usage count
inside a window, the exhaustion alerts and the read behind ``outbox.budgets.usage``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import text

from outbox.models import Executor, IntentKey


@dataclass(frozen=True, slots=True)
class BudgetDefinition:
    """One budget as ``outbox.budgets`` holds it."""

    name: str
    tools: list[str]
    counted_by: str
    window_s: float
    max_operations: int | None
    cost_path: str | None
    max_cost: float | None


@dataclass(frozen=True, slots=True)
class Counted:
    """What :func:`count_usage` found: each key's use, and the intent keys recorded already."""

    keys: list[KeyUsage]
    recorded: frozenset[IntentKey]


@dataclass(frozen=True, slots=True)
class KeyUsage:
    """What one budget key used inside its window (a cancelled operation's share given back)."""

    budget: str
    key: str
    operations: int
    cost: float


_UPSERT_BUDGETS = text(
    """
    INSERT INTO outbox.budgets
        (name, tools, counted_by, window_s, max_operations, cost_path, max_cost)
    VALUES (:name, CAST(:tools AS text[]), :counted_by, :window_s, :max_operations, :cost_path,
            :max_cost)
    ON CONFLICT (name) DO UPDATE
      SET tools = excluded.tools, counted_by = excluded.counted_by,
          window_s = excluded.window_s, max_operations = excluded.max_operations,
          cost_path = excluded.cost_path, max_cost = excluded.max_cost,
          updated_at = clock_timestamp()
      -- Unchanged budgets are left alone: every worker start writes them all.
      WHERE (budgets.tools, budgets.counted_by, budgets.window_s, budgets.max_operations,
             budgets.cost_path, budgets.max_cost)
            IS DISTINCT FROM (excluded.tools, excluded.counted_by, excluded.window_s,
                              excluded.max_operations, excluded.cost_path, excluded.max_cost)
    """
)


def upsert_budgets(executor: Executor, budgets: Sequence[BudgetDefinition]) -> None:
    """Write each budget (insert, or update one that changed)."""
    for budget in budgets:
        executor.execute(
            _UPSERT_BUDGETS,
            {
                "name": budget.name,
                "tools": list(budget.tools),
                "counted_by": budget.counted_by,
                "window_s": budget.window_s,
                "max_operations": budget.max_operations,
                "cost_path": budget.cost_path,
                "max_cost": budget.max_cost,
            },
        )


_BUDGETS_FOR = text(
    """
    SELECT name, tools, counted_by, window_s, max_operations, cost_path, max_cost
    FROM outbox.budgets WHERE tools && CAST(:tools AS text[]) ORDER BY name
    """
)


def budgets_for(executor: Executor, tools: Sequence[str]) -> list[BudgetDefinition]:
    """The published budgets covering any of ``tools``, by name."""
    rows = executor.execute(_BUDGETS_FOR, {"tools": sorted(set(tools))}).mappings()
    return [BudgetDefinition(**row) for row in rows]


_LOCK_KEYS = text(
    "SELECT count(pg_advisory_xact_lock(k)) FROM unnest(CAST(:keys AS bigint[])) AS k"
)


def lock_keys(executor: Executor, keys: Sequence[int]) -> None:
    """Take these transaction-scoped advisory locks, in the order given (sort them)."""
    executor.execute(_LOCK_KEYS, {"keys": list(keys)})


_COUNT_USAGE = text(
    """
    WITH now AS (SELECT clock_timestamp() AS at),
    wanted AS (
        SELECT * FROM unnest(CAST(:budgets AS text[]), CAST(:keys AS text[]),
                             CAST(:windows AS double precision[])) AS w(budget, key, window_s)
    ),
    -- Rows that left the window are dead weight: the key's are dropped here, under its lock;
    -- and a few of other keys of the budget (a conversation's key is never counted again),
    -- skipping rows another enqueuer is dropping: no wait between keys.
    gone AS (
        DELETE FROM outbox.budget_usage AS u USING wanted AS w, now
        WHERE u.budget = w.budget AND u.key = w.key
          AND u.used_at <= now.at - make_interval(secs => w.window_s)
    ),
    -- Per budget, the oldest first along (budget, used_at), up to 50: the scan stops at the
    -- window's edge, never reading the rows inside it. (Joined to all of the budget's rows,
    -- PostgreSQL read each of them: 0.9 ms at 5,000 uses, as much as the count; and `id IN`
    -- hashed the ids and read the whole table to find them: `= ANY(ARRAY(...))` probes the
    -- primary key.)
    stale AS (
        DELETE FROM outbox.budget_usage WHERE id = ANY(ARRAY(
            SELECT old.id FROM (SELECT DISTINCT budget, window_s FROM wanted) AS b CROSS JOIN now
            CROSS JOIN LATERAL (
                SELECT u.id FROM outbox.budget_usage AS u
                WHERE u.budget = b.budget
                  AND u.used_at <= now.at - make_interval(secs => b.window_s)
                  AND NOT EXISTS (SELECT FROM wanted AS mine
                                  WHERE mine.budget = u.budget AND mine.key = u.key)
                ORDER BY u.used_at
                LIMIT 50
                FOR UPDATE OF u SKIP LOCKED
            ) AS old
        ))
    )
    -- The key's rows inside the window, and nothing else (an index-only scan): a cancelled
    -- operation (withdrawn, refused or expired before any send) gave its share back as it
    -- was cancelled, its rows deleted by the trigger operations_return_budget_share
    -- (migration 0021); a pruned one keeps its rows, and counts.
    SELECT w.budget, w.key, used.operations, used.cost,
           -- The intents recorded already (a retry): their share is not asked again.
           (SELECT json_agg(json_build_array(o.agent, o.intent_key))
            FROM unnest(CAST(:intent_keys AS text[]), CAST(:agents AS text[]))
                   AS k(intent_key, agent)
            JOIN outbox.operations AS o
              ON o.intent_key = k.intent_key AND o.agent = k.agent) AS recorded
    FROM wanted AS w CROSS JOIN now
    CROSS JOIN LATERAL (
        SELECT count(*) AS operations, coalesce(sum(u.cost), 0) AS cost
        FROM outbox.budget_usage AS u
        WHERE u.budget = w.budget AND u.key = w.key
          AND u.used_at > now.at - make_interval(secs => w.window_s)
    ) AS used
    """
)


def count_usage(
    executor: Executor,
    *,
    budgets: Sequence[str],
    keys: Sequence[str],
    windows: Sequence[float],
    intent_keys: Sequence[IntentKey] = (),
) -> Counted:
    """What each (budget, key) used inside its window (database clock), deleting its rows
    that left the window, and which of ``intent_keys`` name operations already. Run it in a
    statement after the keys' locks were granted."""
    rows = executor.execute(
        _COUNT_USAGE,
        {
            "budgets": list(budgets),
            "keys": list(keys),
            "windows": list(windows),
            "intent_keys": [k.key for k in intent_keys],
            "agents": [k.agent for k in intent_keys],
        },
    ).mappings()
    found = [
        (KeyUsage(row["budget"], row["key"], int(row["operations"]), float(row["cost"])), row)
        for row in rows
    ]
    recorded = frozenset(
        IntentKey(agent, key) for agent, key in (found[0][1]["recorded"] or () if found else ())
    )
    return Counted([usage for usage, _row in found], recorded)


_MARK_EXHAUSTED = text(
    """
    INSERT INTO outbox.budget_alerts AS a (budget, key, exhausted_at, refusals)
    VALUES (:budget, :key, statement_timestamp(), 1)
    ON CONFLICT (budget, key) DO UPDATE
      SET refusals = a.refusals + 1,
          exhausted_at = CASE
              WHEN a.exhausted_at <= statement_timestamp() - make_interval(secs => :window_s)
              THEN statement_timestamp() ELSE a.exhausted_at END
    RETURNING exhausted_at, exhausted_at = statement_timestamp() AS first
    """
)


def mark_exhausted(
    executor: Executor, *, budget: str, key: str, window_s: float
) -> datetime | None:
    """Count a refusal of this key; the time it became exhausted if this is the first refusal
    of a window (none within ``window_s`` before it), else ``None``."""
    row = executor.execute(
        _MARK_EXHAUSTED, {"budget": budget, "key": key, "window_s": window_s}
    ).one()
    return row[0] if row[1] else None


@dataclass(frozen=True, slots=True)
class BudgetTotals:
    """One budget's use across its keys, for the metrics (keys are unbounded: not labels)."""

    budget: str
    keys: int
    operations: int
    cost: float
    #: The highest share of a limit any one key has used (1.0: some key is exhausted).
    fullest: float
    refusals: int


_TOTALS = text(
    """
    WITH per_key AS (
        -- A cancelled operation's rows are gone (migration 0021's trigger): no join.
        SELECT b.name, u.key, count(*) AS operations, sum(u.cost) AS cost
        FROM outbox.budgets AS b
        JOIN outbox.budget_usage AS u
          ON u.budget = b.name
         AND u.used_at > clock_timestamp() - make_interval(secs => b.window_s)
        GROUP BY b.name, u.key
    )
    SELECT b.name AS budget, count(k.key) AS keys,
           coalesce(sum(k.operations), 0) AS operations, coalesce(sum(k.cost), 0) AS cost,
           coalesce(max(greatest(k.operations / b.max_operations::float8,
                                 k.cost / b.max_cost)), 0) AS fullest,
           (SELECT coalesce(sum(a.refusals), 0) FROM outbox.budget_alerts AS a
            WHERE a.budget = b.name) AS refusals
    FROM outbox.budgets AS b LEFT JOIN per_key AS k ON k.name = b.name
    GROUP BY b.name ORDER BY b.name
    """
)


def totals(executor: Executor) -> list[BudgetTotals]:
    """Each published budget's use inside its window, summed over its keys."""
    return [
        BudgetTotals(
            budget=row["budget"],
            keys=int(row["keys"]),
            operations=int(row["operations"]),
            cost=float(row["cost"]),
            fullest=float(row["fullest"]),
            refusals=int(row["refusals"]),
        )
        for row in executor.execute(_TOTALS).mappings()
    ]


@dataclass(frozen=True, slots=True)
class BudgetUsage:
    """One budget key's use inside its window (:func:`outbox.budgets.usage`)."""

    budget: str
    key: str
    window_s: float
    operations: int
    max_operations: int | None
    cost: float
    max_cost: float | None
    #: When this key was last found exhausted (a refused enqueue), or ``None``.
    exhausted_at: datetime | None


_USAGE = text(
    """
    -- A cancelled operation's rows are gone (migration 0021's trigger): no join.
    SELECT b.name AS budget, u.key, b.window_s, count(*) AS operations, b.max_operations,
           sum(u.cost) AS cost, b.max_cost, a.exhausted_at
    FROM outbox.budgets AS b
    JOIN outbox.budget_usage AS u
      ON u.budget = b.name AND u.used_at > clock_timestamp() - make_interval(secs => b.window_s)
    LEFT JOIN outbox.budget_alerts AS a ON a.budget = b.name AND a.key = u.key
    GROUP BY b.name, u.key, b.window_s, b.max_operations, b.max_cost, a.exhausted_at
    ORDER BY b.name, u.key
    """
)


def usage(executor: Executor) -> list[BudgetUsage]:
    """Each published budget's keys with use inside the window, by budget and key."""
    rows = executor.execute(_USAGE).mappings()
    return [
        BudgetUsage(**{**row, "operations": int(row["operations"]), "cost": float(row["cost"])})
        for row in rows
    ]
