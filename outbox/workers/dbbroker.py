"""The database-as-broker transport: kombu's SQLAlchemy transport, polled briskly.

kombu's virtual transports poll their queues every ``polling_interval`` (1 s by default);
the SQLAlchemy transport forwards every transport option to ``create_engine``, so the
interval cannot be set as an option there. This subclass sets it instead: one host with no
RabbitMQ should not add a second to every dispatch.

kombu creates its two tables the first time a process opens a channel, with nothing against
another process doing the same at the same instant: on a fresh database, processes started
together (``outbox up``, a deployment) crashed at start-up with a duplicate-sequence error.
Our channel creates them under a PostgreSQL advisory lock, and treats a queue row another
process inserted first as found, not as an error.
"""

from __future__ import annotations

import warnings
from typing import Any

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport.sqlalchemy import Channel as SQLAlchemyChannel
from kombu.transport.sqlalchemy import Transport as SQLAlchemyTransport
from sqlalchemy import create_engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.pool import NullPool

from outbox import sql
from outbox.locks import advisory_key

# kombu's models use lazy="noload", which SQLAlchemy 2.1 deprecates; nothing we can act on.
warnings.filterwarnings(
    "ignore", message="The ``noload`` loader strategy is deprecated", category=DeprecationWarning
)

#: Seconds between polls of an empty queue (a cheap indexed query per queue).
POLLING_INTERVAL_S = 0.1


#: Serialises the creation of the broker's tables across processes.
TABLES_LOCK_KEY = advisory_key("outbox.broker", "tables")


class Channel(SQLAlchemyChannel):  # type: ignore[misc]
    """kombu's SQLAlchemy channel, safe for processes that start together."""

    def _open(self) -> Any:
        url = self.connection.client.hostname
        if url in self._engines:
            return super()._open()
        # The first open in this process creates the tables if missing: one process at a time.
        lock = create_engine(url, poolclass=NullPool, hide_parameters=True)
        try:
            with lock.connect() as conn:
                sql.locks.lock(conn, TABLES_LOCK_KEY)
                try:
                    return super()._open()
                finally:
                    sql.locks.unlock(conn, TABLES_LOCK_KEY)
        finally:
            lock.dispose()

    def _get_or_create(self, queue: str) -> Any:
        try:
            return super()._get_or_create(queue)
        except IntegrityError:
            # Another process inserted this queue's row between our look and our insert.
            self.session.rollback()
            return super()._get_or_create(queue)


class Transport(SQLAlchemyTransport):  # type: ignore[misc]
    """kombu's SQLAlchemy transport with a 0.1 s polling interval and :class:`Channel`."""

    Channel = Channel
    polling_interval = POLLING_INTERVAL_S


#: The URL scheme prefix selecting this transport: ``outboxdb+postgresql+psycopg://…``.
ALIAS = "outboxdb"
# kombu picks a transport by the URL's prefix; registering ours makes the URL self-contained.
TRANSPORT_ALIASES[ALIAS] = f"{__name__}:Transport"
