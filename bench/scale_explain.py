"""EXPLAIN (ANALYZE, BUFFERS) of the statements the relay and the sweep sent: captured from the
engine, replayed rolled back, summarised as scans, rows and buffers.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from report import console
from rich.table import Table
from scale_data import size_label
from sqlalchemy import Connection, Engine, event
from sqlalchemy.engine.interfaces import DBAPICursor


@dataclass
class Captured:
    """Distinct statements an engine sent, each with the parameters it was first sent with."""

    statements: dict[str, Any] = field(default_factory=dict)

    def __call__(
        self, conn: Connection, cursor: DBAPICursor, statement: str, parameters: Any, *_: Any
    ) -> None:
        """A ``before_cursor_execute`` listener."""
        del conn, cursor
        if "outbox." in statement and not _explain_skips(statement):
            self.statements.setdefault(statement, parameters)


def _explain_skips(statement: str) -> bool:
    """Statements not worth an EXPLAIN: locks, the relays' bookkeeping, utility commands."""
    lowered = " ".join(statement.lower().split())
    utility = lowered.startswith(("set ", "listen", "unlisten", "begin", "commit", "rollback"))
    return utility or any(word in lowered for word in ("advisory", "pg_locks", "outbox.relays"))


@contextlib.contextmanager
def capture(engine: Engine) -> Iterator[Captured]:
    """Record the statements sent through ``engine`` while the block runs."""
    captured = Captured()
    event.listen(engine, "before_cursor_execute", captured)
    try:
        yield captured
    finally:
        event.remove(engine, "before_cursor_execute", captured)


def statement_name(sql: str) -> str:
    """A short, recognisable name for one of our statements."""
    flat = " ".join(sql.split())
    known = [
        ("marked AS", "claim_and_mark_due"),
        ("u(id, previous)", "unmark_published"),
        ("outbox_kombu_message", "take_message"),
        ("state = 'sent' AND sent_at", "stale_sent"),
        ("state = 'unknown' AND next_check_at", "due_unknown"),
        ("horizon_passed", "reconcile_facts"),
        ("SET next_check_at", "schedule_check"),
        ("AND published_at IS NULL", "any_due_unpublished"),
        ("taker:%", "takers"),
        ("moved", "move (transition)"),
        ("AS due", "get_for_dispatch"),
        ("INSERT INTO outbox.webhook", "webhook record"),
    ]
    for needle, name in known:
        if needle in flat:
            return name
    if "FROM outbox.operations" in flat and "WHERE outbox.operations.id" in flat:
        return "get_operation"
    return flat[:48]


@dataclass(frozen=True)
class Plan:
    """The summary of one EXPLAIN (ANALYZE, BUFFERS)."""

    name: str
    scans: list[str]
    rows: int
    #: Rows the scans read and threw away (``Rows Removed by Filter``, summed).
    filtered: int
    hit: int
    read: int
    ms: float

    @property
    def seq_scan(self) -> bool:
        """Whether it reads ``operations`` or ``events`` sequentially."""
        return any(
            s.startswith("Seq Scan") and ("operations" in s or "events" in s) for s in self.scans
        )


def _scans(node: Mapping[str, Any], out: list[str]) -> int:
    """Append the scans under ``node`` to ``out``; the rows its filters removed.

    An index scan is marked ``(bounded)`` when an Index Cond bounds it, ``(unbounded)`` when
    the index only orders it: then it reads and filters every row until the LIMIT is full."""
    kind = node["Node Type"]
    if kind == "ModifyTable":
        out.append(f"{node.get('Operation', 'Modify')} {node.get('Relation Name', '?')}")
    elif "Index Name" in node:
        bound = "bounded" if "Index Cond" in node else "unbounded"
        out.append(f"{kind} {node['Index Name']} ({bound})")
    elif "Relation Name" in node:
        out.append(f"{kind} {node['Relation Name']}")
    removed = int(node.get("Rows Removed by Filter", 0))
    for child in node.get("Plans", []):
        removed += _scans(child, out)
    return removed


def explain(engine: Engine, captured: Captured) -> list[Plan]:
    """EXPLAIN (ANALYZE, BUFFERS) of each captured statement, each rolled back."""
    plans = []
    raw = engine.raw_connection()
    try:
        for sql, parameters in captured.statements.items():
            cursor = raw.cursor()
            try:
                cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", parameters)
                row = cursor.fetchone()
            finally:
                cursor.close()
                raw.rollback()
            if row is None:
                continue
            document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
            top = document[0]
            plan = top["Plan"]
            scans: list[str] = []
            filtered = _scans(plan, scans)
            plans.append(
                Plan(
                    name=statement_name(sql),
                    scans=scans,
                    rows=int(plan.get("Actual Rows", 0)),
                    filtered=filtered,
                    hit=int(plan.get("Shared Hit Blocks", 0)),
                    read=int(plan.get("Shared Read Blocks", 0)),
                    ms=float(top.get("Execution Time", math.nan)),
                )
            )
    finally:
        raw.close()
    return plans


def print_plans(plans: Mapping[int, list[Plan]]) -> None:
    """One table: per statement, per size, the plan's scans and buffers."""
    table = Table(title="EXPLAIN (ANALYZE, BUFFERS) of what the relay pass and the sweep sent")
    numbers = ("rows", "filtered", "hit", "read", "ms")
    for column in ("statement", "terminal rows", "scans", *numbers):
        table.add_column(column, justify="right" if column in numbers else "left")
    names: list[str] = []
    for size_plans in plans.values():
        for plan in size_plans:
            if plan.name not in names:
                names.append(plan.name)
    for name in names:
        for size, size_plans in plans.items():
            for plan in (p for p in size_plans if p.name == name):
                scans = ", ".join(plan.scans) + ("  (SEQ SCAN)" if plan.seq_scan else "")
                table.add_row(
                    name,
                    size_label(size),
                    scans,
                    str(plan.rows),
                    str(plan.filtered),
                    str(plan.hit),
                    str(plan.read),
                    f"{plan.ms:.3f}",
                )
        table.add_section()
    console().print(table)
