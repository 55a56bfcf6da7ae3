"""What every database-backed command needs: the engine, a transaction, clear errors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from outbox.cli.output import fail

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

# The database's modules (SQLAlchemy, the settings, Alembic) are imported by the functions
# below, when a command runs, not when its module is imported for its `--help` (issue 33).


@contextmanager
def connected() -> Iterator[Engine]:
    """The configured database's engine, with driver errors turned into one-line errors."""
    from outbox.config import get_settings  # noqa: PLC0415 -- not for --help
    from outbox.db import database_errors, database_url, get_engine  # noqa: PLC0415 -- not for --help

    url = database_url(get_settings())
    with database_errors(url):
        yield get_engine(url)


@contextmanager
def transaction() -> Iterator[Session]:
    """A session in a transaction that commits when the block succeeds, else rolls back."""
    from sqlalchemy.orm import Session  # noqa: PLC0415 -- not for --help

    with connected() as engine, Session(engine) as session, session.begin():
        yield session


def await_database(component: str) -> None:
    """Wait for the configured database to accept connections (a long-running component at
    start-up, :func:`outbox.db.wait_for_database`); past ``OUTBOX_DB_START_TIMEOUT``, one line
    and exit 1."""
    from outbox.config import get_settings  # noqa: PLC0415 -- not for --help
    from outbox.db import database_url, wait_for_database  # noqa: PLC0415 -- not for --help

    settings = get_settings()
    wait_for_database(
        database_url(settings), timeout_s=settings.db_start_timeout, component=component
    )


def require_schema() -> str:
    """The head revision if the database's schema is at it; else one line and exit 1."""
    from outbox import migrate  # noqa: PLC0415 -- not for --help

    with connected() as engine:
        status = migrate.status(engine)
    if not status.up_to_date:
        fail(
            f"schema is at {status.current or 'nothing (empty database)'}, "
            f"head is {status.head}: run `outbox db upgrade`"
        )
    return status.head
