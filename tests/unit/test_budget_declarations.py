"""Declaring budgets: the TOML tables and outbox.tools.budget, validated with the field named."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox.budgets import BUDGETS, NO_KEY, Budget, BudgetTable
from outbox.config import load_settings
from outbox.contracts import CONTRACTS
from outbox.errors import ConfigError, InvalidIntent
from outbox.tools import REGISTRY, budget, load_tools

TOOL_TABLE = """
[tools."billing.charge"]
kind = "http"
url = "http://127.0.0.1:8900/charges"
idempotency_header = "Idempotency-Key"
remote_ref = "id"
"""

BUDGET_TABLE = """
[budgets."agent-spend"]
tools = ["billing.charge"]
by = "requested_by"
window_s = 86400
max_operations = 100
cost = "payload.amount"
max_cost = 5000
"""


@pytest.fixture(autouse=True)
def clean_tables(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with empty tool and budget tables and no ``OUTBOX_*`` variable."""
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)
    REGISTRY.clear()
    CONTRACTS.clear()
    BUDGETS.clear()
    yield
    REGISTRY.clear()
    CONTRACTS.clear()
    BUDGETS.clear()


def load(tmp_path: Path, text: str) -> None:
    """load_tools on a TOML file holding ``text``."""
    path = tmp_path / "outbox.toml"
    path.write_text(text, encoding="utf-8")
    load_tools(load_settings(config=path))


def test_the_toml_budget_is_loaded_as_declared(tmp_path: Path) -> None:
    """A [budgets."name"] table becomes a registered Budget with its fields."""
    load(tmp_path, TOOL_TABLE + BUDGET_TABLE)
    (declared,) = BUDGETS.all()
    assert declared == Budget(
        name="agent-spend",
        tools=("billing.charge",),
        by="requested_by",
        window_s=86400,
        max_operations=100,
        cost="payload.amount",
        max_cost=5000,
    )


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            ('tools = ["billing.charge"]', 'tools = ["billing.refund"]'),
            "unknown tool 'billing.refund'",
        ),
        (('by = "requested_by"', 'by = "conversation"'), 'budgets."agent-spend".by:'),
        (('cost = "payload.amount"', 'cost = "amount"'), 'budgets."agent-spend".cost:'),
        (('cost = "payload.amount"', ""), 'budgets."agent-spend".max_cost: needs cost'),
        (("window_s = 86400", "window_s = 0"), 'budgets."agent-spend".window_s: a positive'),
        (("max_operations = 100", "max_operations = -1"), "max_operations: a positive"),
        (
            ("max_operations = 100", "max_operations = 100\nmax_spend = 1"),
            ".max_spend: unknown key",
        ),
        (("window_s = 86400", ""), 'budgets."agent-spend".window_s: required key is missing'),
    ],
)
def test_a_bad_budget_is_refused_naming_the_file_budget_and_field(
    tmp_path: Path, change: tuple[str, str], named: str
) -> None:
    """Each mistake in a budget table stops the start with the file, budget and field named."""
    with pytest.raises(ConfigError) as refused:
        load(tmp_path, TOOL_TABLE + BUDGET_TABLE.replace(*change))
    assert "outbox.toml" in str(refused.value)
    assert named in str(refused.value)
    assert not CONTRACTS.loaded


def test_a_budget_without_any_limit_is_refused() -> None:
    """A budget needs max_operations or cost with max_cost."""
    with pytest.raises(ConfigError, match="declare max_operations, or cost and max_cost"):
        Budget(name="b", tools=("t",), window_s=60)


def test_python_declaration_registers_and_keys_and_costs_are_read() -> None:
    """outbox.tools.budget registers the budget; keys come from requested_by or metadata
    (none shares one key), costs from the payload path, refused when not a number."""
    table = BudgetTable()
    declared = budget(
        "per-chat",
        tools=["billing.charge"],
        by="metadata.conversation",
        window_s=60,
        cost="payload.order.amount",
        max_cost=10,
        table=table,
    )
    assert table.all() == [declared]
    assert declared.key_of("agent", {"conversation": "c-1"}) == "c-1"
    assert declared.key_of("agent", {}) == NO_KEY
    assert declared.cost_of({"order": {"amount": 2.5}}) == 2.5
    with pytest.raises(InvalidIntent) as bad:
        declared.cost_of({"order": {"amount": "2.5"}})
    assert bad.value.field == "payload.order.amount"
    with pytest.raises(ConfigError, match="declared twice"):
        budget("per-chat", tools=["billing.charge"], window_s=1, max_operations=1, table=table)
