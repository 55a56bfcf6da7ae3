"""Database URLs: every PostgreSQL spelling the outbox accepts, and one conversion to the form
each consumer needs.

The outbox takes ``postgresql://``, ``postgres://`` and ``postgresql+psycopg://`` (any
SQLAlchemy PostgreSQL driver name, in fact) alike, over TCP or a Unix socket directory given as
``?host=/path`` (the embedded server's URLs), with or without a password. From any of them:

* :func:`sqlalchemy_url`: ``postgresql+psycopg://…``, for SQLAlchemy (what
  :func:`outbox.db.create_engine` connects with);
* :func:`libpq_url`: ``postgresql://…`` as libpq parses it, for psycopg, ``psql`` and
  LangGraph's ``PostgresSaver`` / ``AsyncPostgresSaver``: the same server, database, user,
  password and options as the engine's (:func:`connect_params`).
"""

from __future__ import annotations

import re
from urllib.parse import quote

from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from outbox.errors import DatabaseUnavailable

#: SQLAlchemy's name for PostgreSQL over psycopg 3, the outbox's one driver.
SQLALCHEMY_DRIVER = "postgresql+psycopg"

#: The backend names SQLAlchemy reads from a PostgreSQL URL's scheme (``postgres`` is
#: Heroku's and libpq's alias).
_BACKENDS = frozenset({"postgresql", "postgres"})

#: A host libpq reads in a URL's authority as written: a name, an IPv4 or a bare IPv6 address.
#: Anything else (a socket directory, a list of hosts) goes in the query, where any value may be.
_PLAIN_HOST = re.compile(r"[A-Za-z0-9._-]+|[0-9A-Fa-f:.]+")

_DIALECT = PGDialect_psycopg()  # type: ignore[no-untyped-call]  # untyped in SQLAlchemy


def parse(url: str) -> URL:
    """``url`` parsed, with the psycopg 3 driver whichever PostgreSQL spelling it came in.

    Raises :class:`DatabaseUnavailable` (naming the scheme, never the URL: it may hold a
    password) for a string that is not a URL or names another database.
    """
    try:
        parsed = make_url(url)
    except ArgumentError:
        # ``from None``: SQLAlchemy's message quotes the whole string, password included.
        raise DatabaseUnavailable(
            "OUTBOX_DATABASE_URL is not a URL: expected postgresql://user:password@host/database"
        ) from None
    if parsed.get_backend_name() not in _BACKENDS:
        raise DatabaseUnavailable(
            f"OUTBOX_DATABASE_URL must be a PostgreSQL URL (postgresql://, postgres:// or "
            f"postgresql+psycopg://), not {parsed.drivername}://"
        )
    return parsed.set(drivername=SQLALCHEMY_DRIVER)


def sqlalchemy_url(url: str) -> str:
    """``url`` as SQLAlchemy connects with it: ``postgresql+psycopg://…``."""
    return parse(url).render_as_string(hide_password=False)


def connect_params(url: str) -> dict[str, str]:
    """The libpq parameters (``host``, ``port``, ``dbname``, ``user``, ``password``, and the
    URL's options) that SQLAlchemy's psycopg dialect connects with for ``url``."""
    _, params = _DIALECT.create_connect_args(parse(url))  # type: ignore[no-untyped-call]
    return {name: str(value) for name, value in params.items()}


def libpq_url(url: str) -> str:
    """``url`` as libpq, psycopg and LangGraph's Postgres savers take it: ``postgresql://…``,
    naming what :func:`connect_params` names.

    Built here, not by rendering SQLAlchemy's URL under another scheme: SQLAlchemy writes a
    space as ``+`` in the query and leaves spaces unescaped elsewhere, which libpq misreads or
    refuses (a socket directory under a path with a space; ``tests/unit/test_urls.py``), and
    writes SQLAlchemy's multi-host form (``?host=a:5432&host=b:5432``) that libpq reads as one
    host named ``b:5432``.
    """
    params = connect_params(url)
    user = params.pop("user", None)
    password = params.pop("password", None)
    dbname = params.pop("dbname", None)
    authority = ""
    if user is not None:
        secret = f":{_escape(password)}" if password is not None else ""
        authority = f"{_escape(user)}{secret}@"
    elif password is not None:
        params["password"] = password
    host = params.get("host")
    if host is not None and _PLAIN_HOST.fullmatch(host):
        del params["host"]
        authority += f"[{host}]" if ":" in host else host
        port = params.get("port")
        if port is not None and port.isdigit():
            del params["port"]
            authority += f":{port}"
    path = f"/{_escape(dbname)}" if dbname is not None else ""
    query = "&".join(f"{_escape(name)}={_escape(value)}" for name, value in params.items())
    return f"postgresql://{authority}{path}{'?' + query if query else ''}"


def _escape(text: str) -> str:
    """``text`` percent-encoded for any part of a libpq URL (libpq decodes every part)."""
    return quote(text, safe="")
