"""``outbox ops``: look at operations and act on them as an operator."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated
from uuid import UUID

import typer
from rich import box
from rich.table import Table

from outbox import sql
from outbox.cli.common import transaction
from outbox.cli.output import age, console, moment, print_json, wide_console
from outbox.errors import ConfigError, OperationNotFound
from outbox.states import State

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from outbox.models import Event, Operation


app = typer.Typer(help="List, inspect and act on operations.", no_args_is_help=True)


@app.command("list")
def list_operations(
    state: Annotated[
        State | None, typer.Option(help="Only operations in this state.", case_sensitive=False)
    ] = None,
    tool: Annotated[str | None, typer.Option(help="Only operations of this tool.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="At most this many.")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
    wide: Annotated[
        bool,
        typer.Option("--wide", help="One line per operation, every column and hash whole."),
    ] = False,
) -> None:
    """List operations, newest first.

    Readable at 80 columns: each operation's id, tool and target are stacked in its first
    column and a payload hash is shortened to its first 12 characters (`ops show` prints it
    whole); `--wide` prints one line per operation with everything whole.

    With `--state needs_human` (or `unknown`) it lists the queue an operator works through:
    how long each has waited in that state and why it is there (`reason` in JSON). With
    `--state awaiting_approval`, what waits for an approval: for how long, until when, and
    its payload hash (`outbox ops approve ID --by NAME --payload-hash H`).
    """
    from outbox.resolve import RESOLVABLE_STATES, waiting_reasons  # noqa: PLC0415 -- not for --help

    queue = state in RESOLVABLE_STATES
    with transaction() as session:
        found = sql.intents.list_operations(session, state=state, tool=tool, limit=limit)
        now = sql.deployment.clock(session)
        reasons = waiting_reasons(session, [op.id for op in found]) if queue else {}
    if as_json:
        extra = [{"reason": reasons.get(op.id)} if queue else {} for op in found]
        print_json([op.to_dict() | more for op, more in zip(found, extra, strict=True)])
        return
    if not found:
        console.print("no operations" + (f" in state {state.value}" if state else ""))
        return
    if queue:
        table = _queue_table(found, reasons, now, wide=wide)
    elif state is State.AWAITING_APPROVAL:
        table = _approval_table(found, now, wide=wide)
    else:
        table = _operations_table(found, now, wide=wide)
    (wide_console if wide else console).print(table)


@app.command()
def show(
    operation: Annotated[
        str,
        typer.Argument(metavar="ID_OR_KEY", help="The operation id, or its intent key."),
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON with `events`.")] = False,
) -> None:
    """Show one operation and its audit trail (every state change, who made it and why).

    Name it by id or by the intent key it was enqueued with (`outbox enqueue --key`).
    """
    from outbox.resolve import RESOLVABLE_STATES  # noqa: PLC0415 -- not for --help

    with transaction() as session:
        op = _by_id_or_key(session, operation)
        history = sql.intents.list_events(session, op.id)
    if as_json:
        print_json(op.to_dict() | {"events": [event.to_dict() for event in history]})
        return
    console.print(_details(op), highlight=False, soft_wrap=True)
    console.print(_events_table(history))
    if op.state in RESOLVABLE_STATES:
        console.print(_resolve_hint(op), highlight=False, markup=False, soft_wrap=True)
    if op.state is State.AWAITING_APPROVAL:
        console.print(_approval_hint(op), highlight=False, markup=False, soft_wrap=True)


def _by_id_or_key(session: Session, value: str) -> Operation:
    """The operation whose id is ``value``, else the one whose intent key is; one line if none,
    or if agents share the key (each agent's is another operation: then its id is asked for).

    An id is tried first: an intent key left to its default is the operation's own id, so
    both readings name the same operation.
    """
    from outbox import api  # noqa: PLC0415 -- not for --help

    try:
        op = api.get(session, UUID(value))
    except ValueError:
        op = None
    if op is not None:
        return op
    found = api.find_every_agents(session, value)
    if not found:
        raise OperationNotFound(f"no operation with id or intent key {value!r}")
    if len(found) > 1:
        each = ", ".join(f"{o.id} (agent {o.agent or '(shared)'})" for o in found)
        raise OperationNotFound(
            f"intent key {value!r} names {len(found)} operations, one per agent: {each}; "
            "give the id of the one you mean"
        )
    return found[0]


@app.command()
def cancel(
    operation_id: Annotated[str, typer.Argument(metavar="ID", help="The operation id.")],
    reason: Annotated[str, typer.Option(help="Why, for the audit trail.")] = "cancelled by CLI",
    as_json: Annotated[bool, typer.Option("--json", help="Print the operation as JSON.")] = False,
) -> None:
    """Cancel a planned operation (or one awaiting approval) that no attempt can have reached
    the remote with."""
    from outbox import api  # noqa: PLC0415 -- not for --help

    with transaction() as session:
        op = api.cancel(session, operation_id, reason=reason)
    if as_json:
        print_json(op.to_dict())
        return
    console.print(f"{op.id} cancelled", highlight=False)


@app.command("approve")
def approve_command(
    operation_id: Annotated[str, typer.Argument(metavar="ID", help="The operation id.")],
    *,
    by: Annotated[str, typer.Option(help="Who approves it (your name), for the audit trail.")],
    payload_hash: Annotated[
        str,
        typer.Option(help="The hash of the payload you read and approve (`ops show`)."),
    ],
    note: Annotated[str | None, typer.Option(help="Why, for the audit trail.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the operation as JSON.")] = False,
) -> None:
    """Approve an operation that waits in `awaiting_approval`: it is sent next.

    Bound to the payload you saw: refused, writing nothing, if `--payload-hash` is not the
    stored payload's, if someone decided already ("already decided by X at T"), or once the
    approval expired. Read the payload and its hash with `ops show ID` first.
    """
    from outbox import approval  # noqa: PLC0415 -- not for --help

    with transaction() as session:
        op = approval.approve(session, operation_id, by=by, payload_hash=payload_hash, note=note)
    if as_json:
        print_json(op.to_dict())
        return
    console.print(f"{op.id} approved by {by}: now {op.state.value}", highlight=False)


@app.command("reject")
def reject_command(
    operation_id: Annotated[str, typer.Argument(metavar="ID", help="The operation id.")],
    *,
    by: Annotated[str, typer.Option(help="Who rejects it (your name), for the audit trail.")],
    reason: Annotated[str, typer.Option(help="Why, for the audit trail.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the operation as JSON.")] = False,
) -> None:
    """Reject an operation that waits in `awaiting_approval`: it is cancelled, never sent."""
    from outbox import approval  # noqa: PLC0415 -- not for --help

    with transaction() as session:
        op = approval.reject(session, operation_id, by=by, reason=reason)
    if as_json:
        print_json(op.to_dict())
        return
    console.print(f"{op.id} rejected by {by}: now {op.state.value}", highlight=False)


@app.command("resolve")
def resolve_command(
    operation_id: Annotated[str, typer.Argument(metavar="ID", help="The operation id.")],
    *,
    applied: Annotated[
        bool, typer.Option("--applied", help="The effect exists at the remote: confirm it.")
    ] = False,
    not_applied: Annotated[
        bool,
        typer.Option(
            "--not-applied", help="The effect does not exist at the remote: fail it (or --replay)."
        ),
    ] = False,
    remote_ref: Annotated[
        str | None,
        typer.Option(help="With --applied: the remote's id of the effect (required there)."),
    ] = None,
    replay: Annotated[
        bool,
        typer.Option(
            "--replay",
            help="With --not-applied: send it again, same key and payload, instead of failing it.",
        ),
    ] = False,
    by: Annotated[str, typer.Option(help="Who resolves it (your name), for the audit trail.")],
    note: Annotated[str, typer.Option(help="Why: what you checked and found, for the trail.")],
    expect_attempts: Annotated[
        int | None,
        typer.Option(
            min=0, help="The attempt number you looked at (`ops show`); refused if it moved on."
        ),
    ] = None,
    payload_hash: Annotated[
        str | None,
        typer.Option(help="The payload hash you approved (`ops show`); refused if different."),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Allow --not-applied/--replay before the tool's in-flight horizon has passed.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the operation as JSON.")] = False,
) -> None:
    """Record your verdict on an operation that waits in `unknown` or `needs_human`.

    `--applied --remote-ref R` confirms it; `--not-applied` fails it; `--not-applied --replay`
    plans it again: the same payload is sent again under the same idempotency key. Refused,
    writing nothing, while another component works on it, if it moved on since you looked
    (`--expect-attempts`), if its payload is not the one you approved (`--payload-hash`),
    and for --not-applied/--replay until the tool's in-flight horizon has passed since its
    last send (unless `--force`). Use `ops show ID` first: it prints this command filled in.
    """
    from outbox.resolve import resolve  # noqa: PLC0415 -- not for --help

    if applied == not_applied:
        raise typer.BadParameter(
            "pass exactly one of --applied or --not-applied",
            param_hint="'--applied' / '--not-applied'",
        )
    _load_tools()
    with transaction() as session:
        op = resolve(
            session,
            operation_id,
            applied=applied,
            remote_ref=remote_ref,
            replay=replay,
            by=by,
            note=note,
            expect_attempts=expect_attempts,
            payload_hash=payload_hash,
            force=force,
        )
    if as_json:
        print_json(op.to_dict())
        return
    console.print(f"{op.id} resolved by {by}: now {op.state.value}", highlight=False)
    if op.state is State.PLANNED:
        console.print("it will be sent again: same payload, same idempotency key", highlight=False)
    console.print(_details(op), highlight=False, soft_wrap=True)


def _load_tools() -> None:
    """Register the tools' contracts, so a resolution knows each tool's in-flight horizon."""
    # Deferred: the CLI sits above the workers layer and imports it only where needed.
    from outbox.tools import load_tools  # noqa: PLC0415 -- not for --help

    try:
        load_tools()
    except ConfigError as exc:
        raise ConfigError(f"cannot load the tools to learn their in-flight horizon: {exc}") from exc


#: How much of a payload hash the narrow tables show (`ops show` prints it whole).
SHORT_HASH = 12


def _table(*, wide: bool) -> Table:
    """A table whose first column names each operation: its id alone when wide, else its id
    over its tool and its target (so that none of the three is cut at 80 columns)."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    # Never narrower than a whole id: the other columns give way (a longer tool folds).
    table.add_column(
        "id" if wide else "id / tool / target", no_wrap=wide, overflow="fold", min_width=36
    )
    if wide:
        table.add_column("tool", no_wrap=True)
        table.add_column("target", no_wrap=True)
    return table


def _named(op: Operation, *, wide: bool, more: str = "") -> list[str]:
    """The first cells of an operation's row (see :func:`_table`); ``more``, a line under
    the target when narrow."""
    if wide:
        return [str(op.id), op.tool, op.target]
    return ["\n".join(filter(None, (str(op.id), op.tool, op.target, more)))]


def _operations_table(found: list[Operation], now: object, *, wide: bool) -> Table:
    table = _table(wide=wide)
    table.add_column("state", no_wrap=True)
    for header in ("attempts", "age"):
        table.add_column(header, no_wrap=True)
    for header in ("intent key", "last error"):
        table.add_column(header, no_wrap=wide, overflow="ellipsis")
    for op in found:
        table.add_row(
            *_named(op, wide=wide),
            op.state.value,
            str(op.attempts),
            age(op.created_at, now),  # type: ignore[arg-type]
            op.intent_key,
            op.last_error or "",
        )
    return table


def _queue_table(
    found: list[Operation], reasons: dict[UUID, str], now: object, *, wide: bool
) -> Table:
    """The operator's view: how long each has waited in its state, and why it is there."""
    table = _table(wide=wide)
    for header in ("attempts", "waiting"):
        table.add_column(header, no_wrap=True)
    table.add_column("reason", no_wrap=wide)
    for op in found:
        table.add_row(
            *_named(op, wide=wide),
            str(op.attempts),
            age(op.updated_at, now),  # type: ignore[arg-type]
            reasons.get(op.id, ""),
        )
    return table


def _approval_table(found: list[Operation], now: object, *, wide: bool) -> Table:
    """What waits for an approval: since when, until when, and the hash to approve."""
    table = _table(wide=wide)
    if wide:
        table.add_column("requested by", no_wrap=True)
    # Narrow, every column is as wide as its content: 36 + 6 + 20 + 12 and three gaps of 2.
    table.add_column("waiting" if wide else "waited", no_wrap=True)
    table.add_column("expires", no_wrap=True)
    table.add_column("payload hash", no_wrap=True)
    for op in found:
        table.add_row(
            *_named(op, wide=wide, more=f"requested by {op.requested_by}" * bool(op.requested_by)),
            *([op.requested_by or ""] if wide else []),
            age(op.updated_at, now),  # type: ignore[arg-type]
            moment(op.approval_expires_at),
            op.payload_hash if wide else op.payload_hash[:SHORT_HASH],
        )
    return table


def _approval_hint(op: Operation) -> str:
    """The `ops approve` / `ops reject` commands to copy, bound to the payload shown."""
    from outbox import approval  # noqa: PLC0415 -- not for --help

    return "\n".join(
        [
            "",
            "it waits for your approval; read the payload above, then one of:",
            f"  approve: {approval.approve_command(op)}",
            f"  reject:  {approval.reject_command(op)}",
        ]
    )


def _resolve_hint(op: Operation) -> str:
    """The `ops resolve` commands to copy, fenced on what is shown now."""
    fence = f"--expect-attempts {op.attempts} --payload-hash {op.payload_hash}"
    sign = '--by "YOUR NAME" --note "WHAT YOU CHECKED"'
    base = f"outbox ops resolve {op.id}"
    if op.attempts == 0:
        # Never sent (its tool unknown to the worker, say): nothing can have applied, so
        # "applied" is not offered.
        return "\n".join(
            [
                "",
                "it was never sent (no attempt), so nothing can have applied; pick one and "
                "fill in --by and --note:",
                f"  fail it:   {base} --not-applied {sign} {fence}",
                f"  send it:   {base} --not-applied --replay {sign} {fence}",
            ]
        )
    return "\n".join(
        [
            "",
            "to resolve it, pick the one that is true and fill in --by and --note:",
            f"  applied:              {base} --applied --remote-ref REMOTE_ID {sign} {fence}",
            f"  not applied, failed:  {base} --not-applied {sign} {fence}",
            f"  not applied, resend:  {base} --not-applied --replay {sign} {fence}",
        ]
    )


def _details(op: Operation) -> str:
    rows = [
        ("id", op.id),
        ("state", op.state.value),
        ("tool", op.tool),
        ("target", op.target),
        ("intent key", op.intent_key),
        ("agent", op.agent or "(shared)"),
        ("payload hash", op.payload_hash),
        ("approval", _approval_status(op)),
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
    saga = _saga_line(op)
    if saga is not None:  # only for a saga's step or undo: most operations have none
        rows.insert(6, ("saga", saga))
    return "\n".join(f"{name:>14}: {'-' if value is None else value}" for name, value in rows)


def _saga_line(op: Operation) -> str | None:
    """The saga the operation is a step or an undo of (`outbox sagas show KEY`), if any."""
    key = op.metadata.get("saga")
    step, undone = op.metadata.get("saga_step"), op.metadata.get("saga_compensates")
    if not isinstance(key, str):
        return None
    if isinstance(step, str):
        role = f"step {step}"
    elif isinstance(undone, str):
        role = f"the undo of step {undone}"
    else:
        return None  # free metadata that happens to say "saga": not one of its operations
    return f"{key} ({role}; outbox sagas show {key})"


def _approval_status(op: Operation) -> str | None:
    """Whether a person must approve it, and where that stands; ``None`` if not required."""
    if not op.approval_required:
        return None
    expires = (
        op.approval_expires_at.isoformat(timespec="seconds") if op.approval_expires_at else "?"
    )
    if op.approved_payload_hash is not None:
        return f"approved by {op.decided_by} at {op.decided_at}"
    if op.decided_by is not None:
        return f"rejected by {op.decided_by} at {op.decided_at}"
    if op.state is State.AWAITING_APPROVAL:
        return f"required, waiting (expires {expires})"
    return f"required, not given (expired {expires} or cancelled)"


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
