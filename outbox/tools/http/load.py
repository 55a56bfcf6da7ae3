"""Reading ``OUTBOX_CONFIG``: its ``[tools."name"]`` tables become :class:`HttpTool` objects.

Errors name ``OUTBOX_CONFIG``, the file and the key (or the TOML line); ``env_headers`` are read
from the environment here, and their values never appear in a message.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from outbox.errors import ConfigError
from outbox.tools.base import check_tool_name
from outbox.tools.http.spec import (
    HEADER_VALUE,
    BreakerSpec,
    ConcurrencySpec,
    HttpToolSpec,
    RateSpec,
)
from outbox.tools.http.tool import HttpTool


def load_http_tools(path: Path, environ: Mapping[str, str] | None = None) -> list[HttpTool]:
    """Read the ``[tools."name"]`` tables of the TOML file ``path`` (``OUTBOX_CONFIG``).

    ``env_headers`` are read from ``environ`` (default: ``os.environ``). Raises
    :class:`ConfigError` naming ``OUTBOX_CONFIG``, the file and the offending key (or the
    TOML line); header values never appear in the message.
    """
    document = _read_toml(path)
    environ = os.environ if environ is None else environ
    unknown = sorted(set(document) - {"tools", "budgets"})
    if unknown:
        _fail(
            path,
            f"unknown top-level key(s) {', '.join(unknown)}; declare "
            '[tools."name"] and [budgets."name"]',
        )
    tables = document.get("tools", {})
    if not isinstance(tables, dict):
        _fail(path, 'tools must be a table of [tools."name"] tables')
    tools: list[HttpTool] = []
    problems: list[str] = []
    for name, table in tables.items():
        try:
            tools.append(_build_tool(name, table, environ, path))
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        _fail(path, "; ".join(problems))
    return tools


def read_config(path: Path) -> dict[str, Any]:
    """The TOML document of ``OUTBOX_CONFIG`` (``path``); :class:`ConfigError` naming the file."""
    return _read_toml(path)


def _build_tool(name: str, table: Any, environ: Mapping[str, str], path: Path) -> HttpTool:
    where = f'tools."{name}"'
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    if "kind" not in table and table and all(isinstance(v, dict) for v in table.values()):
        inner = next(iter(table))
        raise ConfigError(
            f'{where} holds tables, not a tool: quote dotted names, [tools."{name}.{inner}"]'
        )
    try:
        check_tool_name(name)
        spec = HttpToolSpec.model_validate(table)
        headers = {**spec.headers, **_environment_headers(where, spec, environ)}
        return HttpTool(name, spec, headers, path)
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe(where, dict(e)) for e in exc.errors())) from None
    except ConfigError as exc:
        raise ConfigError(f"{where}: {str(exc).removeprefix(f'tool {name!r}: ')}") from None


def _environment_headers(
    where: str, spec: HttpToolSpec, environ: Mapping[str, str]
) -> dict[str, str]:
    headers = {}
    for name, variable in spec.env_headers.items():
        value = environ.get(variable, "")
        if not value:
            raise ConfigError(
                f"env_headers.{name}: environment variable {variable} is not set (or empty)"
            )
        if not HEADER_VALUE.fullmatch(value):
            raise ConfigError(
                f"env_headers.{name}: environment variable {variable} holds characters HTTP "
                "forbids in a header"
            )
        headers[name] = value
    return headers


#: The guard sub-tables of a tool's table, whose own keys an unknown key's error lists.
_GUARD_TABLES: dict[str, type[BreakerSpec | RateSpec | ConcurrencySpec]] = {
    "breaker": BreakerSpec,
    "rate": RateSpec,
    "concurrency": ConcurrencySpec,
}


def _describe(where: str, error: dict[str, Any]) -> str:
    location = where
    for part in error.get("loc", ()):
        if part == "[key]":
            continue
        location += f"[{part}]" if isinstance(part, int) else f".{part}"
    kind = error.get("type")
    if kind == "extra_forbidden":
        loc = error.get("loc", ())
        sub = _GUARD_TABLES.get(str(loc[0])) if len(loc) > 1 else None
        allowed = sub.model_fields if sub is not None else HttpToolSpec.model_fields
        return f"{location}: unknown key; allowed keys: {', '.join(allowed)}"
    if kind == "missing":
        return f"{location}: required key is missing"
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{location}: {message}"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"OUTBOX_CONFIG: cannot read {path}: {reason}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"OUTBOX_CONFIG {path}: invalid TOML: {exc}") from None


def _fail(path: Path, problem: str) -> None:
    raise ConfigError(f"OUTBOX_CONFIG {path}: {problem}")
