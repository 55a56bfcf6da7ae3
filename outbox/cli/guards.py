"""``outbox guards``: the declared guard rails (breakers, rate limits, concurrency caps) and
their state in the database, and the budgets' use; ``reset`` closes a breaker or clears a
bucket, audited.

The output is in sections (``{"guards": [...], "budgets": [...]}`` with ``--json``, a titled
table each otherwise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from outbox.cli.common import connected
from outbox.cli.extras import needs_extra
from outbox.cli.output import console, fail, print_json

if TYPE_CHECKING:
    from outbox import guard_state
    from outbox.contracts import ToolContract
    from outbox.sql.budgets import BudgetUsage


app = typer.Typer(
    help="Guard rails per tool and target: circuit breakers, rate limits, concurrency caps; "
    "and the budgets' use.",
    no_args_is_help=True,
)


def _declared() -> list[ToolContract]:
    """The contracts of the configured tools (OUTBOX_TOOLS, OUTBOX_CONFIG), loaded as the
    workers load them."""
    from outbox.config import get_settings  # noqa: PLC0415 -- not for --help
    from outbox.contracts import CONTRACTS  # noqa: PLC0415 -- not for --help

    with needs_extra("worker", "guards"):
        from outbox.tools import load_tools  # noqa: PLC0415 -- the [worker] extra

        load_tools(get_settings())
    contracts = (CONTRACTS.get(name) for name in CONTRACTS.names())
    return [c for c in contracts if c is not None and c.guarded]


def _sections(rows: list[guard_state.GuardStatus], used: list[BudgetUsage]) -> dict[str, Any]:
    return {
        "guards": [row.as_json() for row in rows],
        "budgets": [
            {
                "budget": u.budget,
                "key": u.key,
                "window_s": u.window_s,
                "operations": u.operations,
                "max_operations": u.max_operations,
                "cost": u.cost,
                "max_cost": u.max_cost,
                "exhausted_at": u.exhausted_at.isoformat() if u.exhausted_at else None,
            }
            for u in used
        ],
    }


@app.command("list")
def list_guards(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON object.")] = False,
) -> None:
    """Every declared guard key with its state (a key per target once it has state), then
    every budget key used inside its window (the published budgets, docs/budgets.md)."""
    from outbox import budgets, guard_state  # noqa: PLC0415 -- not for --help

    contracts = _declared()
    with connected() as engine, engine.connect() as conn:
        rows = guard_state.report(conn, contracts)
        used = budgets.usage(conn)
    if as_json:
        print_json(_sections(rows, used))
        return
    if not rows:
        console.print("no guards declared (see docs/guards.md)")
    else:
        table = Table(title="guards")
        for header in ("guard", "key", "declared", "state"):
            table.add_column(header)
        for row in rows:
            table.add_row(row.guard, row.key, _pairs(row.declared), _pairs(row.state))
        console.print(table)
    if used:
        console.print(_budget_table(used))


def _budget_table(used: list[BudgetUsage]) -> Table:
    table = Table(title="budgets (keys used inside their window)")
    for header in ("budget", "key", "operations", "cost", "window", "exhausted at"):
        table.add_column(header)
    for u in used:
        table.add_row(
            u.budget,
            u.key or "(none)",
            f"{u.operations}/{u.max_operations}" if u.max_operations else str(u.operations),
            f"{u.cost:g}/{u.max_cost:g}" if u.max_cost else "",
            f"{u.window_s:g}s",
            u.exhausted_at.isoformat() if u.exhausted_at else "",
        )
    return table


def _pairs(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items() if v is not None)


@app.command("reset", no_args_is_help=True)
def reset_guard(
    key: Annotated[str, typer.Argument(help="The guard key: TOOL or TOOL:TARGET.")],
    by: Annotated[str, typer.Option("--by", help="Who resets it (recorded).")],
    note: Annotated[str, typer.Option("--note", help="Why (recorded).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON object.")] = False,
) -> None:
    """Close the breakers of KEY and clear its rate bucket; who, when and why are recorded."""
    from outbox import guard_state  # noqa: PLC0415 -- not for --help

    if not by.strip() or not note.strip():
        fail("--by and --note must not be empty", code=2)
    contracts = _declared()
    with connected() as engine, engine.connect() as conn:
        done = guard_state.reset(conn, key, by=by, note=note, contracts=contracts)
    if as_json:
        print_json(
            {"key": done.key, "reset": done.guards, "at": done.at.isoformat() if done.at else None}
        )
        return
    what = ", ".join(done.guards) or "nothing was stored (already closed and full)"
    console.print(f"{done.key}: reset {what} (by {by})")
