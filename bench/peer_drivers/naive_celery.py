"""Naive Celery, no outbox: commit the intent, then ``task.delay(id)`` on RabbitMQ.

The agent inserts its ``bench_intents`` row and commits (its commit time is taken there), then
publishes ``post.delay(intent_id)`` to RabbitMQ (a throw-away vhost). A crash between the
COMMIT and the publish loses the action, Celery's default early ack loses a task whose worker
dies mid-way, and nothing records whether a POST went out, so nothing can recover safely: that
is the naivety this peer stands for, and it costs nothing here because nothing crashes.

Worker: ``celery -A peer_drivers.naive_celery worker -P threads -c C -Q bench_naive``, ``W``
processes (``--workers`` x ``--concurrency``, default 2 x 8, as our workers). The task reads
the intent row, POSTs with a process-wide ``httpx.Client`` (keep-alive pool), and inserts the
``bench_results`` row, each in its own transaction on a SQLAlchemy engine (psycopg 3) sized to
the concurrency. Celery's defaults otherwise, as a first Celery app has them: JSON serializer,
no result backend (results ignored), early acks, prefetch multiplier 4, no task events; a
transport error retries the task at once, up to 3 times (``autoretry_for``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx
import sqlalchemy
from celery import Celery
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from peer_drivers import base
from peer_drivers.job import (
    ENV_BROKER,
    ENV_CONCURRENCY,
    ENV_DATABASE,
    ENV_SERVICE,
    env,
    payload_for,
    post_release,
    sqlalchemy_url,
    target_for,
)

QUEUE = "bench_naive"
TASK = "bench.naive.post"

app = Celery("bench_naive")
app.conf.update(
    broker_url=os.environ.get(ENV_BROKER, "amqp://guest:guest@127.0.0.1:5672//"),
    broker_connection_retry_on_startup=True,
    task_serializer="json",
    accept_content=["json"],
    result_serializer="json",
    task_ignore_result=True,
    task_default_queue=QUEUE,
    worker_hijack_root_logger=False,
)

INSERT_INTENT = text(
    "INSERT INTO bench_intents (id, target, payload) VALUES (:id, :target, CAST(:payload AS jsonb))"
)
SELECT_INTENT = text("SELECT target, payload FROM bench_intents WHERE id = :id")
INSERT_RESULT = text(
    "INSERT INTO bench_results (id, status, remote_ref) VALUES (:id, :status, :ref)"
)

# --- the worker's side ----------------------------------------------------------------------

_lock = threading.Lock()


@functools.cache
def _engine() -> Engine:
    concurrency = int(os.environ.get(ENV_CONCURRENCY, "8"))
    return sqlalchemy.create_engine(
        sqlalchemy_url(env(ENV_DATABASE)), pool_size=concurrency, max_overflow=2
    )


@functools.cache
def _client() -> httpx.Client:
    concurrency = int(os.environ.get(ENV_CONCURRENCY, "8"))
    return httpx.Client(limits=httpx.Limits(max_connections=concurrency + 2))


# A transport error retries the task at once, up to 3 times, as a Celery user writes it
# (autoretry_for); the key header lets the service deduplicate a POST that did arrive. Without
# it one failed POST (a shared client's connection reset under load) lost the task, and the
# benchmark waited for a result that never came.
@app.task(  # type: ignore[untyped-decorator]
    name=TASK, autoretry_for=(httpx.TransportError,), max_retries=3, default_retry_delay=0
)
def post(intent_id: str) -> None:
    """Read the intent, POST it, record the result."""
    with _lock:  # functools.cache is not a lock: one engine and one client per process
        engine, client = _engine(), _client()
    with engine.begin() as conn:
        target, payload = conn.execute(SELECT_INTENT, {"id": intent_id}).one()
    status, ref = post_release(client, env(ENV_SERVICE), intent_id, target, payload)
    with engine.begin() as conn:
        conn.execute(INSERT_RESULT, {"id": intent_id, "status": status, "ref": ref})


# --- the agents' side -----------------------------------------------------------------------


class NaiveCelery(base.PeerDriver):
    """Naive Celery on ``database_url`` (libpq URL) and ``broker_url`` (a vhost)."""

    key = "celery"
    label = "naive celery"

    def __init__(self, settings: base.Settings, *, database_url: str, broker_url: str) -> None:
        super().__init__(settings)
        self.database_url = database_url
        self.broker_url = broker_url
        app.conf.broker_url = broker_url
        self.engine = base.agents_engine(database_url, settings.agents)
        base.create_tables(self.engine)

    def reset(self) -> None:
        base.truncate_tables(self.engine)
        with contextlib.suppress(Exception):  # the queue does not exist before the first case
            app.control.purge()

    def start_workers(self, log_dir: Path) -> list[base.WorkerProcess]:
        s = self.settings
        environ = {
            **os.environ,
            ENV_DATABASE: self.database_url,
            ENV_BROKER: self.broker_url,
            ENV_SERVICE: s.service.url,
            ENV_CONCURRENCY: str(s.concurrency),
        }
        return [
            base.WorkerProcess(
                f"celery-worker-{i}",
                "celery",
                [
                    *("-A", "peer_drivers.naive_celery", "worker"),
                    *("-P", "threads", "-c", str(s.concurrency), "-Q", QUEUE),
                    *("-n", f"naive{i}@%h", "-l", s.log_level),
                ],
                environ,
                log_dir,
            )
            for i in range(1, s.workers + 1)
        ]

    def open_agent(self) -> base.Agent:
        return _Agent(self.engine)

    def recorded(self) -> dict[str, float]:
        return base.recorded_results(self.engine)

    def count_recorded(self) -> int:
        return base.count_results(self.engine)

    def postgres_pids(self) -> list[int]:
        return base.server_pids(self.engine, [self.engine.url.database or ""])

    def cpu_groups(self) -> dict[str, Callable[[], Iterable[int]]]:
        return {"rabbitmq": base.rabbitmq_pids}

    def close(self) -> None:
        self.engine.dispose()
        with contextlib.suppress(Exception):
            app.pool.force_close_all()


class _Agent:
    """One agent: INSERT + COMMIT, then ``post.delay(id)``."""

    def __init__(self, engine: Engine) -> None:
        self.session = Session(engine)
        self.session.connection()  # open before the start
        self.session.commit()

    def enqueue(self, i: int, key: str) -> float:
        with self.session.begin():
            self.session.execute(
                INSERT_INTENT,
                {"id": key, "target": target_for(i), "payload": json.dumps(payload_for(i))},
            )
        committed = time.time()
        post.delay(key)
        return committed

    def close(self) -> None:
        self.session.close()
