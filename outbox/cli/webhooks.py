"""``outbox webhooks``: what escalation webhooks were sent, wait for a retry, or were given up."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from outbox import sql
from outbox.cli.common import transaction
from outbox.cli.output import age, console, print_json
from outbox.models import DeliveryStatus

if TYPE_CHECKING:
    from outbox.models import Delivery


app = typer.Typer(help="Escalation webhooks and their deliveries.", no_args_is_help=True)


@app.command("list")
def list_deliveries(
    status: Annotated[
        DeliveryStatus | None,
        typer.Option(help="Only deliveries with this status.", case_sensitive=False),
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="At most this many.")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
) -> None:
    """List webhook deliveries, newest first."""
    from outbox import webhooks  # noqa: PLC0415 -- not for --help
    from outbox.config import get_settings  # noqa: PLC0415 -- not for --help

    settings = get_settings()
    # Refuse a half-configured webhook here too: the operator sees it before wondering why
    # nothing arrives.
    endpoint = webhooks.check_settings(settings)
    with transaction() as session:
        found = sql.webhooks.list_deliveries(session, status=status, limit=limit)
        now = sql.deployment.clock(session)
    if as_json:
        print_json([delivery.to_dict() for delivery in found])
        return
    if not found:
        note = "" if endpoint else " (webhooks are off: OUTBOX_WEBHOOK_URL is unset)"
        console.print("no deliveries" + (f" with status {status.value}" if status else "") + note)
        return
    console.print(_deliveries_table(found, now))


def _next_attempt(delivery: Delivery, now: datetime) -> str:
    if delivery.status is not DeliveryStatus.PENDING:
        return "-"
    if delivery.next_attempt_at <= now:
        return "due"
    return "in " + age(now, delivery.next_attempt_at)


def _last(delivery: Delivery) -> str:
    if delivery.last_error:
        return delivery.last_error
    return str(delivery.last_status) if delivery.last_status is not None else ""


def _deliveries_table(found: list[Delivery], now: datetime) -> Table:
    table = Table()
    table.add_column("id", no_wrap=True, min_width=36)
    table.add_column("event")
    table.add_column("operation or subject", no_wrap=True, min_width=36)
    for header in ("status", "attempts", "last status/error", "next attempt", "created"):
        table.add_column(header)
    for delivery in found:
        table.add_row(
            str(delivery.id),
            delivery.event.value,
            str(delivery.operation_id or delivery.subject),
            delivery.status.value,
            str(delivery.attempts),
            _last(delivery),
            _next_attempt(delivery, now),
            age(delivery.created_at, now) + " ago",
        )
    return table
