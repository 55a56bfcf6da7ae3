"""How the CLI talks: tables for people, JSON for programs, one line per error."""

from __future__ import annotations

import enum
import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NoReturn

from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from pydantic.fields import FieldInfo

# Not a terminal (a pipe, a log file): rich would wrap at 80 columns and cut the ids, unless
# the caller says how wide its screen is (COLUMNS, which rich reads when no width is given).
console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160)
# `--wide` tables: wider than any of them needs, whatever the screen (a pager takes them).
wide_console = Console(width=400)
errors = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)


class PlainFormatter(logging.Formatter):
    """``warning: message``, as the CLI's own ``error: message`` lines: how a one-shot command
    (which sets up no logging) shows a library's warning, such as an unknown variable."""

    def format(self, record: logging.LogRecord) -> str:
        """The level in lower case and the message, nothing else."""
        return f"{record.levelname.lower()}: {record.getMessage()}"


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code``."""
    # Escaped: a message may hold brackets (`agent-outbox[worker]`), which are not markup.
    errors.print(f"[bold red]error:[/] {escape(message)}", markup=True, soft_wrap=True)
    sys.exit(code)


def print_json(value: Any) -> None:
    """Print ``value`` as JSON on stdout, nothing else (for pipes and scripts)."""
    sys.stdout.write(json.dumps(value, ensure_ascii=False, indent=2, default=str) + "\n")


def age(since: datetime | None, now: datetime) -> str:
    """A short human age: ``42s``, ``7m``, ``3h``, ``2d``."""
    if since is None:
        return "-"
    seconds = max(0, int((now - since).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def moment(at: datetime | None) -> str:
    """A whole instant in UTC, to the second: ``2026-12-04T05:00:00Z`` (20 columns)."""
    if at is None:
        return ""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _default(field: FieldInfo) -> str:
    """A setting's default as one would write it in the environment."""
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


def environment_help() -> str:
    """The ``--help`` epilog: every ``OUTBOX_*`` setting, its default and what it does.

    Generated from :class:`~outbox.config.Settings`, so a new setting is listed with no
    change here. ``outbox --help`` shows a copy of it (:mod:`outbox.cli.epilog`), which spares
    it importing the settings.
    """
    # Imported here: pydantic-settings is most of the cost of the root help (issue 33).
    from outbox.config import Settings, variable  # noqa: PLC0415 -- not for --help

    header = "**Environment** (every setting; unset means the default):"
    lines = [
        f"`{variable(name)}` (default: {_default(field)}): {field.description}"
        for name, field in Settings.model_fields.items()
    ]
    return "\n\n".join([header, *lines])
