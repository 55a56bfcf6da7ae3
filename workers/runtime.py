"""Per-process resources of a worker: the database engine, created after the fork."""

from __future__ import annotations

import functools

from celery.signals import worker_process_init
from sqlalchemy import Engine

from outbox.config import get_settings
from outbox.db import create_engine, database_url


@functools.cache
def engine() -> Engine:
    """This process's engine (each attempt checks out its own connection from it)."""
    return create_engine(database_url(get_settings()), pool_size=10, max_overflow=20)


@worker_process_init.connect  # type: ignore[untyped-decorator]
def _forget_parent_engine(**_: object) -> None:
    # A forked child must never reuse its parent's pooled connections.
    engine.cache_clear()
