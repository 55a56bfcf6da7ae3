"""``outbox db``: create and upgrade the schema, print its DDL, check it is current, prune."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Generator
from typing import Annotated

import typer
from sqlalchemy import Engine

from outbox import migrate, statements
from outbox.cli.common import connected, require_schema, transaction
from outbox.cli.output import console, fail

app = typer.Typer(
    help="Manage the outbox schema (tables in the PostgreSQL schema `outbox`) and prune it.",
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


# --- retention ------------------------------------------------------------------------------

_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+)([smhd])")
#: The longest --older-than accepted; far longer would take `now() - interval` out of
#: PostgreSQL's timestamp range, an error instead of an answer.
MAX_OLDER_THAN_S = 36_500 * 86400


def parse_duration(value: str) -> int:
    """Seconds in a duration written as a whole number and a unit: ``30d``, ``12h``, ``90m``,
    ``3600s``. ``ValueError`` naming ``value`` if it is not one, is zero, or exceeds 100 years.
    """
    match = _DURATION.fullmatch(value.strip())
    if match is None:
        raise ValueError(
            f"--older-than {value!r} is not a duration: write a whole number and a unit "
            "(s, m, h or d), such as 30d, 12h, 90m or 3600s"
        )
    seconds = int(match[1]) * _UNIT_SECONDS[match[2]]
    if seconds <= 0:
        raise ValueError(f"--older-than {value!r} must be more than zero")
    if seconds > MAX_OLDER_THAN_S:
        raise ValueError(f"--older-than {value!r} is more than 100 years (36500d)")
    return seconds


def prune_batches(
    engine: Engine, *, older_than_s: float, batch_size: int
) -> Generator[int, None, None]:
    """Delete prunable operations ``batch_size`` at a time, each batch its own transaction;
    yield how many each batch deleted. Stops after the first short batch.

    Stopped between batches (Ctrl-C, a lost connection), the batches already committed stay
    deleted and the rest wait for the next run: a run can be repeated at any time.
    """
    while True:
        with engine.begin() as conn:
            deleted = statements.prune_terminal(conn, older_than_s=older_than_s, limit=batch_size)
        yield deleted
        if deleted < batch_size:
            return


_PRUNED = "with their events and webhook deliveries"


def _operations(count: int) -> str:
    return f"{count} operation" + ("" if count == 1 else "s")


@app.command()
def prune(
    older_than: Annotated[
        str,
        typer.Option(
            "--older-than",
            metavar="DURATION",
            help="Prune operations resolved more than this long ago: 30d, 12h, 90m, 3600s.",
        ),
    ],
    batch_size: Annotated[
        int,
        typer.Option(min=1, max=100_000, help="Operations deleted per transaction."),
    ] = 1000,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Only count what would be pruned; delete nothing.")
    ] = False,
    progress_every: Annotated[
        float,
        typer.Option(min=0, metavar="SECONDS", help="Print the running total at most this often."),
    ] = 5.0,
) -> None:
    """Delete old finished operations, with their events and webhook deliveries.

    Deletes the operations that ended (`confirmed`, `failed` or `cancelled`) more than
    `--older-than` ago, by the database's clock. An operation goes whole: its audit trail
    (events) and its webhook deliveries go with it, never apart from it.

    Kept, whatever their age: every live operation (`planned`, `sent`, `unknown`), every one
    waiting for a person (`needs_human`), and a finished one whose webhook is still pending
    delivery (pruned once it is delivered or abandoned).

    Deletes in batches of `--batch-size`, oldest first, each batch its own short transaction,
    so agents and workers keep running; stopped halfway, it keeps what it deleted and the next
    run carries on; two runs at once skip each other's rows. `--dry-run` only counts.
    Meant for cron, such as a daily `outbox db prune --older-than 30d`.
    """
    try:
        older_than_s = parse_duration(older_than)
    except ValueError as exc:
        fail(str(exc))
    require_schema()
    ago = f"resolved more than {older_than.strip()} ago"
    if dry_run:
        with transaction() as session:
            count = statements.count_prunable(session, older_than_s=older_than_s)
        console.print(
            f"dry run: would prune {_operations(count)} {ago}, {_PRUNED}; deleted nothing"
        )
        return
    total = 0
    last_report = time.monotonic()
    try:
        with connected() as engine:
            for deleted in prune_batches(engine, older_than_s=older_than_s, batch_size=batch_size):
                total += deleted
                more = deleted == batch_size
                if more and time.monotonic() - last_report >= progress_every:
                    console.print(f"pruned {_operations(total)} so far")
                    last_report = time.monotonic()
    except KeyboardInterrupt:
        console.print(f"interrupted: pruned {_operations(total)} {ago}; run it again to carry on")
        raise
    console.print(f"pruned {_operations(total)} {ago}, {_PRUNED}")
