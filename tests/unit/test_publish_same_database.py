"""Whether the database broker is the relay's own database (then the relay writes a batch
in its claim's transaction): host, port, database name and socket directory must all match."""

from __future__ import annotations

import pytest
from sqlalchemy import make_url

from outbox.workers.publish import same_database

RELAY = "postgresql+psycopg://app@db.internal:5432/outbox"


@pytest.mark.parametrize(
    ("broker", "same"),
    [
        ("outboxdb+postgresql+psycopg://app@db.internal:5432/outbox", True),
        ("outboxdb+postgresql+psycopg://other:secret@db.internal:5432/outbox", True),
        ("outboxdb+postgresql+psycopg://app@db.internal:5432/other", False),
        ("outboxdb+postgresql+psycopg://app@db.internal:5433/outbox", False),
        ("outboxdb+postgresql+psycopg://app@db2.internal:5432/outbox", False),
    ],
)
def test_same_host_port_and_name_is_the_same_database(broker: str, same: bool) -> None:
    assert same_database(make_url(RELAY), broker) is same


def test_the_embedded_servers_socket_directory_counts() -> None:
    relay = make_url("postgresql+psycopg://postgres@/outbox?host=/run/a")
    assert same_database(relay, "outboxdb+postgresql+psycopg://postgres@/outbox?host=/run/a")
    assert not same_database(relay, "outboxdb+postgresql+psycopg://postgres@/outbox?host=/run/b")
