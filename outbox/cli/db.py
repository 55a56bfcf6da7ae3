"""``outbox db``: create and upgrade the schema, print its DDL, check it is current, prune."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Annotated

import typer

from outbox.cli import embedded
from outbox.cli.common import connected, require_schema, transaction
from outbox.cli.output import console
from outbox.errors import ConfigError

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from outbox.sql.retention import DedupWindows, PruneCount


app = typer.Typer(
    help="Manage the outbox schema (tables in the PostgreSQL schema `outbox`) and prune it.",
    no_args_is_help=True,
)

app.add_typer(embedded.app, name="embedded")


@app.command()
def upgrade() -> None:
    """Create or upgrade the `outbox` schema to the latest revision.

    Safe to run from several processes at once: an advisory lock serialises them, and every
    one of them succeeds. Touches nothing outside the `outbox` schema.
    """
    from outbox import migrate  # noqa: PLC0415 -- not for --help

    with connected() as engine:
        before = migrate.current(engine)
        migrate.upgrade(engine)
        after = migrate.current(engine)
    if before == after:
        console.print(f"schema already at {after} (head)")
    else:
        console.print(f"schema upgraded from {before or 'empty'} to {after}")


@app.command("sql")
def sql_command() -> None:
    """Print the DDL that creates the schema from empty, without connecting (for DBAs)."""
    from outbox import migrate  # noqa: PLC0415 -- not for --help

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


def parse_duration(value: str, option: str = "--older-than") -> int:
    """Seconds in a duration written as a whole number and a unit: ``30d``, ``12h``, ``90m``,
    ``3600s``. ``ValueError`` naming ``value`` if it is not one, is zero, or exceeds 100 years.
    """
    match = _DURATION.fullmatch(value.strip())
    if match is None:
        raise ValueError(
            f"{option} {value!r} is not a duration: write a whole number and a unit "
            "(s, m, h or d), such as 30d, 12h, 90m or 3600s"
        )
    seconds = int(match[1]) * _UNIT_SECONDS[match[2]]
    if seconds <= 0:
        raise ValueError(f"{option} {value!r} must be more than zero")
    if seconds > MAX_OLDER_THAN_S:
        raise ValueError(f"{option} {value!r} is more than 100 years (36500d)")
    return seconds


def _duration(value: str | None) -> str | None:
    """Option callback: a bad duration is a usage error (exit 2), before anything connects."""
    if value is not None:
        try:
            parse_duration(value, option="")  # Click names the option itself
        except ValueError as exc:
            raise typer.BadParameter(str(exc).strip()) from None
    return value


def dedup_windows() -> DedupWindows:
    """The registered tools' dedup windows (``OUTBOX_TOOLS``, ``OUTBOX_CONFIG``): prune keeps
    an operation inside its tool's window, and every operation of a tool not registered."""
    from outbox.contracts import CONTRACTS  # noqa: PLC0415 -- not for --help
    from outbox.sql.retention import DedupWindows  # noqa: PLC0415 -- not for --help

    # Deferred: the CLI sits above the workers layer and imports it only where needed.
    from outbox.tools import load_tools  # noqa: PLC0415 -- not for --help

    try:
        load_tools()
    except ConfigError as exc:
        raise ConfigError(f"cannot load the tools to learn their dedup windows: {exc}") from exc
    windows: dict[str, float | None] = {}
    for name in CONTRACTS.names():
        contract = CONTRACTS.get(name)
        if contract is not None:
            windows[name] = contract.dedup.window_s if contract.dedup is not None else None
    return DedupWindows(windows)


def prune_batches(
    engine: Engine, *, older_than_s: float, batch_size: int, windows: DedupWindows
) -> Generator[int, None, None]:
    """Delete prunable operations ``batch_size`` at a time, each batch its own transaction;
    yield how many each batch deleted. Stops after the first short batch.

    Stopped between batches (Ctrl-C, a lost connection), the batches already committed stay
    deleted and the rest wait for the next run: a run can be repeated at any time.
    """
    from outbox.sql import retention  # noqa: PLC0415 -- not for --help

    while True:
        with engine.begin() as conn:
            deleted = retention.prune_terminal(
                conn, older_than_s=older_than_s, limit=batch_size, windows=windows
            )
        yield deleted
        if deleted < batch_size:
            return


_PRUNED = "with their events and webhook deliveries; their intents are remembered"


def _kept(count: PruneCount) -> list[str]:
    """One line per reason some old finished operations were kept."""
    lines = []
    if count.in_window:
        lines.append(
            f"kept {_operations(count.in_window)} inside their tool's dedup window "
            "(the remote still remembers the key)"
        )
    if count.unknown_tool:
        lines.append(
            f"kept {_operations(count.unknown_tool)} of tools not registered here, whose dedup "
            "window is unknown (set OUTBOX_TOOLS / OUTBOX_CONFIG as the workers do)"
        )
    if count.webhook_pending:
        lines.append(
            f"kept {_operations(count.webhook_pending)} whose webhook is still pending delivery"
        )
    return lines


def _operations(count: int) -> str:
    return f"{count} operation" + ("" if count == 1 else "s")


@app.command()
def prune(
    older_than: Annotated[
        str,
        typer.Option(
            "--older-than",
            metavar="DURATION",
            callback=_duration,
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
    forget_intents_older_than: Annotated[
        str | None,
        typer.Option(
            "--forget-intents-older-than",
            metavar="DURATION",
            callback=_duration,
            help="Also forget pruned intents whose operation ended more than this long ago: "
            "their keys can then be enqueued anew (default: remember them forever).",
        ),
    ] = None,
) -> None:
    """Delete old finished operations, with their events and webhook deliveries.

    Deletes the operations that ended (`confirmed`, `failed` or `cancelled`) more than
    `--older-than` ago, by the database's clock. An operation goes whole: its audit trail
    (events) and its webhook deliveries go with it, never apart from it. What identifies it
    (intent key, tool, target, payload hash, final state, remote_ref) stays in
    `outbox.pruned_intents`, so enqueueing the same intent again raises IntentAlreadyDone
    instead of doing it twice.

    Kept, whatever their age: every live operation (`planned`, `sent`, `unknown`), every one
    waiting for a person (`needs_human`), a finished one whose webhook is still pending
    delivery (pruned once it is delivered or abandoned), one whose tool's dedup window
    (from its first send) is still open, and one whose tool is not registered here (load
    the tools as the workers do: OUTBOX_TOOLS, OUTBOX_CONFIG). The output says how many
    were kept and why.

    Deletes in batches of `--batch-size`, oldest first, each batch its own short transaction,
    so agents and workers keep running; stopped halfway, it keeps what it deleted and the next
    run carries on; two runs at once skip each other's rows. `--dry-run` only counts.
    Meant for cron, such as a daily `outbox db prune --older-than 30d`.
    """
    from outbox.sql import retention  # noqa: PLC0415 -- not for --help

    older_than_s = parse_duration(older_than)
    forget_s = (
        parse_duration(forget_intents_older_than, "--forget-intents-older-than")
        if forget_intents_older_than is not None
        else None
    )
    require_schema()
    windows = dedup_windows()
    ago = f"resolved more than {older_than.strip()} ago"
    with transaction() as session:
        count = retention.count_prunable(session, older_than_s=older_than_s, windows=windows)
    if dry_run:
        console.print(
            f"dry run: would prune {_operations(count.prunable)} {ago}, {_PRUNED}; deleted nothing"
        )
        for line in _kept(count):
            console.print(line)
        return
    total = 0
    last_report = time.monotonic()
    try:
        with connected() as engine:
            for deleted in prune_batches(
                engine, older_than_s=older_than_s, batch_size=batch_size, windows=windows
            ):
                total += deleted
                more = deleted == batch_size
                if more and time.monotonic() - last_report >= progress_every:
                    console.print(f"pruned {_operations(total)} so far")
                    last_report = time.monotonic()
            forgotten = (
                _forget(engine, older_than_s=forget_s, batch_size=batch_size)
                if forget_s is not None
                else None
            )
    except KeyboardInterrupt:
        console.print(f"interrupted: pruned {_operations(total)} {ago}; run it again to carry on")
        raise
    console.print(f"pruned {_operations(total)} {ago}, {_PRUNED}")
    for line in _kept(count):
        console.print(line)
    if forgotten is not None:
        console.print(
            f"forgot {forgotten} pruned intent{'' if forgotten == 1 else 's'} whose operation "
            f"ended more than {str(forget_intents_older_than).strip()} ago"
        )


def _forget(engine: Engine, *, older_than_s: float, batch_size: int) -> int:
    """Forget old pruned intents in batches, each its own transaction; how many went."""
    from outbox.sql import retention  # noqa: PLC0415 -- not for --help

    total = 0
    while True:
        with engine.begin() as conn:
            gone = retention.forget_pruned_intents(
                conn, older_than_s=older_than_s, limit=batch_size
            )
        total += gone
        if gone < batch_size:
            return total
