"""The database broker's doorbell: a publish NOTIFYs at commit, a waiting consumer wakes.

Real PostgreSQL, real kombu connections. Each wait is far shorter than the poll interval the
consumer is given (60 s), so only a notification can make it return in time.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from kombu import Connection, Queue
from sqlalchemy import Engine, text

from outbox.doorbell import EVERYTHING, MESSAGES, PLANNED, Doorbell
from outbox.workers import dbbroker
from outbox.workers.app import BROKER_MESSAGE_TABLE, BROKER_QUEUE_TABLE

pytestmark = pytest.mark.slow

#: A poll interval no test may wait out: what returns in time was woken by a NOTIFY.
LONG_POLL_S = 60.0
#: Generous for a wake-up on a loaded machine, and well short of LONG_POLL_S.
WAKE_TIMEOUT_S = 20.0


def _broker(url: str) -> Connection:
    return Connection(
        f"{dbbroker.ALIAS}+{url}",
        transport_options={
            "queue_tablename": BROKER_QUEUE_TABLE,
            "message_tablename": BROKER_MESSAGE_TABLE,
            "polling_interval": LONG_POLL_S,
        },
    )


def test_a_committed_publish_rings_the_doorbell(database_url: str, engine: Engine) -> None:
    """A batch written in a caller's transaction (as the relay writes one in its claim's)
    rings a listening doorbell once that transaction commits, not before."""
    bell = Doorbell(database_url)
    try:
        assert bell.wait_listening(WAKE_TIMEOUT_S)
        with _broker(database_url) as broker, engine.connect() as conn:
            channel = broker.default_channel
            channel.queue_declare(queue="dispatch")
            producer = broker.Producer(channel)
            bell.wait(WAKE_TIMEOUT_S)  # the ring every (re)connection gives
            bell.clear()
            with conn.begin():
                with channel.batch(on=conn):
                    producer.publish({"n": 1}, routing_key="dispatch")
                assert not bell.wait(0.5)  # PostgreSQL delivers at commit
            assert bell.wait(WAKE_TIMEOUT_S)
            assert Queue("dispatch")(channel).get(no_ack=True) is not None
    finally:
        bell.close()


def test_a_rung_bell_stays_rung_until_cleared(database_url: str) -> None:
    """A ring while nobody waits is not lost: the next wait returns at once."""
    bell = Doorbell(database_url)
    try:
        bell.ring()
        assert bell.rung()
        assert bell.wait(WAKE_TIMEOUT_S)
        bell.clear()
        assert not bell.rung()
    finally:
        bell.close()


def test_a_publish_wakes_a_consumer_with_a_long_poll_interval(
    database_url: str, engine: Engine
) -> None:
    """A consumer that polled an empty queue gets a message published afterwards well before
    its next poll: the publish's NOTIFY woke it."""
    received: list[object] = []
    with _broker(database_url) as consumer_conn, _broker(database_url) as producer_conn:
        queue = Queue("doorbell-test")

        def on_message(body: object, message: Any) -> None:
            received.append(body)
            message.ack()

        consumer = consumer_conn.Consumer([queue], callbacks=[on_message])
        consumer.consume()
        transport = consumer_conn.transport
        assert transport.polling_interval == LONG_POLL_S
        # One poll of the empty queue: the next is LONG_POLL_S away.
        with pytest.raises(TimeoutError):
            consumer_conn.drain_events(timeout=0.2)
        assert transport.doorbell.wait_listening(WAKE_TIMEOUT_S)

        def publish() -> None:
            producer_conn.Producer().publish({"n": 1}, routing_key=queue.name, declare=[queue])

        publisher = threading.Thread(target=publish)
        publisher.start()
        consumer_conn.drain_events(timeout=WAKE_TIMEOUT_S)
        publisher.join()
        assert received == [{"n": 1}]


def test_a_ring_says_what_rang(database_url: str, engine: Engine) -> None:
    """A publish's NOTIFY rings for the messages, enqueue's for due operations, a ring of no
    NOTIFY for both; take() hands it over once."""
    bell = Doorbell(database_url, planned=lambda: True)
    try:
        assert bell.wait_listening(WAKE_TIMEOUT_S)
        bell.wait(WAKE_TIMEOUT_S)
        assert bell.take() == EVERYTHING  # the ring every (re)connection gives
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_notify('outbox_planned', '')"))
        assert bell.wait(WAKE_TIMEOUT_S)
        assert bell.take() == {PLANNED}
        with _broker(database_url) as broker:
            channel = broker.default_channel
            channel.queue_declare(queue="dispatch")
            broker.Producer(channel).publish({"n": 1}, routing_key="dispatch")
            assert bell.wait(WAKE_TIMEOUT_S)
            assert bell.take() == {MESSAGES}
        bell.ring()
        assert bell.take() == EVERYTHING
        assert bell.take() == frozenset()
        assert not bell.rung()
    finally:
        bell.close()
