"""How the CLI talks: tables for people, JSON for programs, one line per error."""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Any, NoReturn

from rich.console import Console
from rich.markup import escape

from outbox.config import ENV_PREFIX, Settings

# Not a terminal (a pipe, a log file): rich would wrap at 80 columns and cut the ids.
console = Console(width=None if sys.stdout.isatty() else 160)
errors = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)


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


def environment_help() -> str:
    """The ``--help`` epilog listing every ``OUTBOX_*`` variable and what it does."""
    header = "**Environment** (every setting; unset means the default):"
    lines = [
        f"`{ENV_PREFIX}{name.upper()}`: {field.description}"
        for name, field in Settings.model_fields.items()
    ]
    return "\n\n".join([header, *lines])
