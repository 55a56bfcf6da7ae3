"""``outbox db embedded status|stop``: the embedded PostgreSQL of OUTBOX_HOME.

The embedded server outlives the process that started it (so the CLI, a relay and workers
share it); these commands say whether it runs and stop it, e.g. after ``outbox demo``.
"""

from __future__ import annotations

from typing import Annotated

import typer

from outbox import embedded
from outbox.cli.output import console, print_json

app = typer.Typer(
    help="The embedded PostgreSQL under OUTBOX_HOME (used when OUTBOX_DATABASE_URL is unset).",
    no_args_is_help=True,
)


def _describe(found: embedded.EmbeddedStatus) -> dict[str, object]:
    # SQLAlchemy's URL parser, imported here: `outbox db --help` lists this group (issue 33).
    from outbox import db  # noqa: PLC0415 -- not for --help

    return {
        "running": found.running,
        "data_dir": str(found.data_dir),
        "pid": found.pid,
        "url": db.redact(found.url) if found.url else None,
    }


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON object.")] = False,
) -> None:
    """Whether OUTBOX_HOME's embedded server runs: its data directory, pid and URL.

    Starts nothing. Exits 0 either way; `--json` for scripts (`running`: true or false).
    """
    from outbox.config import get_settings  # noqa: PLC0415 -- not for --help

    settings = get_settings()
    found = _describe(embedded.status(settings.home))
    if as_json:
        print_json(found)
        return
    state = f"running (pid {found['pid']})" if found["running"] else "not running"
    console.print(f"embedded PostgreSQL: {state}", highlight=False, soft_wrap=True)
    console.print(f"data directory: {found['data_dir']}", highlight=False, soft_wrap=True)
    if found["url"]:
        console.print(f"url: {found['url']}", highlight=False, soft_wrap=True, markup=False)
    if settings.database_url is not None:
        console.print(
            "note: OUTBOX_DATABASE_URL is set, so the outbox does not use this server",
            highlight=False,
            soft_wrap=True,
        )


@app.command()
def stop() -> None:
    """Stop OUTBOX_HOME's embedded server if it runs (its sessions are ended, its data kept).

    The next command that needs it starts it again. Exits 0 if it was not running.
    """
    from outbox.config import get_settings  # noqa: PLC0415 -- not for --help

    before = embedded.stop(get_settings().home)
    if before.running:
        console.print(
            f"stopped the embedded PostgreSQL (pid {before.pid}) in {before.data_dir}",
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print(
            f"the embedded PostgreSQL in {before.data_dir} is not running",
            highlight=False,
            soft_wrap=True,
        )
