"""The declarative HTTP tools for the reference service, as TOML (tests, scenarios, demos):
the create tool and the rollback tool (a saga's compensation of a release)."""

from __future__ import annotations

from typing import Any

TOOL = "deploy.create_release"
#: The undo of :data:`TOOL`: ``POST /projects/{target}/rollbacks`` with ``{"release": ...}``.
ROLLBACK_TOOL = "deploy.rollback_release"


def http_tool_toml(url: str, name: str = TOOL, /, *, lookup: bool = True, **settings: Any) -> str:
    """One ``[tools."<name>"]`` table (default ``deploy.create_release``) on the reference
    service at ``url``.

    ``lookup`` adds the lookup-by-key endpoint; ``settings`` are further TOML keys
    (``timeout_s``, ``inflight_horizon_s``, ``dedup_window_s``, …).
    """
    return _table(url, name, "releases", lookup=lookup, settings=settings)


def rollback_tool_toml(
    url: str, name: str = ROLLBACK_TOOL, /, *, lookup: bool = True, **settings: Any
) -> str:
    """One ``[tools."<name>"]`` table (default ``deploy.rollback_release``): the rollback of
    a release on the reference service at ``url``, its payload ``{"release": "rel-N"}`` (in a
    saga's compensation, ``{"release": "{remote_ref}"}``), looked up by key like a create.

    ``lookup`` and ``settings`` as for :func:`http_tool_toml`.
    """
    return _table(url, name, "rollbacks", lookup=lookup, settings=settings)


def _table(url: str, name: str, collection: str, *, lookup: bool, settings: dict[str, Any]) -> str:
    lines = [
        f'[tools."{name}"]',
        'kind = "http"',
        'method = "POST"',
        f'url = "{url}/projects/{{target}}/{collection}"',
        'idempotency_header = "Idempotency-Key"',
        'remote_ref = "id"',
        "rejected_statuses = [400, 422]",
    ]
    if lookup:
        lines += [
            f'lookup_url = "{url}/projects/{{target}}/{collection}/by-key/{{operation_id}}"',
            'lookup_remote_ref = "id"',
            "lookup_not_applied_statuses = [404]",
        ]
    lines += [f"{key} = {_toml_value(value)}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)
