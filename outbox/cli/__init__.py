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
from outbox.cli.epilog import root_epilog
from outbox.cli.lazy import MARKUP_MODE, LazyCommand, lazy_group
from outbox.embedded import allow_start

#: Every top-level command, in the order ``outbox --help`` lists them: its module is imported
#: only when it runs or shows its own help (issue 33: ``outbox --version`` imports none of
#: them). The summaries are the commands' own first paragraphs, which
#: tests/unit/test_cli_startup.py keeps equal.
COMMANDS: dict[str, LazyCommand] = {
    "enqueue": LazyCommand(
        "outbox.cli.enqueue",
        "enqueue_command",
        "Record the intent of one consequential action; the relay will deliver it.",
        {"no_args_is_help": True},
    ),
    "demo": LazyCommand(
        "outbox.cli.demo",
        "demo_command",
        "Watch an agent's releases go through crashes without a duplicate, then check it.",
    ),
    "relay": LazyCommand(
        "outbox.cli.services",
        "relay_command",
        "Publish a dispatch message for every due `planned` operation, until SIGTERM.",
    ),
    "worker": LazyCommand(
        "outbox.cli.services",
        "worker_command",
        "Run a Celery worker on the outbox app: dispatch, lookups, sweeps, escalations.",
    ),
    "beat": LazyCommand(
        "outbox.cli.services",
        "beat_command",
        "Run the schedule: a sweep every OUTBOX_SWEEP_INTERVAL seconds, webhook redelivery.",
    ),
    "chaos": LazyCommand(
        "outbox.cli.chaos",
        "chaos_command",
        "Run the whole stack under random crashes, then judge it by the remote's ledger.",
    ),
    "flower": LazyCommand(
        "outbox.cli.flower",
        "flower_command",
        "Run Flower on the outbox's Celery app: workers, queues and tasks, live.",
    ),
    "metrics": LazyCommand(
        "outbox.cli.metrics",
        "metrics_command",
        "Serve Prometheus metrics on http://HOST:PORT/metrics, until SIGTERM.",
    ),
    "up": LazyCommand(
        "outbox.cli.up",
        "up_command",
        "Run everything on this host: migrations, relay, workers, beat, metrics, the HTTP API "
        "(and Flower, and the MCP server over HTTP with --mcp).",
    ),
    "api": LazyCommand(
        "outbox.cli.apiserver",
        "api_command",
        "Serve the HTTP API and the operator console: `/v1/operations` for agents in any "
        "language and for operators, the console's pages at `/`, `/docs` and `/openapi.json`, "
        "`/healthz`, `/readyz`, and request metrics on `/metrics`.",
    ),
    "mcp": LazyCommand(
        "outbox.cli.mcpserver",
        "mcp_command",
        "Serve the registered tools to agents over MCP (docs/mcp.md).",
    ),
    "db": LazyCommand(
        "outbox.cli.db",
        "app",
        "Manage the outbox schema (tables in the PostgreSQL schema `outbox`) and prune it.",
    ),
    "ops": LazyCommand("outbox.cli.ops", "app", "List, inspect and act on operations."),
    "dev": LazyCommand(
        "outbox.cli.dev",
        "app",
        "Development helpers: the reference remote service for tests, demos and benchmarks.",
    ),
    "webhooks": LazyCommand(
        "outbox.cli.webhooks", "app", "Escalation webhooks and their deliveries."
    ),
    "tokens": LazyCommand(
        "outbox.cli.tokens", "app", "Bearer tokens of the HTTP API (`outbox api`)."
    ),
    "operators": LazyCommand(
        "outbox.cli.operators", "app", "Operator accounts of the console (`outbox api`, at /)."
    ),
    "guards": LazyCommand(
        "outbox.cli.guards",
        "app",
        "Guard rails per tool and target: circuit breakers, rate limits, concurrency caps; "
        "and the budgets' use.",
    ),
    "sagas": LazyCommand(
        "outbox.cli.sagas",
        "app",
        "List and inspect sagas (multi-step actions undone together), and cancel one.",
    ),
    "tools": LazyCommand(
        "outbox.cli.tools",
        "app",
        "The tools' contracts as this deployment publishes them (what enqueue checks).",
    ),
}

app = typer.Typer(
    name="outbox",
    help=(
        "A durable outbox for the consequential actions of AI agents: each action is recorded "
        "before it is sent, sent once, and looked up (never guessed) when its outcome is lost."
    ),
    epilog=root_epilog(),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=MARKUP_MODE,
    cls=lazy_group(COMMANDS),
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
    allow_start()


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
    # Imported here: `fail` brings rich's console, which `--version` does without (issue 33).
    from outbox.cli.output import PlainFormatter, fail  # noqa: PLC0415 -- not for --version
    from outbox.errors import OutboxError  # noqa: PLC0415 -- not for --version

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
