"""The ``outbox`` command line: one console script, a sub-command per job.

User errors (bad input, wrong state, unreachable database) print one line on stderr and
exit 1; usage errors exit 2. Tracebacks are for bugs only.
"""

from __future__ import annotations

import sys

import typer

from outbox.cli import db, dev, ops, webhooks
from outbox.cli.chaos import chaos_command
from outbox.cli.demo import demo_command
from outbox.cli.enqueue import enqueue_command
from outbox.cli.flower import flower_command
from outbox.cli.metrics import metrics_command
from outbox.cli.output import environment_help, fail
from outbox.cli.services import beat_command, relay_command, worker_command
from outbox.cli.up import up_command
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
app.add_typer(db.app, name="db")
app.add_typer(ops.app, name="ops")
app.add_typer(dev.app, name="dev")
app.add_typer(webhooks.app, name="webhooks")
app.command("enqueue", no_args_is_help=True)(enqueue_command)
app.command("demo")(demo_command)
app.command("relay")(relay_command)
app.command("worker")(worker_command)
app.command("beat")(beat_command)
app.command("chaos")(chaos_command)
app.command("flower")(flower_command)
app.command("metrics")(metrics_command)
app.command("up")(up_command)


def main() -> None:
    """Entry point of the ``outbox`` console script."""
    try:
        app()
    except OutboxError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        sys.exit(130)
