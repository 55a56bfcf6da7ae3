"""``outbox ops``: look at operations and act on them as an operator."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table
from sqlalchemy import func, select

from outbox import api, statements
from outbox.cli.common import transaction
from outbox.cli.output import age, console, print_json
from outbox.errors import OperationNotFound
from outbox.models import Event, Operation
from outbox.states import State

app = typer.Typer(help="List, inspect and act on operations.", no_args_is_help=True)


@app.command("list")
def list_operations(
    state: Annotated[
        State | None, typer.Option(help="Only operations in this state.", case_sensitive=False)
    ] = None,
    tool: Annotated[str | None, typer.Option(help="Only operations of this tool.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="At most this many.")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
) -> None:
    """List operations, newest first."""
    with transaction() as session:
        found = statements.list_operations(session, state=state, tool=tool, limit=limit)
        now = session.execute(select(func.clock_timestamp())).scalar_one()
    if as_json:
        print_json([op.to_dict() for op in found])
        return
    if not found:
        console.print("no operations" + (f" in state {state.value}" if state else ""))
        return
    console.print(_operations_table(found, now))


@app.command()
def show(
    operation_id: Annotated[str, typer.Argument(metavar="ID", help="The operation id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON with `events`.")] = False,
) -> None:
    """Show one operation and its audit trail (every state change, who made it and why)."""
    with transaction() as session:
        op = api.get(session, operation_id)
        if op is None:
            raise OperationNotFound(f"no operation {operation_id}")
        history = statements.list_events(session, op.id)
    if as_json:
        print_json(op.to_dict() | {"events": [event.to_dict() for event in history]})
        return
    console.print(_details(op), highlight=False, soft_wrap=True)
    console.print(_events_table(history))


@app.command()
def cancel(
    operation_id: Annotated[str, typer.Argument(metavar="ID", help="The operation id.")],
    reason: Annotated[str, typer.Option(help="Why, for the audit trail.")] = "cancelled by CLI",
    as_json: Annotated[bool, typer.Option("--json", help="Print the operation as JSON.")] = False,
) -> None:
    """Cancel a planned operation that no attempt can have reached the remote with."""
    with transaction() as session:
        op = api.cancel(session, operation_id, reason=reason)
    if as_json:
        print_json(op.to_dict())
        return
    console.print(f"{op.id} cancelled", highlight=False)


def _operations_table(found: list[Operation], now: object) -> Table:
    table = Table()
    table.add_column("id", no_wrap=True, min_width=36)
    for header in ("state", "tool", "target", "attempts", "age", "intent key", "last error"):
        table.add_column(header)
    for op in found:
        table.add_row(
            str(op.id),
            op.state.value,
            op.tool,
            op.target,
            str(op.attempts),
            age(op.created_at, now),  # type: ignore[arg-type]
            op.intent_key,
            op.last_error or "",
        )
    return table


def _details(op: Operation) -> str:
    rows = [
        ("id", op.id),
        ("state", op.state.value),
        ("tool", op.tool),
        ("target", op.target),
        ("intent key", op.intent_key),
        ("payload hash", op.payload_hash),
        ("attempts", op.attempts),
        ("maybe applied", op.maybe_applied),
        ("remote ref", op.remote_ref),
        ("last error", op.last_error),
        ("created", op.created_at),
        ("first sent", op.first_sent_at),
        ("last sent", op.sent_at),
        ("resolved", op.resolved_at),
        ("payload", json.dumps(op.payload, ensure_ascii=False)),
    ]
    return "\n".join(f"{name:>14}: {'-' if value is None else value}" for name, value in rows)


def _events_table(history: list[Event]) -> Table:
    table = Table("at", "from", "to", "attempt", "actor", "reason", title="events")
    for event in history:
        table.add_row(
            event.at.isoformat(timespec="seconds"),
            event.from_state.value if event.from_state else "-",
            event.to_state.value,
            str(event.attempt),
            event.actor,
            event.reason,
        )
    return table
