"""The tools a long-running command loads: counted, said where from, and none refused.

`outbox up` and `outbox worker` with no tool would start and put every operation in
`needs_human` (no tool to send it with): they refuse instead, unless told (`--no-tools`).
"""

from __future__ import annotations

from typing import Annotated, NoReturn

import typer

from outbox.cli.extras import needs_extra
from outbox.cli.output import fail
from outbox.config import Settings

NoToolsOption = Annotated[
    bool,
    typer.Option(
        "--no-tools",
        help=(
            "Start with no tool (OUTBOX_CONFIG and OUTBOX_TOOLS name none): every operation "
            "then waits in needs_human. Without it, no tool is refused."
        ),
    ),
]


def load_toolset(command: str, settings: Settings, *, no_tools: bool) -> tuple[int, str]:
    """Load the tools of ``settings`` (a bad one: one line, exit 1) and return how many and
    from where; none, unless ``no_tools``: one line naming the variables, exit 2."""
    named = settings.config is not None or bool(settings.tools)
    if not named and not no_tools:
        _refuse(command, "OUTBOX_CONFIG and OUTBOX_TOOLS")  # before a log line says 0 loaded
    with needs_extra("worker", command):
        # Deferred: the tools layer (and the user's modules) only for the commands that send.
        from outbox.tools.registry import load_tools, tools_source  # noqa: PLC0415

    count = len(load_tools(settings))
    source = tools_source(settings)
    if count == 0 and not no_tools:
        _refuse(command, source)
    return count, source


def _refuse(command: str, named: str) -> NoReturn:
    fail(
        f"outbox {command} has no tool to send operations with: {named} name none; set "
        "OUTBOX_CONFIG (a TOML file of HTTP tools) or OUTBOX_TOOLS (modules that register "
        "tools), see docs/tools.md, or pass --no-tools to start without any (every "
        "operation would wait in needs_human)",
        code=2,  # a usage error, as Click's: the command was not told what to run
    )
