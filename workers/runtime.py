"""Per-process resources of a worker: the database engine, created after the fork."""

from __future__ import annotations

import functools
import sys

from celery.signals import worker_init, worker_process_init
from sqlalchemy import Engine

from outbox.config import get_settings
from outbox.db import create_engine, database_url

#: How long a thread may run Python before handing the interpreter lock to a waiting one.
#: A worker's threads mostly wait on I/O, and a thread woken by a message (or by its
#: database or HTTP reply) waits for a busy sibling to let go of the lock: with Python's
#: default 5 ms that wait showed in the tail (bench/pipeline.py at a steady 100/s:
#: commit -> request p99 30-36 ms with 5 ms against 22-24 ms with 1 ms, p50 unchanged).
SWITCH_INTERVAL_S = 0.001


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


@worker_init.connect  # type: ignore[untyped-decorator]
def _short_switch_interval(**_: object) -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_S)
