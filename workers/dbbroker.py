"""The database-as-broker transport: kombu's SQLAlchemy transport, polled briskly.

kombu's virtual transports poll their queues every ``polling_interval`` (1 s by default);
the SQLAlchemy transport forwards every transport option to ``create_engine``, so the
interval cannot be set as an option there. This subclass sets it instead: one host with no
RabbitMQ should not add a second to every dispatch.
"""

from __future__ import annotations

import warnings

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport.sqlalchemy import Transport as SQLAlchemyTransport

# kombu's models use lazy="noload", which SQLAlchemy 2.1 deprecates; nothing we can act on.
warnings.filterwarnings(
    "ignore", message="The ``noload`` loader strategy is deprecated", category=DeprecationWarning
)

#: Seconds between polls of an empty queue (a cheap indexed query per queue).
POLLING_INTERVAL_S = 0.1


class Transport(SQLAlchemyTransport):  # type: ignore[misc]
    """kombu's SQLAlchemy transport with a 0.1 s polling interval."""

    polling_interval = POLLING_INTERVAL_S


#: The URL scheme prefix selecting this transport: ``outboxdb+postgresql+psycopg://…``.
ALIAS = "outboxdb"
# kombu picks a transport by the URL's prefix; registering ours makes the URL self-contained.
TRANSPORT_ALIASES[ALIAS] = f"{__name__}:Transport"
