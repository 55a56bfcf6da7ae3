"""Declarative HTTP tools pointing at the reference service, as a test needs them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from outbox.contracts import ContractTable
from workers.tools import ToolRegistry
from workers.tools.http import load_http_tools

TOOL = "deploy.create_release"


def http_tool_toml(url: str, *, lookup: bool = True, **settings: Any) -> str:
    """The TOML of one HTTP tool on the reference service at ``url``."""
    values = {
        "timeout_s": 1.0,
        "send_deadline_s": 1.0,
        "inflight_horizon_s": 30,
        "max_attempts": 3,
        **settings,
    }
    lines = [
        f'[tools."{TOOL}"]',
        'kind = "http"',
        'method = "POST"',
        f'url = "{url}/projects/{{target}}/releases"',
        'idempotency_header = "Idempotency-Key"',
        'remote_ref = "id"',
        "rejected_statuses = [400, 422]",
    ]
    if lookup:
        lines += [
            f'lookup_url = "{url}/projects/{{target}}/releases/by-key/{{operation_id}}"',
            'lookup_remote_ref = "id"',
            "lookup_not_applied_statuses = [404]",
        ]
    lines += [
        f"{key} = {str(value).lower() if isinstance(value, bool) else repr(value)}"
        for key, value in values.items()
    ]
    return "\n".join(lines) + "\n"


def http_registry(
    tmp_path: Path, url: str, *, lookup: bool = True, **settings: Any
) -> ToolRegistry:
    """A registry of its own holding the HTTP tool (nothing global is touched)."""
    config = tmp_path / "tools.toml"
    config.write_text(http_tool_toml(url, lookup=lookup, **settings), encoding="utf-8")
    registry = ToolRegistry(ContractTable())
    for http_tool in load_http_tools(config):
        registry.register(http_tool)
    return registry
