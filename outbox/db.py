"""Connections: which database, one engine per URL, and errors translated at the seam."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg.errors
import sqlalchemy
from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError

from outbox import embedded
from outbox.config import Settings, get_settings
from outbox.errors import DatabaseUnavailable, SchemaNotReady

_DRIVER = "postgresql+psycopg"


def normalize_url(url: str) -> str:
    """``url`` with the psycopg 3 driver, whichever PostgreSQL spelling it came in."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        raise DatabaseUnavailable(
            f"OUTBOX_DATABASE_URL must be a PostgreSQL URL, not {parsed.drivername}://"
        )
    return parsed.set(drivername=_DRIVER).render_as_string(hide_password=False)


def redact(url: str) -> str:
    """``url`` with its password masked: the only form of a URL that may be printed or logged."""
    return make_url(url).render_as_string(hide_password=True)


def database_url(settings: Settings | None = None) -> str:
    """The configured database URL, or the embedded server's (started if needed)."""
    settings = settings or get_settings()
    if settings.database_url is not None:
        return normalize_url(settings.database_url.get_secret_value())
    return embedded.ensure_running(settings.home)


def create_engine(url: str, **options: object) -> Engine:
    """An engine on ``url`` with the outbox's defaults (psycopg 3, pre-ping unless told).

    Its errors never carry bound parameters (``hide_parameters``, whatever ``options`` say):
    a ``DBAPIError`` logged by a task would otherwise print payloads, intent keys, results
    and remote answers next to the statement.
    """
    options.setdefault("pool_pre_ping", True)
    options["hide_parameters"] = True
    return sqlalchemy.create_engine(normalize_url(url), **options)


@functools.cache
def _engine_for(url: str) -> Engine:
    return create_engine(url)


def get_engine(url: str | None = None) -> Engine:
    """The process-wide engine for ``url`` (default: :func:`database_url`)."""
    return _engine_for(url or database_url())


@contextmanager
def database_errors(url: str) -> Iterator[None]:
    """Turn driver errors that a user can fix into the outbox's typed errors."""
    try:
        yield
    except OperationalError as exc:
        if exc.connection_invalidated or _is_connect_error(exc):
            raise DatabaseUnavailable(
                f"cannot reach the database at {redact(url)}: {_first_line(exc.orig)}"
            ) from exc
        raise
    except ProgrammingError as exc:
        if isinstance(exc.orig, psycopg.errors.UndefinedTable | psycopg.errors.InvalidSchemaName):
            raise SchemaNotReady(
                f"the outbox schema is missing in {redact(url)}; run `outbox db upgrade`"
            ) from exc
        raise


def _is_connect_error(exc: DBAPIError) -> bool:
    # psycopg raises a bare OperationalError when the connection cannot be established.
    return type(exc.orig) is psycopg.OperationalError


def _first_line(error: BaseException | None) -> str:
    return str(error).strip().splitlines()[0] if error is not None and str(error).strip() else ""
