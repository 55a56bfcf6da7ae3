"""The declarative HTTP tool for the reference service, as TOML (tests, scenarios, demos)."""

from __future__ import annotations

from typing import Any

TOOL = "deploy.create_release"


def http_tool_toml(url: str, name: str = TOOL, /, *, lookup: bool = True, **settings: Any) -> str:
    """One ``[tools."<name>"]`` table (default ``deploy.create_release``) on the reference
    service at ``url``.

    ``lookup`` adds the lookup-by-key endpoint; ``settings`` are further TOML keys
    (``timeout_s``, ``inflight_horizon_s``, ``dedup_window_s``, …).
    """
    lines = [
        f'[tools."{name}"]',
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
    lines += [f"{key} = {_toml_value(value)}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)
