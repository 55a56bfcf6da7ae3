"""``outbox enqueue``: record one intent from the shell (scripts, other runtimes, tests)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from outbox.cli.common import transaction
from outbox.cli.extras import needs_extra
from outbox.cli.output import console, print_json


def _read_json(value: str, option: str) -> Any:
    """Parse ``value`` as JSON; ``@path`` reads a file and ``@-`` standard input.

    A value that cannot be read or parsed is a usage error (exit 2) naming the option; what
    the JSON says (a payload that is not an object, say) is the outbox's to refuse (exit 1).
    """
    if value.startswith("@"):
        source = value[1:]
        try:
            value = sys.stdin.read() if source == "-" else Path(source).read_text("utf-8")
        except OSError as exc:
            raise typer.BadParameter(
                f"cannot read {source}: {exc.strerror}", param_hint=f"'{option}'"
            ) from None
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not valid JSON: {exc}", param_hint=f"'{option}'") from None


def _load_configured_tools() -> None:
    """With tools configured (``OUTBOX_TOOLS``, ``OUTBOX_CONFIG``), load them as the workers
    do, so that enqueue refuses a tool none of them registers instead of recording an
    operation no worker can dispatch. Without, any well-formed tool name is accepted."""
    from outbox.config import get_settings  # noqa: PLC0415 -- not for --help

    settings = get_settings()
    if not settings.tools and settings.config is None:
        return
    with needs_extra("worker", "enqueue"):
        from outbox.tools import load_tools  # noqa: PLC0415 -- the [worker] extra

        load_tools(settings)


def enqueue_command(
    *,
    tool: Annotated[str, typer.Option(help="Registered tool name, e.g. deploy.create_release.")],
    target: Annotated[str, typer.Option(help="What the tool acts on, e.g. a project name.")],
    payload: Annotated[
        str, typer.Option(help="The tool's input: a JSON object, @file, or @- for stdin.")
    ],
    key: Annotated[
        str | None,
        typer.Option(
            help="Intent key naming this effect across retries (default: the new id). "
            "The same key with the same input returns the existing operation."
        ),
    ] = None,
    metadata: Annotated[
        str | None, typer.Option(help="A JSON object stored beside the operation.")
    ] = None,
    requested_by: Annotated[
        str | None, typer.Option(help="Who asked for it (an agent or user name).")
    ] = None,
    agent: Annotated[
        str | None,
        typer.Option(
            help="The agent whose intent key it is (default: --requested-by, else the shared "
            "scope): another agent's same key is another operation."
        ),
    ] = None,
    require_approval: Annotated[
        bool,
        typer.Option(
            "--require-approval",
            help="Wait for a person's approval (`outbox ops approve`) before any send.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the operation as JSON.")] = False,
) -> None:
    """Record the intent of one consequential action; the relay will deliver it.

    Prints the operation. Run it again with the same --key and the same input and you get
    the same operation back; the same --key with another tool, target or payload fails with
    an intent key conflict and writes nothing. With OUTBOX_TOOLS or OUTBOX_CONFIG set, the
    tools are loaded first and a tool they do not register is refused. A TRACEPARENT (and
    TRACESTATE) in the environment, a traced script's W3C trace context, is recorded with it.
    """
    from outbox import api, trace_context, tracing  # noqa: PLC0415 -- not for --help

    _load_configured_tools()
    # A traced script's context, in OpenTelemetry's environment carrier (TRACEPARENT,
    # TRACESTATE): recorded with the operation like an agent's current span.
    trace = trace_context.parse(os.environ.get("TRACEPARENT"), os.environ.get("TRACESTATE"))
    # Its outbox.enqueue span, in that trace, when the OTEL_* variables ask for tracing.
    traced = trace is not None and tracing.setup("outbox-cli")
    try:
        with trace_context.passed(trace), transaction() as session:
            op = api.enqueue(
                session,
                tool=tool,
                target=target,
                payload=_read_json(payload, "--payload"),
                intent_key=key,
                metadata=_read_json(metadata, "--metadata") if metadata is not None else None,
                requested_by=requested_by,
                require_approval=require_approval,
                agent=agent,
            )
    finally:
        if traced:
            tracing.shutdown()  # export the span before the process exits
    if as_json:
        print_json(op.to_dict())
        return
    console.print(
        f"[bold]{op.id}[/]  {op.state.value}  {op.tool} -> {op.target}  "
        f"key={op.intent_key}  attempts={op.attempts}",
        highlight=False,
        soft_wrap=True,
    )
