"""The job every peer does, as its workers do it: the tables, the intent's shape, the HTTP call.

Imported by the peers' worker processes as well as by ``peers.py``, so it imports nothing of
the benchmark harness (only httpx, and the outbox's URL conversions). One operation is:

1. record the intent durably (a row of ``bench_intents``: a UUID, a target, a JSON payload);
2. POST its payload once to the reference service, ``POST {service}/projects/{target}/releases``
   with the header ``Idempotency-Key: <the intent's UUID>``, exactly as our HTTP tool calls it
   (``outbox.dev.tool_config.http_tool_toml``): JSON body, 30 s timeout;
3. record the result (a row of ``bench_results``: the HTTP status and the release id), whose
   ``recorded_at`` is PostgreSQL's ``clock_timestamp()`` just before that transaction commits,
   as our ``confirmed`` event's ``at`` is.

Targets and payloads are those ``bench/pipeline.py``'s agents use, intent ``i`` of a round:
``project-{i % 10}`` and ``{"version": "1.{i // 100}.{i % 100}"}``.
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from outbox import urls

#: What the parent tells a worker process, in its environment.
ENV_DATABASE = "BENCH_PEER_DATABASE_URL"  # libpq URL of the database holding bench_* tables
ENV_SYSTEM_DATABASE = "BENCH_PEER_SYSTEM_DATABASE_URL"  # DBOS's system database
ENV_SERVICE = "BENCH_PEER_SERVICE_URL"  # the reference service's base URL
ENV_BROKER = "BENCH_PEER_BROKER_URL"  # naive Celery's AMQP URL
ENV_CONCURRENCY = "BENCH_PEER_CONCURRENCY"  # jobs a worker process runs at once
ENV_WORKER = "BENCH_PEER_WORKER"  # the worker's number, 1..N
ENV_POLL = "BENCH_PEER_POLL_S"  # DBOS: the queue's polling interval

IDEMPOTENCY_HEADER = "Idempotency-Key"
HTTP_TIMEOUT_S = 30.0

TABLES_DDL = (
    """
    CREATE TABLE IF NOT EXISTS bench_intents (
        id uuid PRIMARY KEY,
        target text NOT NULL,
        payload jsonb NOT NULL,
        created_at timestamptz NOT NULL DEFAULT clock_timestamp()
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS bench_results (
        id uuid PRIMARY KEY,
        status integer NOT NULL,
        remote_ref text,
        recorded_at timestamptz NOT NULL DEFAULT clock_timestamp()
    )
    """,
)
TABLES = ("bench_intents", "bench_results")


def env(name: str) -> str:
    """A setting the parent must have given this worker process."""
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(f"{name} is not set: this module runs under bench/peers.py")
    return value


def target_for(i: int) -> str:
    """Intent ``i``'s target (as bench/pipeline.py's agents)."""
    return f"project-{i % 10}"


def payload_for(i: int) -> dict[str, Any]:
    """Intent ``i``'s payload (as bench/pipeline.py's agents)."""
    return {"version": f"1.{i // 100}.{i % 100}"}


def release_url(service_url: str, target: str) -> str:
    """Where a release for ``target`` is created."""
    return f"{service_url}/projects/{target}/releases"


def _outcome(response: httpx.Response) -> tuple[int, str | None]:
    ref: str | None = None
    if response.is_success:
        document = response.json()
        ref = str(document.get("id")) if isinstance(document, dict) else None
    return response.status_code, ref


def post_release(
    client: httpx.Client, service_url: str, key: str, target: str, payload: Any
) -> tuple[int, str | None]:
    """POST once; (HTTP status, the release id when it was created)."""
    response = client.post(
        release_url(service_url, target),
        json=payload,
        headers={IDEMPOTENCY_HEADER: key},
        timeout=HTTP_TIMEOUT_S,
    )
    return _outcome(response)


async def post_release_async(
    client: httpx.AsyncClient, service_url: str, key: str, target: str, payload: Any
) -> tuple[int, str | None]:
    """:func:`post_release` for an event loop."""
    response = await client.post(
        release_url(service_url, target),
        json=payload,
        headers={IDEMPOTENCY_HEADER: key},
        timeout=HTTP_TIMEOUT_S,
    )
    return _outcome(response)


def libpq_url(url: str) -> str:
    """``url`` as libpq and psycopg spell it (``postgresql://``, no SQLAlchemy driver; any
    outbox URL: :func:`outbox.urls.libpq_url`)."""
    return urls.libpq_url(url)


def sqlalchemy_url(url: str) -> str:
    """``url`` with SQLAlchemy's psycopg 3 driver (``postgresql+psycopg://``)."""
    return urls.sqlalchemy_url(url)
