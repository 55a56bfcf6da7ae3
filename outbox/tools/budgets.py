"""Declaring budgets: ``[budgets."name"]`` tables in ``OUTBOX_CONFIG``, or :func:`budget`.

.. code-block:: python

    from outbox.tools import budget

    budget("agent-spend", tools=["billing.charge"], by="requested_by", window_s=86400,
           max_operations=100, cost="payload.amount", max_cost=5000)

Both register a :class:`~outbox.budgets.Budget` in the core's table
(:data:`outbox.budgets.BUDGETS`), validated when declared (a :class:`ConfigError` naming the
budget and the field); :func:`~outbox.tools.load_tools` then checks that every tool a budget
names is loaded, and every worker publishes them when it starts (docs/budgets.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from outbox.budgets import BUDGETS, Budget, BudgetTable
from outbox.errors import ConfigError

#: The keys of a ``[budgets."name"]`` table.
BUDGET_KEYS = ("tools", "by", "window_s", "max_operations", "cost", "max_cost")


def budget(
    name: str,
    *,
    tools: Iterable[str],
    window_s: float,
    by: str = "requested_by",
    max_operations: int | None = None,
    cost: str | None = None,
    max_cost: float | None = None,
    table: BudgetTable | None = None,
) -> Budget:
    """Declare a budget (in an ``OUTBOX_TOOLS`` module, beside its tools) and register it.

    At most ``max_operations`` operations, and/or at most ``max_cost`` of the cost read from
    each payload at ``cost`` (``"payload.amount"``), per value of ``by`` (``"requested_by"``
    or ``"metadata.<key>"``) within any ``window_s`` seconds, over the operations of
    ``tools``. Raises :class:`ConfigError` naming the budget and the field.
    """
    declared = Budget(
        name=name,
        tools=tuple(tools),
        by=by,
        window_s=window_s,
        max_operations=max_operations,
        cost=cost,
        max_cost=max_cost,
    )
    return (table if table is not None else BUDGETS).register(declared)


def budgets_from_toml(path: Path, tables: object) -> list[Budget]:
    """The ``[budgets."name"]`` tables of ``OUTBOX_CONFIG`` (``path``) as budgets; raises one
    :class:`ConfigError` naming the file and, for each problem, the budget and the field."""
    if not isinstance(tables, dict):
        raise ConfigError(f'OUTBOX_CONFIG {path}: budgets must be a table of [budgets."name"]')
    found: list[Budget] = []
    problems: list[str] = []
    for name, table in tables.items():
        try:
            found.append(_budget(name, table))
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError(f"OUTBOX_CONFIG {path}: " + "; ".join(problems))
    return found


def _budget(name: str, table: Any) -> Budget:
    where = f'budgets."{name}"'
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where} must be a table")
    unknown = sorted(set(table) - set(BUDGET_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}.{unknown[0]}: unknown key; allowed keys: {', '.join(BUDGET_KEYS)}"
        )
    for required in ("tools", "window_s"):
        if required not in table:
            raise ConfigError(f"{where}.{required}: required key is missing")
    tools = table["tools"]
    if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
        raise ConfigError(f'{where}.tools: a list of tool names, such as ["billing.charge"]')
    try:
        return Budget(
            name=name,
            tools=tuple(tools),
            by=table.get("by", "requested_by"),
            window_s=table["window_s"],
            max_operations=table.get("max_operations"),
            cost=table.get("cost"),
            max_cost=table.get("max_cost"),
        )
    except ConfigError as exc:
        raise ConfigError(f"{where}.{str(exc).removeprefix(f'budget {name!r}: ')}") from None
