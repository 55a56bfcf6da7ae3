"""``outbox api``: the HTTP API (docs/api.md) on uvicorn, until SIGTERM."""

from __future__ import annotations

import ipaddress
import logging
import socket
from pathlib import Path
from typing import Annotated, Any

import typer

from outbox.cli.common import await_database, require_schema
from outbox.cli.extras import needs_extra
from outbox.cli.options import LogLevel, LogLevelOption, start_logging
from outbox.cli.output import console, fail
from outbox.config import Settings, get_settings, variable
from outbox.logs import Action

log = logging.getLogger(__name__)

_DEFAULTS = Settings.model_fields


def _env(field: str) -> str:
    return variable(field)


def api_command(
    *,
    host: Annotated[
        str,
        typer.Option(
            envvar=_env("api_host"),
            help="Address to bind. A non-loopback one needs --tls-cert/--tls-key or "
            "--behind-proxy.",
        ),
    ] = _DEFAULTS["api_host"].default,
    port: Annotated[
        int,
        typer.Option(envvar=_env("api_port"), min=0, max=65535, help="Port (0: any free one)."),
    ] = _DEFAULTS["api_port"].default,
    behind_proxy: Annotated[
        bool,
        typer.Option(
            "--behind-proxy",
            envvar=_env("api_behind_proxy"),
            help="A reverse proxy terminates TLS: allow a non-loopback address without TLS, "
            "and trust its X-Forwarded-* headers (from OUTBOX_API_FORWARDED_ALLOW_IPS).",
        ),
    ] = False,
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            envvar=_env("api_tls_cert"),
            exists=True,
            dir_okay=False,
            help="PEM certificate: serve HTTPS (with --tls-key).",
        ),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option(
            envvar=_env("api_tls_key"),
            exists=True,
            dir_okay=False,
            help="PEM private key of --tls-cert.",
        ),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            envvar=_env("api_workers"),
            min=1,
            max=64,
            help="Worker processes serving the one socket, each its own interpreter (about "
            "one per core); 1 serves in this process.",
        ),
    ] = _DEFAULTS["api_workers"].default,
    log_level: LogLevelOption = LogLevel.INFO,
) -> None:
    """Serve the HTTP API and the operator console: `/v1/operations` for agents in any
    language and for operators, the console's pages at `/`, `/docs` and `/openapi.json`,
    `/healthz`, `/readyz`, and request metrics on `/metrics`.

    Every `/v1` request needs a bearer token (`outbox tokens create NAME --scope S`); the
    console, an operator account (`outbox operators add NAME`). Binds
    127.0.0.1 by default; any other address is refused unless TLS is configured or
    `--behind-proxy` says a proxy terminates it. With `--workers N`, N processes serve (one
    that dies is started again), sharing request metrics, the sign-in throttle and the
    console's session key. SIGTERM or Ctrl-C exits 0.
    """
    if (tls_cert is None) != (tls_key is None):
        raise typer.BadParameter(
            "goes with --tls-key: give both or neither", param_hint="'--tls-cert'"
        )
    if not (loopback(host) or tls_cert is not None or behind_proxy):
        fail(
            f"refusing to serve the API on {host} without TLS: pass --tls-cert and --tls-key, "
            "or --behind-proxy if a proxy terminates TLS (or bind 127.0.0.1)",
            code=2,
        )
    with needs_extra("api", "api"):
        import uvicorn  # noqa: PLC0415 -- the [api] extra: `outbox --help` must not need it

        from outbox.cli.apiworkers import (  # noqa: PLC0415 -- fastapi, the same extra
            load_configured_tools,
            serve_workers,
        )
        from outbox.web import create_app  # noqa: PLC0415 -- fastapi, the same extra

    start_logging(log_level)
    # Alembic says which dialect it uses on every /readyz probe: nothing an operator needs.
    logging.getLogger("alembic").setLevel(max(logging.WARNING, logging.getLogger().level))
    settings = get_settings()
    # Here too with --workers: a bad tool is one line, now (before waiting for the database).
    load_configured_tools(settings)
    await_database("api")
    require_schema()
    listening = bind_socket(host, port)
    address = listening.getsockname()
    scheme = "https" if tls_cert is not None else "http"
    shown = f"[{address[0]}]" if ":" in address[0] else address[0]
    url = f"{scheme}://{shown}:{address[1]}"
    options: dict[str, Any] = {
        "log_config": None,  # our handler (OUTBOX_LOG_FORMAT) renders uvicorn's lines too
        "access_log": False,  # ours: no query strings, the token's name (outbox.web.observe)
        "server_header": False,
        "proxy_headers": behind_proxy,
        "forwarded_allow_ips": settings.api_forwarded_allow_ips if behind_proxy else None,
        "ssl_certfile": str(tls_cert) if tls_cert else None,
        "ssl_keyfile": str(tls_key) if tls_key else None,
        "timeout_graceful_shutdown": 5,
    }
    console.print(
        f"serving the API on {url} (the console at {url}/, docs at {url}/docs)",
        markup=False,
        highlight=False,
    )
    log.info(
        "serving on %s",
        url,
        extra={"action": Action.API_STARTED, "url": url, "workers": workers},
    )
    if workers == 1:
        uvicorn.Server(uvicorn.Config(create_app(settings), **options)).run(sockets=[listening])
    elif not serve_workers(
        listening,
        workers=workers,
        log_level=log_level,
        settings=settings,
        uvicorn_options=options,
    ):
        fail("an API worker could not start (its error is logged above)")
    log.info("API stopped", extra={"action": Action.API_STOPPED})


def loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (a name other than localhost may be anything)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


_BACKLOG = 2048  # uvicorn's default; it listens again on the same socket with its own


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``, handed to uvicorn: a busy port is one line.

    It listens before the URL is printed, so whoever reads that line can connect at once: the
    kernel queues the connection until uvicorn accepts it. (Bound but not listening, a client
    that was quicker than uvicorn's start-up was refused.)
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listening = socket.socket(family, kind, proto)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(address)
        listening.listen(_BACKLOG)
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}")
    listening.set_inheritable(True)
    return listening
