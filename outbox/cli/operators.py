"""``outbox operators``: the accounts that sign in to the console (docs/console.md)."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from outbox import sql
from outbox.cli.common import transaction
from outbox.cli.extras import needs_extra
from outbox.cli.output import age, console, fail, print_json

if TYPE_CHECKING:
    from outbox.operators import Operator


app = typer.Typer(
    help="Operator accounts of the console (`outbox api`, at /).", no_args_is_help=True
)


def _read_password(prompt: str, *, from_stdin: bool) -> str:
    """A password from stdin's first line (``--password-stdin``), else asked for twice at a
    terminal; never an argument (it would stay in the shell's history and the process list)."""
    if from_stdin:
        return sys.stdin.readline().rstrip("\r\n")
    if not sys.stdin.isatty():
        fail("stdin is not a terminal: pass --password-stdin to read the password from it", 2)
    return str(typer.prompt(prompt, hide_input=True, confirmation_prompt=True))


@app.command("add")
def add_command(
    name: Annotated[
        str,
        typer.Argument(help="The operator's name: the identity the console records as decider."),
    ],
    password_stdin: Annotated[
        bool,
        typer.Option(
            "--password-stdin",
            help="Read the password from stdin's first line instead of prompting for it.",
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the account's row as JSON.")
    ] = False,
) -> None:
    """Add an operator account; the password is asked for (twice) or read from stdin, never
    taken as an argument (it would stay in the shell's history and the process list).

    Only its argon2id hash is kept. A name is never reused, even once removed.
    """
    from outbox import operators  # noqa: PLC0415 -- not for --help

    password = _read_password(f"Password for {name}", from_stdin=password_stdin)
    with needs_extra("api", "operators add"), transaction() as session:
        made = operators.add_operator(session, name=name, password=password)
    if as_json:
        print_json(made.to_dict())
        return
    console.print(f"operator {made.name!r} added", markup=False, highlight=False)


@app.command("list")
def list_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
) -> None:
    """List the operator accounts (removed ones too); never a password hash."""
    from outbox import operators  # noqa: PLC0415 -- not for --help

    with transaction() as session:
        found = operators.list_operators(session)
        now = sql.deployment.clock(session)
    if as_json:
        print_json([operator.to_dict() for operator in found])
        return
    if not found:
        console.print("no operators: add one with `outbox operators add NAME`")
        return
    console.print(_table(found, now))


@app.command("remove")
def remove_command(
    name: Annotated[str, typer.Argument(help="The operator's name (`outbox operators list`).")],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the account's row as JSON.")
    ] = False,
) -> None:
    """Remove an operator account: it cannot sign in any more, and its console sessions end
    at once. Its name stays taken."""
    from outbox import operators  # noqa: PLC0415 -- not for --help

    with transaction() as session:
        removed = operators.remove_operator(session, name)
    if as_json:
        print_json(removed.to_dict())
        return
    console.print(f"operator {removed.name!r} removed", markup=False, highlight=False)


@app.command("set-password")
def set_password_command(
    name: Annotated[str, typer.Argument(help="The operator's name (`outbox operators list`).")],
    password_stdin: Annotated[
        bool,
        typer.Option(
            "--password-stdin",
            help="Read the new password from stdin's first line instead of prompting for it.",
        ),
    ] = False,
) -> None:
    """Give an operator a new password (asked for twice, or read from stdin); every console
    session of theirs ends at once."""
    from outbox import operators  # noqa: PLC0415 -- not for --help

    password = _read_password(f"New password for {name}", from_stdin=password_stdin)
    with needs_extra("api", "operators set-password"), transaction() as session:
        changed = operators.set_password(session, name=name, password=password)
    console.print(
        f"operator {changed.name!r}: password changed, every session ended",
        markup=False,
        highlight=False,
    )


@app.command("sign-out-all")
def sign_out_all_command(
    name: Annotated[str, typer.Argument(help="The operator's name (`outbox operators list`).")],
    as_json: Annotated[
        bool, typer.Option("--json", help='Print {"name": ..., "sessions_ended": N}.')
    ] = False,
) -> None:
    """End every console session of an operator at once (a lost laptop, a copied cookie):
    each browser signed in as them is sent to the sign-in page at its next request."""
    from outbox import operators  # noqa: PLC0415 -- not for --help

    with transaction() as session:
        ended = operators.sign_out_all(session, name)
    if as_json:
        print_json({"name": name, "sessions_ended": ended})
        return
    console.print(
        f"operator {name!r}: {ended} session{'s' if ended != 1 else ''} ended",
        markup=False,
        highlight=False,
    )


def _ago(moment: datetime | None, now: datetime) -> str:
    return "-" if moment is None else age(moment, now) + " ago"


def _table(found: list[Operator], now: datetime) -> Table:
    table = Table()
    for header in ("name", "created", "removed"):
        table.add_column(header)
    for operator in found:
        table.add_row(operator.name, _ago(operator.created_at, now), _ago(operator.removed_at, now))
    return table
