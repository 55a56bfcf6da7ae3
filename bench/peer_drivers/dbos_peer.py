"""DBOS Transact: a durable workflow per operation, enqueued by the agent on a DBOS queue.

The workflow ``bench_operation(intent_id, target, payload)`` has three steps:

1. ``record_intent``: a ``@datasource.transaction`` inserting the ``bench_intents`` row in
   the application database (DBOS records the step's output in the same transaction);
2. ``call_service``: a ``@DBOS.step`` POSTing once with a process-wide ``httpx.Client``
   (no step retries, the default); DBOS checkpoints its output in the system database;
3. ``record_result``: a ``@datasource.transaction`` inserting the ``bench_results`` row.

Isolation: the transactions run at READ COMMITTED, as ours and the other peers' do (DBOS's
default is SERIALIZABLE, which for two single-row INSERTs only adds retry risk).

"An agent enqueues, workers execute" is, in DBOS, a ``DBOSClient`` in the agent's process
enqueueing onto a queue that the application's processes dequeue: ``DBOSClient.enqueue``
inserts the workflow's ENQUEUED status row (its inputs included) in the system database and
commits; that commit is the agent's durable intent, and its commit time is taken when
``enqueue`` returns. The workflow id is the intent's UUID (so enqueueing is idempotent), and
the same UUID is the idempotency key sent to the service. (DBOS 3 also has
``enqueue_in_transaction``, which would put the enqueue in the agent's own transaction when the
application tables live in the system database; this benchmark follows the shape above:
system database and application database are two throw-away databases on the same server.)

Workers: ``W`` processes (``--workers``, default 2), each ``DBOS.launch()``-ed with its own
executor id and ``DBOS.register_queue("bench", worker_concurrency=C)`` (``--concurrency``,
default 8: at most 8 workflows of the queue run at once per process, on DBOS's executor
threads, like our 8 threads per worker). DBOS queues are polled (no LISTEN/NOTIFY for
queues): each process's queue thread wakes every ``polling_interval_sec`` and claims what its
free slots allow. The default interval is 1 s; this benchmark uses ``--dbos-poll`` (default
0.1 s, the figure our database broker polls at), since at 1 s both DBOS's latency and its
throughput (at most ``W x C`` workflows started per interval) would be set by the knob alone.
Migrations are run once by the parent; the workers start with ``run_migrations=False``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from peer_drivers import base
from peer_drivers.job import (
    ENV_CONCURRENCY,
    ENV_DATABASE,
    ENV_POLL,
    ENV_SERVICE,
    ENV_SYSTEM_DATABASE,
    ENV_WORKER,
    env,
    libpq_url,
    payload_for,
    post_release,
    sqlalchemy_url,
    target_for,
)

APP_NAME = "bench-peers"
QUEUE = "bench"
WORKFLOW = "bench_operation"
DATASOURCE_SCHEMA = "dbos"

INSERT_INTENT = text(
    "INSERT INTO bench_intents (id, target, payload) VALUES (:id, :target, CAST(:payload AS jsonb))"
)
INSERT_RESULT = text(
    "INSERT INTO bench_results (id, status, remote_ref) VALUES (:id, :status, :ref)"
)


# --- the worker's side ----------------------------------------------------------------------


def worker_main() -> None:
    """One DBOS worker process: register the workflow, launch, serve the queue until SIGTERM."""
    import json  # noqa: PLC0415

    from dbos import DBOS, DBOSConfig, SQLAlchemyDatasource  # noqa: PLC0415

    concurrency = int(env(ENV_CONCURRENCY))
    service = env(ENV_SERVICE)
    config: DBOSConfig = {
        "name": APP_NAME,
        "system_database_url": env(ENV_SYSTEM_DATABASE),
        "executor_id": f"bench-worker-{env(ENV_WORKER)}",
        "run_migrations": False,
        "log_level": os.environ.get("BENCH_PEER_LOG_LEVEL", "WARNING"),
    }
    DBOS(config=config)
    datasource = SQLAlchemyDatasource.create(
        sqlalchemy_url(env(ENV_DATABASE)),
        engine_kwargs={"pool_size": concurrency + 2, "max_overflow": 2},
        run_migrations=False,
    )
    client = httpx.Client(limits=httpx.Limits(max_connections=concurrency + 2))

    @datasource.transaction(isolation_level="READ COMMITTED")
    def record_intent(intent_id: str, target: str, payload: dict[str, Any]) -> None:
        datasource.sql_session().execute(
            INSERT_INTENT, {"id": intent_id, "target": target, "payload": json.dumps(payload)}
        )

    # A transport error (one seen: EBADF on the shared client) is retried at once, up to 3
    # attempts, as a DBOS user writes it; the key header lets the service deduplicate a POST
    # that did arrive. Without it the workflow fails and peers.py stops on "no progress".
    @DBOS.step(
        retries_allowed=True,
        max_attempts=3,
        interval_seconds=0,
        should_retry=lambda exc: isinstance(exc, httpx.TransportError),
    )
    def call_service(intent_id: str, target: str, payload: dict[str, Any]) -> list[Any]:
        status, ref = post_release(client, service, intent_id, target, payload)
        return [status, ref]

    @datasource.transaction(isolation_level="READ COMMITTED")
    def record_result(intent_id: str, status: int, ref: str | None) -> None:
        datasource.sql_session().execute(
            INSERT_RESULT, {"id": intent_id, "status": status, "ref": ref}
        )

    @DBOS.workflow(name=WORKFLOW)
    def operation(intent_id: str, target: str, payload: dict[str, Any]) -> None:
        record_intent(intent_id, target, payload)
        status, ref = call_service(intent_id, target, payload)
        record_result(intent_id, status, ref)

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    DBOS.launch()
    DBOS.register_queue(
        QUEUE,
        worker_concurrency=concurrency,
        polling_interval_sec=float(env(ENV_POLL)),
        on_conflict="always_update",
    )
    print(f"dbos worker {env(ENV_WORKER)} ready", flush=True)
    stop.wait()
    DBOS.destroy()
    client.close()


# --- the agents' side -----------------------------------------------------------------------


class Dbos(base.PeerDriver):
    """DBOS on two throw-away databases: ``system_url`` (DBOS's) and ``app_url`` (the job's)."""

    key = "dbos"
    label = "dbos"

    def __init__(
        self, settings: base.Settings, *, system_url: str, app_url: str, poll_s: float
    ) -> None:
        from dbos import DBOS, DBOSClient, SQLAlchemyDatasource  # noqa: PLC0415

        super().__init__(settings)
        self.system_url = libpq_url(system_url)
        self.app_url = libpq_url(app_url)
        self.poll_s = poll_s
        DBOS.migrate(self.system_url)
        SQLAlchemyDatasource.migrate(sqlalchemy_url(app_url), schema=DATASOURCE_SCHEMA)
        self.engine = base.agents_engine(app_url, settings.agents)
        self.system_engine = base.agents_engine(system_url, 1)
        base.create_tables(self.engine)
        self.client = DBOSClient(
            system_database_url=self.system_url,
            system_database_pool_size=settings.agents + 2,
            application_name=APP_NAME,
        )

    def reset(self) -> None:
        # The job's tables and DBOS's checkpoints of the datasource transactions (app
        # database); every workflow and, by their foreign keys, its steps' outputs (system).
        base.truncate_tables(self.engine, f"{DATASOURCE_SCHEMA}.datasource_outputs")
        with self.system_engine.begin() as conn:
            conn.execute(text("TRUNCATE dbos.workflow_status CASCADE"))

    def start_workers(self, log_dir: Path) -> list[base.WorkerProcess]:
        s = self.settings
        environ = {
            **os.environ,
            ENV_DATABASE: self.app_url,
            ENV_SYSTEM_DATABASE: self.system_url,
            ENV_SERVICE: s.service.url,
            ENV_CONCURRENCY: str(s.concurrency),
            ENV_POLL: str(self.poll_s),
            "BENCH_PEER_LOG_LEVEL": s.log_level.upper(),
        }
        return [
            base.WorkerProcess(
                f"dbos-worker-{i}",
                "peer_drivers.dbos_peer",
                ["worker"],
                {**environ, ENV_WORKER: str(i)},
                log_dir,
            )
            for i in range(1, s.workers + 1)
        ]

    def open_agent(self) -> base.Agent:
        return _Agent(self.client)

    def recorded(self) -> dict[str, float]:
        return base.recorded_results(self.engine)

    def count_recorded(self) -> int:
        return base.count_results(self.engine)

    def postgres_pids(self) -> list[int]:
        names = [self.engine.url.database or "", self.system_engine.url.database or ""]
        return base.server_pids(self.engine, names)

    def close(self) -> None:
        self.client.destroy()
        self.engine.dispose()
        self.system_engine.dispose()


class _Agent:
    """One agent: ``DBOSClient.enqueue`` (one INSERT + COMMIT in the system database)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def enqueue(self, i: int, key: str) -> float:
        self.client.enqueue(
            {"queue_name": QUEUE, "workflow_name": WORKFLOW, "workflow_id": key},
            key,
            target_for(i),
            payload_for(i),
        )
        return time.time()

    def close(self) -> None:
        pass


if __name__ == "__main__":
    if sys.argv[1:] != ["worker"]:
        sys.exit("usage: python -m peer_drivers.dbos_peer worker (run by bench/peers.py)")
    worker_main()
