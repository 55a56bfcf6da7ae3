"""The reconciler's periodic runs, one at a time, whatever the hosts' clocks say.

Beat only rings the bell (DESIGN.md, "Time"): its messages carry no Celery ``expires``, an
absolute time on beat's clock that each worker compared with its own (a worker ahead of
beat threw every sweep away; lost dispatchers' `sent` rows and `unknown` rows never moved).
What ``expires`` was for — a backlog of messages after the workers were down must not cost a
backlog of work — is done here instead, by the database: one sweep at a time, under a
PostgreSQL advisory lock, so a message that arrives while a sweep runs (a backlog taken by
several worker processes at once, a second beat) costs one lock attempt; and a sweep right
after another finds only what is due by the database clock, which is little or nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Engine

from outbox import sql
from outbox.locks import SWEEP_LOCK_KEY
from outbox.logs import Action
from outbox.reconcilers.sweep import RequestLookup, SweepConfig, Sweeper, SweepResult
from outbox.workers.locking import release

log = logging.getLogger(__name__)


@contextmanager
def sweep_lock(engine: Engine) -> Iterator[bool]:
    """Whether this process holds the sweep's lock (taken without waiting) for the block.

    A session lock on a connection of its own, kept for the whole sweep and released (or
    the connection discarded) when the block ends. A worker killed mid-sweep drops its
    connection, and PostgreSQL frees the lock with it; a sweep that hangs keeps it until
    its process dies (with the prefork pool, at Celery's hard time limit).
    """
    with engine.connect() as conn:
        try:
            taken = sql.locks.try_lock(conn, SWEEP_LOCK_KEY)
            conn.commit()
            yield taken
        finally:
            release(conn)


def sweep_once(
    engine: Engine, config: SweepConfig, *, request_lookup: RequestLookup | None = None
) -> SweepResult | None:
    """One sweep, or ``None`` without doing anything if another sweep is running."""
    with sweep_lock(engine) as mine:
        if not mine:
            log.debug("another sweep is running", extra={"action": Action.SWEEP_SKIPPED})
            return None
        return Sweeper(engine, config=config, request_lookup=request_lookup).run_once()
