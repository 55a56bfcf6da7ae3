"""Per-process resources of a worker: the database engine, created after the fork."""

from __future__ import annotations

import functools

from celery.signals import worker_process_init
from sqlalchemy import Engine

from outbox.config import get_settings
from outbox.db import create_engine, database_url


@functools.cache
def engine() -> Engine:
    """This process's engine (each attempt checks out its own connection from it).

    Without the pool's pre-ping, one round trip fewer per checkout: the lock step
    (:func:`workers.locking.operation_lock`) replaces a connection found dead there, before
    anything is written, and any other statement that meets a dead connection fails its
    task once while SQLAlchemy renews the whole pool; the sweep runs again on its beat.
    """
    return create_engine(
        database_url(get_settings()), pool_size=10, max_overflow=20, pool_pre_ping=False
    )


@worker_process_init.connect  # type: ignore[untyped-decorator]
def _forget_parent_engine(**_: object) -> None:
    # A forked child must never reuse its parent's pooled connections.
    engine.cache_clear()
