"""How the database broker's consumers take messages (issue 35): one statement over every
queue a consumer reads, ``SKIP LOCKED`` between consumers, the message deleted as it is taken,
no transaction left open, and a lost connection reported as kombu's connection error."""

from __future__ import annotations

import threading
import uuid
from collections import Counter

import pytest
from kombu import Connection, Queue
from sqlalchemy import Engine, text

from outbox.workers.app import BROKER_MESSAGE_TABLE, BROKER_QUEUE_TABLE
from outbox.workers.dbbroker import ALIAS
from tests.proxy import database_proxy

OPTIONS = {"queue_tablename": BROKER_QUEUE_TABLE, "message_tablename": BROKER_MESSAGE_TABLE}


def _connection(database_url: str) -> Connection:
    return Connection(f"{ALIAS}+{database_url}", transport_options=dict(OPTIONS))


@pytest.fixture
def names() -> list[str]:
    """Three queue names of this test's own."""
    tag = uuid.uuid4().hex[:8]
    return [f"take-{tag}-{i}" for i in range(3)]


def _publish(database_url: str, queue: str, bodies: list[int]) -> None:
    with _connection(database_url) as conn:
        producer = conn.Producer()
        declared = Queue(queue)
        for body in bodies:
            producer.publish({"n": body}, routing_key=queue, declare=[declared])


def _consume(conn: Connection, queues: list[str], limit: int, timeout: float = 2.0) -> list[int]:
    """Take up to ``limit`` messages from ``queues`` the way a worker does (drain_events),
    acknowledging each; stops at ``limit`` or after ``timeout`` seconds with none."""
    got: list[int] = []

    def on_message(body: dict[str, int], message: object) -> None:
        got.append(body["n"])
        message.ack()  # type: ignore[attr-defined]

    with conn.Consumer([Queue(q) for q in queues], callbacks=[on_message], prefetch_count=1):
        while len(got) < limit:
            try:
                conn.drain_events(timeout=timeout)
            except TimeoutError:
                break
    return got


def test_a_consumer_of_several_queues_takes_the_oldest_message_of_any(
    database_url: str, names: list[str]
) -> None:
    """Messages come out in the order they were sent, whichever of the consumer's queues
    they are on (kombu's round robin over the queues would serve 3 second)."""
    for queue, bodies in ((names[0], [0, 1, 2]), (names[1], [3]), (names[0], [4])):
        _publish(database_url, queue, bodies)
    with _connection(database_url) as conn:
        assert _consume(conn, names[:2], limit=5) == [0, 1, 2, 3, 4]


def test_a_message_another_consumer_holds_is_skipped_not_waited_for(
    database_url: str, engine: Engine, names: list[str]
) -> None:
    """While another transaction holds the oldest message's row, a consumer takes the next
    one at once; the held one is taken when it is let go."""
    _publish(database_url, names[0], [1, 2])
    got: list[int] = []
    with engine.begin() as holder:
        holder.execute(
            text(f"SELECT id FROM {BROKER_MESSAGE_TABLE} ORDER BY id LIMIT 1 FOR UPDATE")
        )
        with _connection(database_url) as conn:
            consumer = threading.Thread(
                target=lambda: got.extend(_consume(conn, [names[0]], limit=1))
            )
            consumer.start()
            consumer.join(10)
            assert not consumer.is_alive(), "the consumer waited on the held row"
    assert got == [2]
    with _connection(database_url) as conn:
        assert _consume(conn, [names[0]], limit=1) == [1]


def test_concurrent_consumers_take_every_message_once(
    database_url: str, engine: Engine, names: list[str]
) -> None:
    """Four consumers on one queue: each of 400 messages is taken by exactly one of them,
    none is left, and none waits on another's row (SKIP LOCKED)."""
    bodies = list(range(400))
    _publish(database_url, names[0], bodies)
    taken: list[list[int]] = [[] for _ in range(4)]

    def consume(index: int) -> None:
        with _connection(database_url) as conn:
            taken[index] = _consume(conn, [names[0]], limit=len(bodies), timeout=1.0)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    counts = Counter(n for got in taken for n in got)
    assert sorted(counts) == bodies
    assert set(counts.values()) == {1}
    with engine.connect() as conn:
        left = conn.execute(text(f"SELECT count(*) FROM {BROKER_MESSAGE_TABLE}")).scalar_one()
    assert left == 0


def test_taking_leaves_no_transaction_open(
    database_url: str, engine: Engine, names: list[str]
) -> None:
    """After a consumer took a message (and found the queue empty), none of its connections
    is idle in a transaction: a worker waiting for work must not hold VACUUM back."""
    _publish(database_url, names[0], [1])
    with _connection(database_url) as conn:
        assert _consume(conn, [names[0]], limit=2, timeout=0.5) == [1]
        with engine.connect() as check:
            stuck = check.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND state LIKE 'idle in transaction%'"
                )
            ).scalar_one()
            left_open = check.execute(
                text(
                    "SELECT query FROM pg_stat_activity WHERE datname = current_database()"
                    " AND state LIKE 'idle in transaction%'"
                )
            ).all()
        assert stuck == 0, left_open  # each one's last statement


def _idle_in_transaction(engine: Engine) -> list[str]:
    with engine.connect() as check:
        rows = check.execute(
            text(
                "SELECT query FROM pg_stat_activity WHERE datname = current_database()"
                " AND state LIKE 'idle in transaction%'"
            )
        )
        return [str(query) for (query,) in rows]


def test_declaring_a_queue_leaves_no_transaction_open(
    database_url: str, engine: Engine, names: list[str]
) -> None:
    """A declare (a relay's publisher before its first batch, a worker's consumer at start)
    looks the queue up and counts its messages: kombu left both in an open transaction, kept
    until the channel's next commit, which a relay with no work never made."""
    with _connection(database_url) as conn:
        channel = conn.default_channel
        for name in names:
            Queue(name)(channel).declare()
        Queue(names[0])(channel).declare()  # found this time, not created
        assert _idle_in_transaction(engine) == []


def test_a_lost_connection_is_a_connection_error_and_the_next_take_reconnects(
    database_url: str, names: list[str]
) -> None:
    """The database goes away under a consumer: the take raises one of the transport's
    connection errors (Celery reconnects on those), and once it is back messages flow."""
    proxy, through = database_proxy(database_url)
    try:
        _publish(database_url, names[0], [1, 2])
        with _connection(through) as conn:
            assert _consume(conn, [names[0]], limit=1) == [1]
            proxy.cut()
            with pytest.raises(conn.connection_errors):
                _consume(conn, [names[0]], limit=1)
            proxy.restore()
        # As Celery does: a connection error, then a new connection. The engine's pool may
        # still hand out a connection the cut killed: each such one fails once, then goes.
        for attempt in range(5):
            try:
                with _connection(through) as conn:
                    assert _consume(conn, [names[0]], limit=1) == [2]
                break
            except conn.connection_errors:
                assert attempt < 4, "no message after five reconnections"
    finally:
        proxy.stop()
