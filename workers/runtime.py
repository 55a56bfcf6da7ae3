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


@functools.cache
def dispatch_engine() -> Engine:
    """The dispatcher's engine: its lock connections skip the pool's pre-ping round trip.

    :func:`workers.locking.operation_lock` replaces a connection found dead at the lock
    (nothing is written before it), which is all the pre-ping would have done, for one
    round trip fewer per attempt.
    """
    return create_engine(
        database_url(get_settings()), pool_size=10, max_overflow=20, pool_pre_ping=False
    )


@worker_process_init.connect  # type: ignore[untyped-decorator]
def _forget_parent_engine(**_: object) -> None:
    # A forked child must never reuse its parent's pooled connections.
    engine.cache_clear()
    dispatch_engine.cache_clear()
