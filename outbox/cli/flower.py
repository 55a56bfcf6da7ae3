"""``outbox flower``: Flower on the outbox's Celery app, local and behind basic auth by default."""

from __future__ import annotations

import importlib
import os
import re
from typing import Annotated

import typer

from outbox.cli.extras import needs_extra
from outbox.cli.output import errors
from outbox.config import get_settings

#: ``user:password``, several separated by commas (Flower's own format).
_CREDENTIALS = re.compile(r"^[^:,\s]+:[^,\s]+(,[^:,\s]+:[^,\s]+)*$")


def flower_command(
    *,
    address: Annotated[
        str, typer.Option(help="Address to bind. Keep it local unless a proxy guards it.")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 5555,
    basic_auth: Annotated[
        str | None,
        typer.Option(
            envvar="OUTBOX_FLOWER_BASIC_AUTH",
            metavar="USER:PASSWORD",
            help="Credentials Flower asks for (several: comma-separated). Prefer the "
            "environment variable: a command line is visible to every local user.",
            show_default=False,
        ),
    ] = None,
    no_auth: Annotated[
        bool,
        typer.Option("--no-auth", help="Serve without authentication (a trusted network only)."),
    ] = False,
    url_prefix: Annotated[
        str | None, typer.Option(help="Serve under this path, behind a reverse proxy.")
    ] = None,
) -> None:
    """Run Flower on the outbox's Celery app: workers, queues and tasks, live.

    Dispatch tasks show their operation id, tool and target as arguments. Flower keeps
    what it saw in memory and forgets it on restart: the outbox table is the truth (`outbox
    ops list`, `outbox ops show ID`). Flower needs RabbitMQ: the database broker carries
    no Celery events or broadcasts, so there it shows neither workers nor tasks; with
    OUTBOX_TASK_EVENTS=false it shows workers and queues but no tasks.

    Basic auth is required unless `--no-auth` is given: set OUTBOX_FLOWER_BASIC_AUTH.
    """
    # Usage errors (exit 2): which of the two is wanted, and credentials Flower can read.
    if basic_auth and no_auth:
        raise typer.BadParameter(
            "contradicts basic auth credentials (--basic-auth or OUTBOX_FLOWER_BASIC_AUTH); "
            "choose one",
            param_hint="'--no-auth'",
        )
    if not basic_auth and not no_auth:
        raise typer.BadParameter(
            "Flower needs credentials: set OUTBOX_FLOWER_BASIC_AUTH=user:password "
            "(or --basic-auth), or pass --no-auth on a trusted network",
            param_hint="'--basic-auth'",
        )
    if basic_auth and not _CREDENTIALS.match(basic_auth):
        # Never echo the value: it is a password.
        raise typer.BadParameter(
            "must look like user:password (comma-separated for several)",
            param_hint="'--basic-auth' / OUTBOX_FLOWER_BASIC_AUTH",
        )
    with needs_extra("flower", "flower"):
        # Celery's `flower` sub-command exists only when the flower package is installed.
        importlib.import_module("flower")
    from outbox.cli.services import celery_app  # noqa: PLC0415 -- needs the [worker] extra

    settings = get_settings()
    if settings.broker_url is None:
        errors.print(
            "warning: the database broker carries no Celery events: Flower will show no "
            "workers or tasks (set OUTBOX_BROKER_URL to RabbitMQ)"
        )
    elif not settings.task_events:
        errors.print(
            "warning: OUTBOX_TASK_EVENTS is off: Flower will list workers and queues but "
            "no tasks (unset it, or set it to true, for the relay and the workers)"
        )
    app = celery_app("flower")
    argv = ["flower", f"--address={address}", f"--port={port}"]
    if url_prefix:
        argv.append(f"--url_prefix={url_prefix}")
    if basic_auth:
        # Through Flower's environment, not its command line, which `ps` shows to everyone.
        os.environ["FLOWER_BASIC_AUTH"] = basic_auth
    else:
        os.environ.pop("FLOWER_BASIC_AUTH", None)
    app.start(argv)
