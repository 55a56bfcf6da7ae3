"""Connections: which database, one engine per URL, and errors translated at the seam."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

import psycopg.errors
import sqlalchemy
from sqlalchemy import Engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import DBAPIError, OperationalError, ProgrammingError
from sqlalchemy.ext import asyncio as sqlalchemy_asyncio
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import ConnectionPoolEntry, NullPool, PoolResetState

from outbox import embedded, urls
from outbox.backoff import Backoff
from outbox.config import Settings, get_settings
from outbox.errors import DatabaseUnavailable, SchemaNotReady
from outbox.locks import SESSION_LOCKS_INFO
from outbox.logs import Action, describe_error
from outbox.sql.locks import UNLOCK_ALL_SQL

log = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    """``url`` with the psycopg 3 driver, whichever PostgreSQL spelling it came in
    (:func:`outbox.urls.sqlalchemy_url`)."""
    return urls.sqlalchemy_url(url)


def redact(url: str) -> str:
    """``url`` with its password masked: the only form of a URL that may be printed or logged."""
    return make_url(url).render_as_string(hide_password=True)


def allow_embedded_start() -> None:
    """Let :func:`database_url` start the embedded PostgreSQL in this process when
    ``OUTBOX_DATABASE_URL`` is unset (the ``outbox`` command and its Celery app call it;
    :func:`outbox.embedded.allow_start`, which the command line calls without this module)."""
    embedded.allow_start()


def database_url(settings: Settings | None = None) -> str:
    """The configured database URL; else the embedded server's: started if this process may
    (:func:`allow_embedded_start`: the command line), else only if it runs already (``outbox
    up``, ``outbox demo`` or ``outbox db upgrade`` started it). Otherwise raises
    :class:`DatabaseUnavailable` naming ``OUTBOX_DATABASE_URL``, starting nothing."""
    settings = settings or get_settings()
    if settings.database_url is not None:
        return normalize_url(settings.database_url.get_secret_value())
    if embedded.start_allowed():
        return embedded.ensure_running(settings.home)
    running = embedded.running_url(settings.home)
    if running is None:
        raise DatabaseUnavailable(
            "OUTBOX_DATABASE_URL is not set and no embedded PostgreSQL runs under "
            f"{settings.home} (OUTBOX_HOME): set OUTBOX_DATABASE_URL (or pass an engine), or "
            "start the embedded server with `outbox up` or `outbox db upgrade`; a library "
            "call never starts one"
        )
    return running


#: libpq's TCP settings that bound how long a connection to a silent server (a network
#: partition, a host gone without a reset) takes to fail: about a minute, where the kernel's
#: defaults wait two hours, a worker or relay stuck all that time on a query in flight. A live
#: server's kernel answers keepalives, so a long query is never cut. A URL that names any of
#: them keeps its own value; libpq ignores them on a Unix socket (the embedded server).
TCP_LIVENESS: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,  # ms: sent data left unacknowledged this long fails the connection
}


def _with_defaults(url: str, options: dict[str, object]) -> str:
    """``url`` normalized, and ``options`` given the outbox's defaults (in place)."""
    url = normalize_url(url)
    options.setdefault("pool_pre_ping", True)
    options["hide_parameters"] = True
    given = make_url(url).query
    given_args = options.get("connect_args")
    connect_args: dict[str, object] = dict(given_args) if isinstance(given_args, Mapping) else {}
    for name, value in TCP_LIVENESS.items():
        if name not in given:
            connect_args.setdefault(name, value)
    options["connect_args"] = connect_args
    return url


def create_engine(url: str, **options: object) -> Engine:
    """An engine on ``url`` with the outbox's defaults (psycopg 3, pre-ping unless told,
    :data:`TCP_LIVENESS` unless the URL or ``connect_args`` say otherwise).

    Its errors never carry bound parameters (``hide_parameters``, whatever ``options`` say):
    a ``DBAPIError`` logged by a task would otherwise print payloads, intent keys, results
    and remote answers next to the statement.
    """
    engine = sqlalchemy.create_engine(_with_defaults(url, options), **options)
    event.listen(engine, "reset", _release_session_locks)
    return engine


def create_async_engine(url: str, **options: object) -> AsyncEngine:
    """An asyncio engine on ``url`` (psycopg 3's async driver) with the defaults of
    :func:`create_engine`: what :mod:`outbox.aio` takes, for an agent that has none of its own.

    There is no process-wide one like :func:`get_engine`: an async engine's pooled connections
    belong to the event loop that opened them, so each loop (each ``asyncio.run``) needs its
    own engine, disposed before the loop ends.
    """
    # Through the module: an instrumentation that wraps it (OUTBOX_OTEL_SQL) sees the call.
    engine = sqlalchemy_asyncio.create_async_engine(_with_defaults(url, options), **options)
    event.listen(engine.sync_engine, "reset", _release_session_locks)
    return engine


def _release_session_locks(
    dbapi_connection: DBAPIConnection,
    record: ConnectionPoolEntry | None,
    state: PoolResetState,
) -> None:
    """Release the session advisory locks of a connection going back to the pool, if it may
    hold any (:data:`outbox.locks.SESSION_LOCKS_INFO`).

    A rollback releases none, so a lock left by a step that failed after it was granted would
    stay with the pooled connection: its operation would read "lock busy" until that
    connection's next user, and a sweep drawing it would take the lock again re-entrantly.
    Only connections so marked pay the round trip, and the lock holders' own unlock removes
    the mark: the dispatcher's checkins cost nothing more. If this fails, SQLAlchemy
    invalidates the connection (the server then drops its locks with it).
    """
    if record is None or not record.info.pop(SESSION_LOCKS_INFO, False):
        return
    if state.terminate_only or not state.asyncio_safe:
        return  # closed or dropped, not pooled: the server frees its locks
    dbapi_connection.rollback()  # out of a failed transaction, if any
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(UNLOCK_ALL_SQL)
    finally:
        cursor.close()
    dbapi_connection.rollback()


@functools.cache
def _engine_for(url: str) -> Engine:
    return create_engine(url)


def get_engine(url: str | None = None) -> Engine:
    """The process-wide engine for ``url`` (default: :func:`database_url`)."""
    return _engine_for(url or database_url())


#: What PostgreSQL says when the outbox's schema is missing, or older than this code: a
#: table, function, column or schema of ours that is not there.
_SCHEMA_MISSING = (
    psycopg.errors.UndefinedTable,
    psycopg.errors.UndefinedFunction,
    psycopg.errors.UndefinedColumn,
    psycopg.errors.InvalidSchemaName,
)


@contextmanager
def database_errors(url: str | None = None) -> Iterator[None]:
    """Turn driver errors that a user can fix into the outbox's typed errors:
    :class:`DatabaseUnavailable` (cannot connect, or the connection was lost) and
    :class:`SchemaNotReady` (a table, function or column of the outbox is missing: not
    migrated, or not to this release's revision). ``url`` names the database in the message."""
    where = f"at {redact(url)}" if url is not None else ""
    try:
        yield
    except OperationalError as exc:
        if exc.connection_invalidated or _is_connect_error(exc):
            raise DatabaseUnavailable(
                f"cannot reach the database{' ' + where if where else ''}: {_first_line(exc.orig)}"
            ) from exc
        raise
    except ProgrammingError as exc:
        if isinstance(exc.orig, _SCHEMA_MISSING):
            raise SchemaNotReady(
                f"the outbox schema is missing or out of date in "
                f"{redact(url) if url is not None else 'this database'} "
                f"({_first_line(exc.orig)}); run `outbox db upgrade`"
            ) from exc
        raise


P = ParamSpec("P")
R = TypeVar("R")


def translated(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` raising :func:`database_errors`' typed errors: the seam of the agent API
    (``enqueue``, ``get``, ``wait``, sagas...), where a database without the schema would
    otherwise surface as a driver's ``ProgrammingError``."""

    @functools.wraps(function)
    def with_typed_errors(*args: P.args, **kwargs: P.kwargs) -> R:
        with database_errors():
            return function(*args, **kwargs)

    return with_typed_errors


def _is_connect_error(exc: DBAPIError) -> bool:
    # psycopg raises a bare OperationalError when the connection cannot be established.
    return type(exc.orig) is psycopg.OperationalError


def _first_line(error: BaseException | None) -> str:
    return str(error).strip().splitlines()[0] if error is not None and str(error).strip() else ""


#: What a lost or refused database connection raises, whichever layer meets it first.
DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    DBAPIError,
    psycopg.Error,
    DatabaseUnavailable,
)


def is_database_error(error: BaseException) -> bool:
    """Whether ``error`` came from the database (:data:`DATABASE_ERRORS`): logged as one
    line (:func:`outbox.logs.describe_error`), never with its statement or a traceback."""
    return isinstance(error, DATABASE_ERRORS)


#: Seconds between tries to reach the database at start-up: doubling from the first, capped.
START_BACKOFF_S = (0.5, 10.0)
#: libpq's limit on one try (a silent host would otherwise hold a try for minutes).
START_CONNECT_TIMEOUT_S = 10


def wait_for_database(url: str, *, timeout_s: float, component: str) -> None:
    """Return once the database at ``url`` accepts a connection, trying again with backoff
    while it is unreachable or refuses (``the database system is starting up``).

    Every component calls it before its first statement (``outbox.cli.common``): one
    ``db_waiting`` line per failed try (its error class and one-line message, the next
    wait), one ``db_ready`` line when connected. After ``timeout_s``
    (``OUTBOX_DB_START_TIMEOUT``; 0 tries once) it raises :class:`DatabaseUnavailable`
    with the last error, which the command prints as one line before exiting 1.
    """
    deadline = time.monotonic() + timeout_s
    backoff = Backoff(base_s=START_BACKOFF_S[0], max_s=START_BACKOFF_S[1])
    tries = 0
    while True:
        tries += 1
        error = _connect_error(url)
        if error is None:
            log.info(
                "%s: the database accepts connections (try %d)",
                component,
                tries,
                extra={"action": Action.DB_READY, "component": component, "tries": tries},
            )
            return
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise DatabaseUnavailable(
                f"{component}: gave up waiting for the database at {redact(url)} after "
                f"{tries} tries in {timeout_s:g}s (OUTBOX_DB_START_TIMEOUT): {error}"
            )
        wait_s = min(backoff.next_s(), left_s)
        log.warning(
            "%s: waiting for the database (try %d failed, next in %.1fs)",
            component,
            tries,
            wait_s,
            extra={
                "action": Action.DB_WAITING,
                "component": component,
                "tries": tries,
                "error": error,
                "retry_in_s": round(wait_s, 2),
            },
        )
        time.sleep(wait_s)


def _connect_error(url: str) -> str | None:
    """Why a new connection to ``url`` fails now (:func:`describe_error`), or ``None``."""
    probe = create_engine(
        url, poolclass=NullPool, connect_args={"connect_timeout": START_CONNECT_TIMEOUT_S}
    )
    try:
        with probe.connect():
            return None
    except DBAPIError as exc:
        if isinstance(exc, OperationalError) or _is_connect_error(exc):
            return describe_error(exc)
        raise
    finally:
        probe.dispose()
