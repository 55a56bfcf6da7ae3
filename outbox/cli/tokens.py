"""``outbox tokens``: the bearer tokens of the HTTP API (``outbox api``, docs/api.md)."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from outbox import sql
from outbox.cli.common import transaction
from outbox.cli.output import age, console, errors, print_json
from outbox.models import TokenScope

if TYPE_CHECKING:
    from outbox.models import ApiToken


app = typer.Typer(help="Bearer tokens of the HTTP API (`outbox api`).", no_args_is_help=True)


@app.command("create")
def create_command(
    name: Annotated[
        str,
        typer.Argument(
            help="The token's name: the identity the API records (requested_by, the decider)."
        ),
    ],
    scope: Annotated[
        TokenScope,
        typer.Option(
            case_sensitive=False,
            help="agent: enqueue and read its own operations; operator: read all, decide.",
        ),
    ],
    agent: Annotated[
        str | None,
        typer.Option(
            help="The agent it speaks for (default: NAME): the scope of its intent keys and "
            "what it reads. Give an existing agent to rotate: make the new token, move the "
            "agent to it, revoke the old one; its operations and keys stay its own."
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the token and its row as JSON.")
    ] = False,
) -> None:
    """Make a token and print it, once: only its hash is kept, so store it now.

    The token goes to stdout alone (for a pipe or a secret store); the warning to stderr.
    A name is never reused, even once its token is revoked.
    """
    from outbox import tokens  # noqa: PLC0415 -- not for --help

    with transaction() as session:
        made = tokens.create_token(session, name=name, scope=scope, agent=agent)
    errors.print(
        f"warning: this is the only time token {name!r} is shown: only its hash is kept. "
        "Store it now; if it is lost, revoke it and make another.",
        markup=False,
        soft_wrap=True,
    )
    if as_json:
        print_json(made.info.to_dict() | {"token": made.token})
        return
    print(made.token)  # noqa: T201 -- the command's output, alone on stdout


@app.command("list")
def list_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
) -> None:
    """List the tokens (revoked ones too) with their scope and use; never a token or hash."""
    from outbox import tokens  # noqa: PLC0415 -- not for --help

    with transaction() as session:
        found = tokens.list_tokens(session)
        now = sql.deployment.clock(session)
    if as_json:
        print_json([token.to_dict() for token in found])
        return
    if not found:
        console.print("no tokens: make one with `outbox tokens create NAME --scope agent`")
        return
    console.print(_tokens_table(found, now))


@app.command("revoke")
def revoke_command(
    name: Annotated[str, typer.Argument(help="The token's name (`outbox tokens list`).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the token's row as JSON.")] = False,
) -> None:
    """Revoke a token: the API refuses it from its next request on. Its name stays taken."""
    from outbox import tokens  # noqa: PLC0415 -- not for --help

    with transaction() as session:
        revoked = tokens.revoke_token(session, name)
    if as_json:
        print_json(revoked.to_dict())
        return
    console.print(f"token {revoked.name!r} revoked", markup=False, highlight=False)


def _ago(moment: datetime | None, now: datetime) -> str:
    return "-" if moment is None else age(moment, now) + " ago"


def _tokens_table(found: list[ApiToken], now: datetime) -> Table:
    table = Table()
    for header in ("name", "scope", "agent", "created", "last used", "revoked"):
        table.add_column(header)
    for token in found:
        table.add_row(
            token.name,
            token.scope.value,
            token.agent,
            _ago(token.created_at, now),
            _ago(token.last_used_at, now),
            _ago(token.revoked_at, now),
        )
    return table
