"""Which deployment a process belongs to: the name its broker queues and exchanges carry.

Two deployments (two outbox databases) may share a broker, even one RabbitMQ vhost: each
names its queues after itself, so neither consumes the other's messages (a worker acks a
message for an operation it does not have, so a shared queue loses the other deployment's
messages until its relay publishes them again).

The name is ``OUTBOX_DEPLOYMENT`` when set, else derived from the database's identity: the
cluster's system identifier and the database's OID. Every process of a deployment reads the
same pair whatever host name, address or pooler its URL goes through, across restarts and on
a promoted physical standby; no other database has it, except a physical copy of this one
(a base backup or a disk snapshot restored elsewhere), which must set ``OUTBOX_DEPLOYMENT``.
"""

from __future__ import annotations

import functools
import hashlib

from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool

from outbox import sql
from outbox.config import Settings
from outbox.db import create_engine, database_errors, database_url
from outbox.errors import ConfigError

#: What a derived name starts with, so an operator tells it from a chosen one.
DERIVED_PREFIX = "db-"
#: Hex digits of the identity's hash kept in a derived name: 48 bits, so two deployments on
#: one broker collide with a chance of about one in 10^14.
DIGEST_CHARS = 12


def deployment_name(settings: Settings) -> str:
    """``OUTBOX_DEPLOYMENT``, or the name derived from the database (one round trip, once
    per process and database)."""
    if settings.deployment is not None:
        return settings.deployment
    return derived_name(database_url(settings))


@functools.cache
def derived_name(url: str) -> str:
    """The deployment name of the database at ``url``: ``db-`` and a hash of its identity.

    Raises :class:`~outbox.errors.DatabaseUnavailable` if the database cannot be reached, and
    :class:`~outbox.errors.ConfigError` if it does not tell its identity (a server that
    refuses ``pg_control_system()`` to this role): then ``OUTBOX_DEPLOYMENT`` must be set.
    """
    engine = create_engine(url, poolclass=NullPool)
    try:
        with database_errors(url), engine.connect() as conn:
            try:
                identity = sql.deployment.database_identity(conn)
            except DBAPIError as exc:
                if exc.connection_invalidated:
                    raise
                raise ConfigError(
                    "OUTBOX_DEPLOYMENT is unset and the database does not tell its identity "
                    f"({str(exc.orig).strip().splitlines()[0]}): set OUTBOX_DEPLOYMENT to "
                    "one name for every process of this deployment"
                ) from exc
    finally:
        engine.dispose()
    digest = hashlib.sha256(f"{identity.cluster}/{identity.database}".encode()).hexdigest()[
        :DIGEST_CHARS
    ]
    return f"{DERIVED_PREFIX}{digest}"
