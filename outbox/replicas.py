"""Standbys that could lose a `sent`: the start-up check of the processes that dispatch.

The dispatcher commits `sent` with ``synchronous_commit=on`` before any byte leaves: the commit
waits for the WAL flush here, and for a *synchronous* standby's if there is one. An
asynchronous standby may not have received it yet; promoted after the primary fails, it shows
the row still `planned` though the request left, and the operation is sent again (with no
dedup at the remote, a second effect). So a worker refuses to start on a primary whose
streaming standbys are all asynchronous, unless ``OUTBOX_ALLOW_ASYNC_REPLICAS`` accepts it.

Only what a failover would take back matters: a lost `sent` is the one write whose loss the
protocol cannot re-derive (a lost sweep move, lookup outcome or published mark leaves a row
that is swept, looked up or published again).
"""

from __future__ import annotations

import logging

from sqlalchemy import Engine

from outbox import sql
from outbox.errors import AsyncReplicas
from outbox.logs import Action
from outbox.sql.deployment import Replication

log = logging.getLogger(__name__)


def check_replicas(engine: Engine, *, allow_async: bool) -> Replication:
    """What the server reports of its standbys; raises :class:`AsyncReplicas` if they stream
    and none is synchronous, unless ``allow_async`` (then a warning is logged)."""
    with engine.connect() as conn:
        found = sql.deployment.replication(conn)
        conn.rollback()
    if not found.asynchronous_only:
        return found
    names = found.synchronous_standby_names
    described = (
        f"the database streams to {found.standbys} standby(s) and none is synchronous "
        f"(synchronous_standby_names = {names!r})"
    )
    if not allow_async:
        raise AsyncReplicas(
            f"{described}: a failover to one may roll back a committed `sent` whose request "
            "already left, and the operation would be sent again; make a standby synchronous "
            "or set OUTBOX_ALLOW_ASYNC_REPLICAS=true to accept the risk",
            standbys=found.standbys,
            synchronous_standby_names=names,
        )
    log.warning(
        "%s; OUTBOX_ALLOW_ASYNC_REPLICAS accepts that a failover may send an operation twice",
        described,
        extra={"action": Action.ASYNC_REPLICAS_ALLOWED},
    )
    return found
