"""``outbox db``: create and upgrade the schema, print its DDL, check it is current."""

from __future__ import annotations

import sys

import typer

from outbox import migrate
from outbox.cli.common import connected, require_schema
from outbox.cli.output import console

app = typer.Typer(
    help="Manage the outbox schema (tables in the PostgreSQL schema `outbox`).",
    no_args_is_help=True,
)


@app.command()
def upgrade() -> None:
    """Create or upgrade the `outbox` schema to the latest revision.

    Safe to run from several processes at once: an advisory lock serialises them, and every
    one of them succeeds. Touches nothing outside the `outbox` schema.
    """
    with connected() as engine:
        before = migrate.current(engine)
        migrate.upgrade(engine)
        after = migrate.current(engine)
    if before == after:
        console.print(f"schema already at {after} (head)")
    else:
        console.print(f"schema upgraded from {before or 'empty'} to {after}")


@app.command()
def sql() -> None:
    """Print the DDL that creates the schema from empty, without connecting (for DBAs)."""
    sys.stdout.write(migrate.sql())


@app.command()
def check() -> None:
    """Exit 0 if the schema is at the latest revision, 1 (with the fix) otherwise."""
    console.print(f"schema at head ({require_schema()})")
