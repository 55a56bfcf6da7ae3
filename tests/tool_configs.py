"""Declarative HTTP tools pointing at the reference service, as a test needs them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from outbox.contracts import ContractTable
from outbox.dev.tool_config import ROLLBACK_TOOL, TOOL, http_tool_toml, rollback_tool_toml
from outbox.tools import ToolRegistry
from outbox.tools.http import load_http_tools

__all__ = ["ROLLBACK_TOOL", "TOOL", "http_registry", "http_tool_toml", "rollback_tool_toml"]

#: What the tests' tool uses unless a test says otherwise: short, so faults resolve quickly.
DEFAULTS: dict[str, Any] = {
    "timeout_s": 1.0,
    "send_deadline_s": 1.0,
    "inflight_horizon_s": 30,
    "max_attempts": 3,
}


def http_registry(
    tmp_path: Path, url: str, *, lookup: bool = True, **settings: Any
) -> ToolRegistry:
    """A registry of its own holding the HTTP tool (nothing global is touched)."""
    config = tmp_path / "tools.toml"
    config.write_text(
        http_tool_toml(url, lookup=lookup, **{**DEFAULTS, **settings}), encoding="utf-8"
    )
    registry = ToolRegistry(ContractTable())
    for http_tool in load_http_tools(config):
        registry.register(http_tool)
    return registry
