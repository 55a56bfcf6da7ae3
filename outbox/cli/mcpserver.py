"""``outbox mcp``: the registered tools as an MCP server, on stdio or streamable HTTP."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from outbox.cli.common import await_database, require_schema
from outbox.cli.extras import needs_extra
from outbox.cli.options import LogLevel, LogLevelOption, start_logging
from outbox.cli.output import console, fail
from outbox.config import Settings, variable
from outbox.logs import Action

if TYPE_CHECKING:  # the [mcp] extra, imported by mcp_command
    from outbox.mcp import McpContext

log = logging.getLogger(__name__)

_DEFAULTS = Settings.model_fields


def mcp_command(
    *,
    http: Annotated[
        bool,
        typer.Option(
            "--http",
            help="Serve streamable HTTP at /mcp (bearer tokens of the agent scope) instead of "
            "one client on stdin/stdout.",
        ),
    ] = False,
    host: Annotated[
        str,
        typer.Option(
            envvar=variable("mcp_host"),
            help="--http: address to bind. A non-loopback one needs --tls-cert/--tls-key or "
            "--behind-proxy.",
        ),
    ] = _DEFAULTS["mcp_host"].default,
    port: Annotated[
        int,
        typer.Option(
            envvar=variable("mcp_port"), min=0, max=65535, help="--http: port (0: any free one)."
        ),
    ] = _DEFAULTS["mcp_port"].default,
    behind_proxy: Annotated[
        bool,
        typer.Option(
            "--behind-proxy",
            envvar=variable("api_behind_proxy"),
            help="--http: a reverse proxy terminates TLS: allow a non-loopback address "
            "without TLS, and trust its X-Forwarded-* headers (OUTBOX_API_FORWARDED_ALLOW_IPS).",
        ),
    ] = False,
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            envvar=variable("api_tls_cert"),
            exists=True,
            dir_okay=False,
            help="--http: PEM certificate: serve HTTPS (with --tls-key).",
        ),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option(
            envvar=variable("api_tls_key"),
            exists=True,
            dir_okay=False,
            help="--http: PEM private key of --tls-cert.",
        ),
    ] = None,
    log_level: LogLevelOption = LogLevel.INFO,
) -> None:
    """Serve the registered tools to agents over MCP (docs/mcp.md).

    Every tool of OUTBOX_CONFIG / OUTBOX_TOOLS (as the workers load them) is an MCP tool
    whose arguments are the intent: a required `intent_key` (the same on every retry of one
    action), `target` and `payload` (the tool's `input_schema`). A call records the intent,
    committed, then waits up to OUTBOX_MCP_WAIT_S for the outcome and answers what happened;
    the same key and input again is the same operation, never a second effect. Also
    `outbox_status`, `outbox_list` and the resources `outbox://operations/{id}`.

    Without --http: one client on stdin/stdout (a desktop agent spawns this command); the
    caller is OUTBOX_MCP_AGENT. With --http: streamable HTTP at `/mcp`, each request with
    `Authorization: Bearer <token>` of the agent scope (`outbox tokens create NAME --scope
    agent`), whose name is the caller; 127.0.0.1 by default, any other address refused
    unless TLS is configured or `--behind-proxy`. SIGTERM or Ctrl-C exits 0.
    """
    from outbox import tracing  # noqa: PLC0415 -- not for --help
    from outbox.cli.apiserver import bind_socket  # noqa: PLC0415 -- not for --help
    from outbox.config import get_settings  # noqa: PLC0415 -- not for --help
    from outbox.contracts import CONTRACTS  # noqa: PLC0415 -- not for --help
    from outbox.db import create_async_engine, database_url  # noqa: PLC0415 -- not for --help

    if http:
        _check_address(host, tls_cert, tls_key, behind_proxy=behind_proxy)
    with needs_extra("mcp", "mcp"):
        import uvicorn  # noqa: PLC0415 -- the [mcp] extra: `outbox --help` must not need it

        from outbox.mcp import McpContext, http_app, serve_stdio  # noqa: PLC0415 -- the same

    start_logging(log_level)
    logging.getLogger("alembic").setLevel(max(logging.WARNING, logging.getLogger().level))
    # The SDK's debug lines may carry messages, hence payloads: never logged (CONTRIBUTING.md).
    logging.getLogger("mcp").setLevel(max(logging.INFO, logging.getLogger().level))
    settings = get_settings()
    _load_tools(settings)  # a configuration error is one line now, not after the wait
    await_database("mcp")
    require_schema()
    # Enqueue spans, when the OTEL_* variables (or OUTBOX_OTEL) ask for tracing (the MCP SDK
    # makes the tools/call spans itself); SQLAlchemy's per statement with OUTBOX_OTEL_SQL=1.
    tracing.setup("outbox-mcp", instrument=("sqlalchemy",))
    engine = create_async_engine(database_url(settings), pool_size=5, max_overflow=10)
    context = McpContext(
        engine=engine, contracts=CONTRACTS, wait_s=settings.mcp_wait_s, agent=settings.mcp_agent
    )
    tools = ",".join(CONTRACTS.names())
    if not http:
        log.info(
            "serving MCP on stdio as %s",
            settings.mcp_agent,
            extra={"action": Action.MCP_STARTED, "transport": "stdio", "tools": tools},
        )
        asyncio.run(_until_closed(context, serve_stdio(context)))
        log.info("MCP stopped", extra={"action": Action.MCP_STOPPED})
        return
    listening = bind_socket(host, port)
    url = _url(listening, https=tls_cert is not None)
    config = uvicorn.Config(
        http_app(context, host=host, behind_proxy=behind_proxy),
        log_config=None,  # our handler (OUTBOX_LOG_FORMAT) renders uvicorn's lines too
        access_log=False,  # no query strings or tokens in the logs
        server_header=False,
        proxy_headers=behind_proxy,
        forwarded_allow_ips=settings.api_forwarded_allow_ips if behind_proxy else None,
        ssl_certfile=str(tls_cert) if tls_cert else None,
        ssl_keyfile=str(tls_key) if tls_key else None,
        timeout_graceful_shutdown=5,
    )
    console.print(f"serving MCP on {url}/mcp", markup=False, highlight=False)
    log.info(
        "serving MCP on %s/mcp",
        url,
        extra={"action": Action.MCP_STARTED, "transport": "http", "url": url, "tools": tools},
    )
    server = uvicorn.Server(config)
    asyncio.run(_until_closed(context, server.serve(sockets=[listening])))
    log.info("MCP stopped", extra={"action": Action.MCP_STOPPED})


def _check_address(
    host: str, tls_cert: Path | None, tls_key: Path | None, *, behind_proxy: bool
) -> None:
    """The rules of `outbox api`: TLS in pairs; a public address only with TLS or a proxy."""
    from outbox.cli.apiserver import loopback  # noqa: PLC0415 -- not for --help

    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter(
            "goes with --tls-key: give both or neither", param_hint="'--tls-cert'"
        )
    if not (loopback(host) or tls_cert is not None or behind_proxy):
        fail(
            f"refusing to serve MCP on {host} without TLS: pass --tls-cert and --tls-key, "
            "or --behind-proxy if a proxy terminates TLS (or bind 127.0.0.1)",
            code=2,
        )


async def _until_closed(context: McpContext, serving: Coroutine[Any, Any, None]) -> None:
    """Run ``serving``, then close the waits' listener and the engine on the same loop."""
    from outbox import aio, tracing  # noqa: PLC0415 -- not for --help

    try:
        await serving
    finally:
        await aio.close()
        await context.engine.dispose()
        tracing.shutdown()  # export what is buffered


def _url(listening: socket.socket, *, https: bool) -> str:
    address = listening.getsockname()
    shown = f"[{address[0]}]" if ":" in address[0] else address[0]
    return f"{'https' if https else 'http'}://{shown}:{address[1]}"


def _load_tools(settings: Settings) -> None:
    """Load the tools the server offers (those OUTBOX_CONFIG and OUTBOX_TOOLS name, as the
    workers load them); none named is a one-line error: an MCP server with no tools is a
    mistake in its configuration."""
    if settings.config is None and not settings.tools:
        fail(
            "outbox mcp serves the registered tools: set OUTBOX_CONFIG (a TOML file of HTTP "
            "tools) or OUTBOX_TOOLS (modules that register tools), as for `outbox worker`"
        )
    with needs_extra("worker", "mcp"):
        from outbox.tools import load_tools  # noqa: PLC0415 -- the tools layer, as `outbox api`

    load_tools(settings)
