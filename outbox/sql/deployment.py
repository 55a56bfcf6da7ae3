"""The database itself: which one this is, its clock, and what its standbys are."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, text

from outbox.models import Executor


@dataclass(frozen=True, slots=True)
class DatabaseIdentity:
    """What identifies a database: the same for every session on it, a physical standby
    included, and different for any other database."""

    #: The cluster's system identifier (``pg_control_system()``).
    cluster: int
    #: This database's OID in that cluster.
    database: int


_CLOCK = select(func.clock_timestamp())


def clock(executor: Executor) -> datetime:
    """The database's clock now (``clock_timestamp()``): what ages shown to people are
    measured against, as every age the outbox decides on is."""
    now: datetime = executor.execute(_CLOCK).scalar_one()
    return now


_DATABASE_IDENTITY = text(
    "SELECT (SELECT system_identifier FROM pg_control_system()) AS cluster, "
    "(SELECT oid::bigint FROM pg_database WHERE datname = current_database()) AS database"
)


def database_identity(executor: Executor) -> DatabaseIdentity:
    """This database's identity (raises the driver's error if the role may not read it)."""
    row = executor.execute(_DATABASE_IDENTITY).one()
    return DatabaseIdentity(int(row.cluster), int(row.database))


@dataclass(frozen=True, slots=True)
class Replication:
    """What the server says of its streaming standbys (:func:`replication`)."""

    #: Physical standbys streaming from this server (logical walsenders are not standbys).
    standbys: int
    #: Of those, the ones a commit waits for (``sync_state`` ``sync`` or ``quorum``).
    synchronous: int
    #: The server's ``synchronous_standby_names`` (empty: no commit waits for a standby).
    synchronous_standby_names: str

    @property
    def asynchronous_only(self) -> bool:
        """Standbys stream, and a failover to one may lose commits this server acknowledged."""
        return self.standbys > 0 and (
            self.synchronous == 0 or not self.synchronous_standby_names.strip()
        )


_REPLICATION = text(
    """
    SELECT count(*) AS standbys,
           count(*) FILTER (WHERE r.sync_state IN ('sync', 'quorum')) AS synchronous,
           current_setting('synchronous_standby_names') AS names
    FROM pg_stat_replication AS r
    WHERE NOT EXISTS (SELECT FROM pg_replication_slots AS s
                      WHERE s.active_pid = r.pid AND s.slot_type = 'logical')
    """
)


def replication(executor: Executor) -> Replication:
    """The server's standbys as ``pg_stat_replication`` shows them to this role.

    A role without ``pg_read_all_stats`` sees the standbys but not their ``sync_state``, so
    they count as asynchronous: the safe reading.
    """
    row = executor.execute(_REPLICATION).one()
    return Replication(int(row.standbys), int(row.synchronous), str(row.names))
