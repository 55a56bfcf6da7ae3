"""``outbox tools``: the configured tools' contracts as the deployment publishes them.

A worker publishes its loaded tools' contracts (approval policy, ``input_schema``) to
``outbox.tool_policies`` when it starts, and from then on ``enqueue`` in every process refuses
a tool not published there. ``publish`` does the same without starting a worker, for a tool
whose workers are not running yet (a deploy that migrates and publishes, then starts them);
``list`` shows what ``enqueue`` checks against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from outbox import sql
from outbox.cli.common import connected
from outbox.cli.extras import needs_extra
from outbox.cli.output import console, fail, print_json

if TYPE_CHECKING:
    from outbox.contracts import ToolContract


app = typer.Typer(
    help="The tools' contracts as this deployment publishes them (what enqueue checks).",
    no_args_is_help=True,
)


def _configured() -> list[ToolContract]:
    """The contracts of the configured tools (OUTBOX_CONFIG, OUTBOX_TOOLS), loaded as the
    workers load them; none configured is an error (there would be nothing to publish)."""
    from outbox.config import get_settings  # noqa: PLC0415 -- not for --help
    from outbox.contracts import CONTRACTS  # noqa: PLC0415 -- not for --help

    settings = get_settings()
    if settings.config is None and not settings.tools:
        fail("no tools are configured: set OUTBOX_CONFIG (a TOML file) or OUTBOX_TOOLS (modules)")
    with needs_extra("worker", "tools publish"):
        from outbox.tools import load_tools  # noqa: PLC0415 -- the [worker] extra

        load_tools(settings)
    contracts = (CONTRACTS.get(name) for name in CONTRACTS.names())
    return [c for c in contracts if c is not None]


@app.command("publish")
def publish(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON object.")] = False,
) -> None:
    """Publish the configured tools' contracts (approval policy, input_schema) and budgets,
    as a starting worker does, without starting one: `enqueue` in any process then accepts
    these tools and checks their payloads. Safe to run again (unchanged rows are left alone)."""
    from outbox.approval import publish_policies_committed  # noqa: PLC0415 -- not for --help
    from outbox.budgets import BUDGETS, publish_budgets_committed  # noqa: PLC0415 -- not for --help

    contracts = _configured()
    with connected() as engine:
        count = publish_policies_committed(engine, contracts)
        budgets = publish_budgets_committed(engine, BUDGETS.all())
    names = [c.name for c in contracts]
    if as_json:
        print_json({"tools": names, "budgets": budgets})
        return
    console.print(f"published {count} tool(s): {', '.join(names) or 'none'}; {budgets} budget(s)")


@app.command("list")
def list_published(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON object.")] = False,
) -> None:
    """The tools this deployment has published, as `enqueue` sees them (none: any tool is
    accepted; else only these, each payload checked against its input_schema)."""
    with connected() as engine, engine.connect() as conn:
        published = sql.approval.published_policies(conn)
    rows = [
        {
            "tool": p.tool,
            "approval_required": p.approval_required,
            "approval_ttl_s": p.approval_ttl_s,
            "input_schema": p.input_schema,
        }
        for p in sorted(published, key=lambda p: p.tool)
    ]
    if as_json:
        print_json({"tools": rows})
        return
    if not rows:
        console.print("no tools published: enqueue accepts any tool (see docs/tools.md)")
        return
    table = Table(title="published tools")
    for header in ("tool", "approval", "input_schema"):
        table.add_column(header)
    for row in rows:
        approval = "required" if row["approval_required"] else "none"
        table.add_row(str(row["tool"]), approval, "yes" if row["input_schema"] else "no")
    console.print(table)
