"""Procrastinate: a PostgreSQL job queue; the job is deferred in the intent's own transaction.

The agent, in one transaction on its SQLAlchemy session (psycopg 3), inserts its
``bench_intents`` row and defers ``bench.post(intent_id=...)`` on the same connection
(``App.configure_task(..., connection=<the session's psycopg connection>).defer(...)``,
procrastinate's documented way to defer atomically inside a user-managed transaction, with
its ``SyncPsycopgConnector``), then commits: the job row and the intent commit together, an
outbox in all but name. The commit fires procrastinate's NOTIFY, which wakes a worker.

Workers: ``python -m procrastinate --app peer_drivers.procrastinate_peer.app worker
--concurrency C --queues bench``, ``W`` processes (``--workers`` x ``--concurrency``, default
2 x 8: eight jobs in flight per process on one event loop, procrastinate's natural unit; our
workers run 8 threads each). LISTEN/NOTIFY on (the default) and the default 5 s polling
fallback. The task is ``async``: it reads the intent, POSTs with a process-wide
``httpx.AsyncClient`` and inserts the ``bench_results`` row, on connections of the app's own
psycopg pool (``max_size`` = concurrency + 2, so the jobs and procrastinate's own fetch and
finish queries do not queue for a connection). A job that fails is not retried (the default).
The schema is procrastinate's own, applied to a throw-away database.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import httpx
import procrastinate
from sqlalchemy import text
from sqlalchemy.orm import Session

from peer_drivers import base
from peer_drivers.job import (
    ENV_CONCURRENCY,
    ENV_DATABASE,
    ENV_SERVICE,
    env,
    libpq_url,
    payload_for,
    post_release_async,
    target_for,
)

QUEUE = "bench"
TASK = "bench.post"
_CONCURRENCY = int(os.environ.get(ENV_CONCURRENCY, "8"))

#: The workers' app (the connector opens nothing until the worker starts).
connector = procrastinate.PsycopgConnector(
    conninfo=os.environ.get(ENV_DATABASE, ""), min_size=2, max_size=_CONCURRENCY + 2
)
app = procrastinate.App(connector=connector)

SELECT_INTENT = "SELECT target, payload FROM bench_intents WHERE id = %(id)s"
INSERT_RESULT = (
    "INSERT INTO bench_results (id, status, remote_ref) VALUES (%(id)s, %(status)s, %(ref)s)"
)
INSERT_INTENT = text(
    "INSERT INTO bench_intents (id, target, payload) VALUES (:id, :target, CAST(:payload AS jsonb))"
)


@functools.cache
def _client() -> httpx.AsyncClient:
    """One client per worker process (one event loop)."""
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=_CONCURRENCY + 2))


@app.task(name=TASK, queue=QUEUE)
async def post(intent_id: str) -> None:
    """Read the intent, POST it once, record the result."""
    async with connector.pool.connection() as conn:
        cursor = await conn.execute(SELECT_INTENT, {"id": intent_id})
        row = await cursor.fetchone()
    if row is None:
        raise LookupError(f"no intent {intent_id}")
    target, payload = row
    status, ref = await post_release_async(_client(), env(ENV_SERVICE), intent_id, target, payload)
    async with connector.pool.connection() as conn:
        await conn.execute(INSERT_RESULT, {"id": intent_id, "status": status, "ref": ref})


# --- the agents' side -----------------------------------------------------------------------


class Procrastinate(base.PeerDriver):
    """Procrastinate on ``database_url`` (a throw-away database: its schema, the job's tables)."""

    key = "procrastinate"
    label = "procrastinate"

    def __init__(self, settings: base.Settings, *, database_url: str) -> None:
        super().__init__(settings)
        self.database_url = libpq_url(database_url)
        #: The agents' app: it only defers, on the agents' own connections.
        self.producer = procrastinate.App(
            connector=procrastinate.SyncPsycopgConnector(
                conninfo=self.database_url, min_size=1, max_size=2
            )
        )
        self.producer.open()
        self.producer.schema_manager.apply_schema()
        self.engine = base.agents_engine(database_url, settings.agents)
        base.create_tables(self.engine)

    def reset(self) -> None:
        base.truncate_tables(
            self.engine, "procrastinate_jobs", "procrastinate_workers", "procrastinate_events"
        )

    def start_workers(self, log_dir: Path) -> list[base.WorkerProcess]:
        s = self.settings
        environ = {
            **os.environ,
            ENV_DATABASE: self.database_url,
            ENV_SERVICE: s.service.url,
            ENV_CONCURRENCY: str(s.concurrency),
        }
        return [
            base.WorkerProcess(
                f"procrastinate-worker-{i}",
                "procrastinate",
                [
                    *("--log-level", s.log_level.lower()),
                    *("--app", "peer_drivers.procrastinate_peer.app", "worker"),
                    *("--concurrency", str(s.concurrency), "--queues", QUEUE),
                    *("--name", f"bench-{i}"),
                ],
                environ,
                log_dir,
            )
            for i in range(1, s.workers + 1)
        ]

    def open_agent(self) -> base.Agent:
        return _Agent(self)

    def recorded(self) -> dict[str, float]:
        return base.recorded_results(self.engine)

    def count_recorded(self) -> int:
        return base.count_results(self.engine)

    def postgres_pids(self) -> list[int]:
        return base.server_pids(self.engine, [self.engine.url.database or ""])

    def close(self) -> None:
        self.engine.dispose()
        self.producer.close()


class _Agent:
    """One agent: INSERT the intent and defer its job on the same connection, then COMMIT."""

    def __init__(self, driver: Procrastinate) -> None:
        self.producer = driver.producer
        self.session = Session(driver.engine)
        self.session.connection()  # open before the start
        self.session.commit()

    def enqueue(self, i: int, key: str) -> float:
        with self.session.begin():
            self.session.execute(
                INSERT_INTENT,
                {"id": key, "target": target_for(i), "payload": json.dumps(payload_for(i))},
            )
            connection = self.session.connection().connection.driver_connection
            self.producer.configure_task(TASK, queue=QUEUE, connection=connection).defer(
                intent_id=key
            )
        return time.time()

    def close(self) -> None:
        self.session.close()
