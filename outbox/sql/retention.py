"""Retention's statements: prune finished operations, count what a prune would do, and
forget pruned intents.

What a prune may delete: terminal rows resolved before the cutoff, judged by the database
clock. ``resolved_at < …`` implies the predicate of ix_operations_resolved_at, so the rows
are read from that index, oldest first. The state test restates
``ck_operations_terminal_iff_resolved`` (its states are :data:`outbox.states.TERMINAL_STATES`,
checked by tests/unit/test_sql_in_one_place.py): a live row (planned, sent, unknown,
needs_human) can never qualify (and the delete guard of migration 0010 refuses one). A row
is kept while its webhook is still pending (until the deliverer delivers or abandons it, so
no webhook is lost), while its tool is not registered here (its dedup window is unknown),
and while its tool's dedup window, from its first send, is open: the remote still remembers
its key. The two statements below spell out the same conditions: the registered tools
(``tools``), the finished rows (``FROM … WHERE``), a tool not registered
(``t.tool IS NULL``), in the window (``o.first_sent_at + … > now()``), a webhook pending
(``EXISTS … 'pending'``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from outbox.models import Executor

_PRUNE_BATCH = text(
    """
    WITH tools AS (
        SELECT * FROM unnest(CAST(:tools AS text[]), CAST(:windows AS float8[]))
          AS t(tool, window_s)
    ),
    doomed AS (
        SELECT o.id
        FROM outbox.operations o LEFT JOIN tools t ON t.tool = o.tool
        WHERE o.resolved_at < now() - make_interval(secs => :older_than)
          AND o.state IN ('cancelled', 'confirmed', 'failed')
          AND t.tool IS NOT NULL
          AND NOT (o.first_sent_at IS NOT NULL AND t.window_s IS NOT NULL
                   AND o.first_sent_at + make_interval(secs => t.window_s) > now())
          AND NOT EXISTS (SELECT FROM outbox.webhook_deliveries d
                          WHERE d.operation_id = o.id AND d.status = 'pending')
          -- A live saga still judges its steps and compensations by their rows.
          AND NOT EXISTS (SELECT FROM outbox.saga_steps s JOIN outbox.sagas g ON g.key = s.saga_key
                          WHERE s.operation_id = o.id
                            AND g.state IN ('compensating', 'needs_human', 'running'))
          AND NOT EXISTS (SELECT FROM outbox.saga_steps s JOIN outbox.sagas g ON g.key = s.saga_key
                          WHERE s.compensation_operation_id = o.id
                            AND g.state IN ('compensating', 'needs_human', 'running'))
        ORDER BY o.resolved_at
        LIMIT :limit
        FOR UPDATE OF o SKIP LOCKED
    ),
    -- Each deleted row's intent is remembered in outbox.pruned_intents by the trigger
    -- operations_remember_intent, in this statement (migration 0011).
    deleted AS (
        DELETE FROM outbox.operations AS gone USING doomed WHERE gone.id = doomed.id
        RETURNING 1
    )
    SELECT count(*) FROM deleted
    """
)

_COUNT_PRUNABLE = text(
    """
    WITH tools AS (
        SELECT * FROM unnest(CAST(:tools AS text[]), CAST(:windows AS float8[]))
          AS t(tool, window_s)
    )
    SELECT count(*) FILTER (
               WHERE t.tool IS NOT NULL
                 AND NOT (o.first_sent_at IS NOT NULL AND t.window_s IS NOT NULL
                          AND o.first_sent_at + make_interval(secs => t.window_s) > now())
                 AND NOT EXISTS (SELECT FROM outbox.webhook_deliveries d
                                 WHERE d.operation_id = o.id AND d.status = 'pending')
                 AND NOT EXISTS (SELECT FROM outbox.saga_steps s
                                 JOIN outbox.sagas g ON g.key = s.saga_key
                                 WHERE o.id IN (s.operation_id, s.compensation_operation_id)
                                   AND g.state IN ('compensating', 'needs_human', 'running'))
           ) AS prunable,
           count(*) FILTER (WHERE t.tool IS NULL) AS unknown_tool,
           count(*) FILTER (
               WHERE t.tool IS NOT NULL
                 AND (o.first_sent_at IS NOT NULL AND t.window_s IS NOT NULL
                      AND o.first_sent_at + make_interval(secs => t.window_s) > now())
           ) AS in_window,
           count(*) FILTER (
               WHERE t.tool IS NOT NULL
                 AND NOT (o.first_sent_at IS NOT NULL AND t.window_s IS NOT NULL
                          AND o.first_sent_at + make_interval(secs => t.window_s) > now())
                 AND EXISTS (SELECT FROM outbox.webhook_deliveries d
                             WHERE d.operation_id = o.id AND d.status = 'pending')
           ) AS webhook_pending
    FROM outbox.operations o LEFT JOIN tools t ON t.tool = o.tool
    WHERE o.resolved_at < now() - make_interval(secs => :older_than)
      AND o.state IN ('cancelled', 'confirmed', 'failed')
    """
)


@dataclass(frozen=True, slots=True)
class DedupWindows:
    """The registered tools and their dedup windows (``None``: the tool has no dedup contract),
    which retention must respect: an operation of a tool not listed here is never pruned."""

    windows: Mapping[str, float | None]

    def params(self) -> dict[str, list[Any]]:
        names = sorted(self.windows)
        return {"tools": names, "windows": [self.windows[name] for name in names]}


@dataclass(frozen=True, slots=True)
class PruneCount:
    """Finished operations old enough to prune: how many would go, and how many are kept
    and why (each kept row counted once, under the first reason in this order)."""

    prunable: int
    unknown_tool: int
    in_window: int
    webhook_pending: int


def prune_terminal(
    executor: Executor, *, older_than_s: float, limit: int, windows: DedupWindows
) -> int:
    """Delete up to ``limit`` terminal operations resolved more than ``older_than_s`` ago,
    oldest first, outside their tool's dedup window; returns how many went.

    Never an operation of a live saga (``running``, ``compensating``, ``needs_human``): the
    saga still judges it by its row. Their events and webhook deliveries go with them
    (``ON DELETE CASCADE``), a finished saga's step keeps its row without it, and what
    identifies each one stays in ``outbox.pruned_intents`` (a trigger, same statement). Rows
    locked by another transaction are skipped (``SKIP LOCKED``), so two prunes never wait on
    each other. One batch per call, in the caller's transaction (never commits): keep
    batches small so each transaction, and the locks and WAL it holds, stays short.
    """
    params = {"older_than": older_than_s, "limit": limit, **windows.params()}
    return int(executor.execute(_PRUNE_BATCH, params).scalar_one())


def count_prunable(executor: Executor, *, older_than_s: float, windows: DedupWindows) -> PruneCount:
    """What :func:`prune_terminal` would delete now (batches aside), and what it keeps."""
    row = executor.execute(_COUNT_PRUNABLE, {"older_than": older_than_s, **windows.params()})
    found = row.mappings().one()
    return PruneCount(
        prunable=int(found["prunable"]),
        unknown_tool=int(found["unknown_tool"]),
        in_window=int(found["in_window"]),
        webhook_pending=int(found["webhook_pending"]),
    )


_FORGET_INTENTS = text(
    """
    WITH forgotten AS (
        DELETE FROM outbox.pruned_intents
        WHERE intent_key IN (
            SELECT intent_key FROM outbox.pruned_intents
            WHERE resolved_at < now() - make_interval(secs => :older_than)
            ORDER BY resolved_at LIMIT :limit FOR UPDATE SKIP LOCKED)
        RETURNING 1
    )
    SELECT count(*) FROM forgotten
    """
)


def forget_pruned_intents(executor: Executor, *, older_than_s: float, limit: int) -> int:
    """Delete up to ``limit`` pruned intents whose operation ended more than ``older_than_s``
    ago; returns how many went. From then on their keys can be enqueued anew."""
    row = executor.execute(_FORGET_INTENTS, {"older_than": older_than_s, "limit": limit})
    return int(row.scalar_one())
