"""Every PostgreSQL spelling of a database URL, and its conversions, checked against libpq's
own parser (psycopg's ``conninfo_to_dict``) and SQLAlchemy's psycopg dialect."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.engine import URL

from outbox import urls
from outbox.db import normalize_url
from outbox.dev.ownership import same_database
from outbox.errors import DatabaseUnavailable

SCHEMES = ("postgresql", "postgres", "postgresql+psycopg")

#: The embedded server's URL, as ``outbox db embedded status`` prints it.
SOCKET_URL = "postgresql+psycopg://postgres:@/outbox_test_x?host=%2Fhome%2Fa%20b%2Fpgdata"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_spelling_names_the_same_connection(scheme: str) -> None:
    """postgresql://, postgres:// and postgresql+psycopg:// give one SQLAlchemy URL and one
    libpq URL."""
    url = f"{scheme}://app:s3cret@db.internal:5433/app?sslmode=require"
    assert urls.sqlalchemy_url(url) == (
        "postgresql+psycopg://app:s3cret@db.internal:5433/app?sslmode=require"
    )
    assert normalize_url(url) == urls.sqlalchemy_url(url)
    assert urls.libpq_url(url) == "postgresql://app:s3cret@db.internal:5433/app?sslmode=require"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_socket_directory_url_becomes_a_libpq_url_libpq_reads(scheme: str) -> None:
    """The embedded server's socket-directory URL, in any spelling, gives libpq the directory
    as its host (a path with a space included) and no password."""
    url = SOCKET_URL.replace("postgresql+psycopg", scheme, 1)
    assert conninfo_to_dict(urls.libpq_url(url)) == {
        "user": "postgres",
        "dbname": "outbox_test_x",
        "host": "/home/a b/pgdata",
    }


def test_sqlalchemys_multi_host_form_becomes_libpqs() -> None:
    """SQLAlchemy's ``?host=a:1&host=b:2`` becomes libpq's comma-separated hosts and ports."""
    url = "postgres://app@/app?host=a.internal:5432&host=b.internal:5433"
    assert conninfo_to_dict(urls.libpq_url(url)) == {
        "user": "app",
        "dbname": "app",
        "host": "a.internal,b.internal",
        "port": "5432,5433",
    }


@pytest.mark.parametrize(
    "url", ["mysql://app@db/app", "sqlite:///outbox.db", "not a url", "postgresqll://a@b/c"]
)
def test_anything_but_postgresql_is_refused_without_echoing_it(url: str) -> None:
    """A URL of another database, or no URL at all, raises DatabaseUnavailable naming
    OUTBOX_DATABASE_URL and never the string itself (it may hold a password)."""
    with pytest.raises(DatabaseUnavailable, match="OUTBOX_DATABASE_URL") as raised:
        urls.libpq_url(url)
    assert url not in str(raised.value)
    assert raised.value.__cause__ is None


def test_the_spellings_name_one_database_for_ownership() -> None:
    """postgres:// and postgresql+psycopg:// name the same database to --i-own-this-database."""
    assert same_database("postgres://a@h:5432/d", "postgresql+psycopg://a:pw@h:5432/d")


_TEXT = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), min_size=1)
_HOSTS = st.one_of(
    st.none(),
    st.sampled_from(["db.internal", "127.0.0.1", "::1", "localhost"]),
    _TEXT.map(lambda tail: "/tmp/" + tail),  # noqa: S108 -- a socket directory's path, never used
)


@given(
    scheme=st.sampled_from(SCHEMES),
    user=st.none() | _TEXT,
    password=st.none() | _TEXT,
    host=_HOSTS,
    port=st.none() | st.integers(1, 65535),
    database=st.none() | st.from_regex(r"[A-Za-z0-9_ .-]{1,20}", fullmatch=True),
    application_name=st.none() | _TEXT,
)
def test_libpq_reads_what_sqlalchemy_connects_with(
    scheme: str,
    user: str | None,
    password: str | None,
    host: str | None,
    port: int | None,
    database: str | None,
    application_name: str | None,
) -> None:
    """For any user, password, host or socket directory, port, database and option, libpq
    parses the libpq URL into the very parameters SQLAlchemy's psycopg dialect connects with,
    and the libpq URL read back as an outbox URL names them again."""
    query = {"application_name": application_name} if application_name is not None else {}
    tcp = host is not None and not host.startswith("/")
    if not tcp and host is not None:
        query["host"] = host
    url = URL.create(
        scheme,
        username=user,
        password=password,
        host=host if tcp else None,
        port=port if tcp else None,
        database=database,
        query=query,
    ).render_as_string(hide_password=False)
    expected = urls.connect_params(url)
    converted = urls.libpq_url(url)
    assert conninfo_to_dict(converted) == expected
    assert urls.connect_params(converted) == expected
