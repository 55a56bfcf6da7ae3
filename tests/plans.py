"""A hot statement's plan as a prepared statement gets it (psycopg prepares a statement run
five times on a connection; PostgreSQL plans its first runs with their values, then may keep
one generic plan for any), and the operations table's scans in it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Engine


def prepared_plan(engine: Engine, sql: str, values: Mapping[str, str], mode: str) -> dict[str, Any]:
    """The plan of ``sql`` (psycopg's ``%(name)s`` placeholders) prepared and explained with
    ``values`` (SQL literals, by name) in ``plan_cache_mode`` ``mode``
    (``force_custom_plan``: planned with the values; ``force_generic_plan``: for any)."""
    names: list[str] = []

    def positional(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    statement = re.sub(r"%\((\w+)\)s", positional, sql)
    with engine.connect() as conn:
        try:
            conn.exec_driver_sql(f"SET plan_cache_mode = {mode}")
            # Sent through psycopg with no values: its %% still stands for %.
            conn.exec_driver_sql(f"PREPARE planned AS {statement}", ())
            args = ", ".join(values[name] for name in names)
            plan = conn.exec_driver_sql(f"EXPLAIN (FORMAT JSON) EXECUTE planned({args})")
            top: dict[str, Any] = plan.scalar_one()[0]["Plan"]
        finally:
            conn.invalidate()  # its session's setting and prepared statement go with it
    return top


def operations_scans(node: dict[str, Any]) -> list[tuple[str, str]]:
    """The scans of ``outbox.operations`` in the plan ``node``: (node type, index name)."""
    here = []
    if node.get("Relation Name") == "operations" and "Scan" in node["Node Type"]:
        here.append((node["Node Type"], node.get("Index Name", "")))
    return here + [s for child in node.get("Plans", []) for s in operations_scans(child)]
