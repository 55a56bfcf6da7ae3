"""The ``outbox`` command line: one console script, a sub-command per job.

User errors (bad input, wrong state, unreachable database) print one line on stderr and
exit 1; usage errors exit 2. Tracebacks are for bugs only.
"""

from __future__ import annotations

import logging
import sys
from typing import Annotated

import typer

from outbox import __version__
from outbox.cli import db, dev, guards, operators, ops, sagas, tokens, tools, webhooks
from outbox.cli.apiserver import api_command
from outbox.cli.chaos import chaos_command
from outbox.cli.demo import demo_command
from outbox.cli.enqueue import enqueue_command
from outbox.cli.flower import flower_command
from outbox.cli.mcpserver import mcp_command
from outbox.cli.metrics import metrics_command
from outbox.cli.output import PlainFormatter, environment_help, fail
from outbox.cli.services import beat_command, relay_command, worker_command
from outbox.cli.up import up_command
from outbox.db import allow_embedded_start
from outbox.errors import OutboxError

app = typer.Typer(
    name="outbox",
    help=(
        "A durable outbox for the consequential actions of AI agents: each action is recorded "
        "before it is sent, sent once, and looked up (never guessed) when its outcome is lost."
    ),
    epilog=environment_help(),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


def _print_version(value: bool) -> None:
    if value:
        print(f"outbox {__version__}")  # noqa: T201 -- the command's output
        raise typer.Exit


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_print_version, help="Print the version."
        ),
    ] = False,
) -> None:
    """A durable outbox for the consequential actions of AI agents."""
    # The command line is where the embedded PostgreSQL may start (OUTBOX_DATABASE_URL unset):
    # `outbox up`, `outbox demo`, `outbox db upgrade`... never a library call in an agent.
    allow_embedded_start()


app.add_typer(db.app, name="db")
app.add_typer(ops.app, name="ops")
app.add_typer(dev.app, name="dev")
app.add_typer(webhooks.app, name="webhooks")
app.add_typer(tokens.app, name="tokens")
app.add_typer(operators.app, name="operators")
app.add_typer(guards.app, name="guards")
app.add_typer(sagas.app, name="sagas")
app.add_typer(tools.app, name="tools")
app.command("enqueue", no_args_is_help=True)(enqueue_command)
app.command("demo")(demo_command)
app.command("relay")(relay_command)
app.command("worker")(worker_command)
app.command("beat")(beat_command)
app.command("chaos")(chaos_command)
app.command("flower")(flower_command)
app.command("metrics")(metrics_command)
app.command("up")(up_command)
app.command("api")(api_command)
app.command("mcp")(mcp_command)


#: Click's exit code for a usage error (its ``UsageError``, which Typer does not export).
USAGE_ERROR = 2


def one_line(exc: typer.TyperException) -> str:
    """A Click error on one line; a usage error also says where to read how it is used."""
    # Typer checks values with pydantic, whose messages start so; the option is named already.
    message = " ".join(exc.format_message().replace("Value error, ", "").split())
    ctx = getattr(exc, "ctx", None)
    if exc.exit_code == USAGE_ERROR and ctx is not None:
        message += f" (see `{ctx.command_path} --help`)"
    return message


def main() -> None:
    """Entry point of the ``outbox`` console script.

    Click runs outside its standalone mode so that its usage errors (a bad option value, an
    unknown option, a missing argument) print one ``error:`` line like every other error,
    instead of Typer's framed box, and exit 2.
    """
    if logging.lastResort is not None:  # the handler of a process that set up no logging
        logging.lastResort.setFormatter(PlainFormatter())
    command = typer.main.get_command(app)
    try:
        code = command.main(prog_name="outbox", standalone_mode=False)
    except typer.TyperException as exc:  # Click's errors: UsageError (2), the others (1)
        if type(exc).__name__ == "NoArgsIsHelpError":
            sys.exit(USAGE_ERROR)  # the help is printed already, as Typer does
        fail(one_line(exc), code=exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    except OutboxError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
