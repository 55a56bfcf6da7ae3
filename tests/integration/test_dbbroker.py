"""The database broker when several processes open it for the first time at once.

Found by the zombie tests: on a fresh database, processes starting together raced to create
kombu's tables, and the loser died with a duplicate-sequence error.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from sqlalchemy import text

from outbox.db import create_engine
from outbox.workers.app import BROKER_MESSAGE_TABLE, BROKER_QUEUE_TABLE
from tests.conftest import Databases

pytestmark = pytest.mark.slow

#: Each process waits for the same instant, opens a channel, declares a queue, publishes one.
OPEN_AT_ONCE = """
import sys, time
from kombu import Connection, Queue
import outbox.workers.dbbroker
start, url, name = float(sys.argv[1]), sys.argv[2], sys.argv[3]
time.sleep(max(0.0, start - time.time()))
options = {"queue_tablename": sys.argv[4], "message_tablename": sys.argv[5]}
with Connection("outboxdb+" + url, transport_options=options) as conn:
    queue = Queue("dispatch")
    conn.default_channel.queue_declare(queue="dispatch")
    producer = conn.Producer()
    producer.publish({"from": name}, routing_key="dispatch", declare=[queue])
print("ok", name)
"""

PROCESSES = 6
#: The race is narrow: a few fresh databases make a miss unlikely.
ROUNDS = 4


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_processes_opening_a_fresh_database_broker_together_all_start(
    databases: Databases, round_: int
) -> None:
    """Six processes open the broker on a fresh database in the same instant: none fails."""
    url = databases.create()
    start = time.time() + 3  # after every interpreter has imported kombu and SQLAlchemy
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                OPEN_AT_ONCE,
                str(start),
                url,
                f"p{i}",
                BROKER_QUEUE_TABLE,
                BROKER_MESSAGE_TABLE,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(PROCESSES)
    ]
    results = [child.communicate(timeout=60) for child in children]
    failures = [
        err[-1500:] for child, (_, err) in zip(children, results, strict=True) if child.returncode
    ]
    assert not failures, failures
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            queues = conn.execute(text(f"SELECT count(*) FROM {BROKER_QUEUE_TABLE}")).scalar_one()
            messages = conn.execute(
                text(f"SELECT count(*) FROM {BROKER_MESSAGE_TABLE}")
            ).scalar_one()
    finally:
        engine.dispose()
    assert queues == 1
    assert messages == PROCESSES
