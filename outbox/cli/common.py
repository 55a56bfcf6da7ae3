"""What every database-backed command needs: the engine, a transaction, clear errors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox.config import get_settings
from outbox.db import database_errors, database_url, get_engine


@contextmanager
def connected() -> Iterator[Engine]:
    """The configured database's engine, with driver errors turned into one-line errors."""
    url = database_url(get_settings())
    with database_errors(url):
        yield get_engine(url)


@contextmanager
def transaction() -> Iterator[Session]:
    """A session in a transaction that commits when the block succeeds, else rolls back."""
    with connected() as engine, Session(engine) as session, session.begin():
        yield session
