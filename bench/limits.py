"""This machine's ceilings, measured side by side in one run: what the pipeline could at best do.

PostgreSQL (the raw driver, psycopg, no SQLAlchemy; rows shaped like ``outbox.operations``):

* ``INSERT+COMMIT``, one row per transaction, on 1 and on ``--connections`` connections;
  and on N connections into a table that also has ``outbox.operations``' CHECK constraints
  (the same row, so what the table's integrity checks cost a single-row insert).

Our own statements, as our code issues them (SQLAlchemy, ``outbox.sql``):

* ``enqueue()+COMMIT`` on one connection and on ``--connections`` connections (the agent's
  side), with no relay waiting on its bell and with one (then every enqueue NOTIFYs: what the
  doorbell costs); of a budgeted tool (docs/budgets.md: its key's lock and count) on 1
  connection and on N connections over N keys; and on one connection through a ``Session``
  that begins a transaction per intent, as an agent writes it (the Session checks a
  connection out of the pool each time);
* the ``sent`` compare-and-set: ``outbox.transitions.mark_sent`` planned→sent with
  ``synchronous_commit=on`` and its COMMIT, as the dispatcher makes it, on 1 and N connections;
* the advisory lock round trip: ``sql.locks.try_lock`` + ``sql.locks.unlock`` (autocommit);
* ``outbox.workers.locking.operation_lock`` entered and left, as ``dispatch()`` takes it (pool
  checkout with pre-ping, lock, commit, rollback, unlock_all, commit);
* ``outbox.workers.dispatch.dispatch()`` with a Python tool that does nothing: every statement a
  worker makes for one operation, without the broker or an HTTP call, on N threads.

RabbitMQ (a throw-away vhost; skipped when there is no RabbitMQ):

* kombu publish of persistent messages without confirms, then with ``confirm_publish``
  (each publish waits for its ack); and the relay's own publisher (``CeleryPublisher``:
  Celery's ``send_task``, batches of 200 with the confirms collected per batch).

The database as broker (the default with nothing configured): the relay's publisher on the
throw-away database, batches of 200 and of 1 (a steady trickle's batches); each batch is one
transaction since issue 35 (kombu's own transport committed every message).

The reference service (``DeployService`` in a process of its own, in-memory ledger, no
faults, no dedup: its fast configuration), POSTs with distinct keys from ``--clients``
keep-alive connections: through httpx (as the HTTP tool calls it), and through raw sockets
(almost no client cost, so the service's own ceiling), with the service's CPU use.

Usage: python bench/limits.py [--url postgresql://...] [--rounds 3] [--ops 2000] [--smoke]
       [--cases 'insert 1,enqueue 1']  (only these cases, by the names progress prints)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from uuid import UUID

import httpx
import sqlalchemy

# The bench directory is not a package: `python bench/limits.py` puts it on sys.path.
from arguments import add_common_arguments
from cpu import process_cpu_s
from report import Results, print_table, write_json
from rounds import Case, run_rounds
from services import ServiceProcess
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session
from throwaway import rabbitmq_available, server_settings, throwaway_database, throwaway_vhost

from outbox import api, sql, transitions
from outbox.budgets import Budget, publish_budgets_committed
from outbox.contracts import ContractTable
from outbox.db import create_engine
from outbox.locks import operation_lock_key

Rate = Mapping[str, tuple[float, str]]
PER_S = "/s"

#: The row enqueue() writes, as an application would insert it: the same columns and values,
#: bound as parameters, into a table shaped like ``outbox.operations`` (its indexes too;
#: ``{table}``: without its CHECK constraints, or with them).
_RAW_INSERT = (
    "INSERT INTO {table} (id, intent_key, tool, target, payload, payload_hash, intent_hash, "
    "metadata) VALUES (gen_random_uuid(), %s, %s, %s, %s::jsonb, %s, %s, %s::jsonb)"
)
_RAW_TABLE, _CHECKED_TABLE = "bench_raw", "bench_raw_checked"
#: Intents per enqueue_many() call in the batch case.
BATCH = 100


Setup = Callable[[contextlib.ExitStack], Callable[[int], None]]


def _in_threads(threads: int, ops: int, setup: Setup) -> float:
    """Run ``ops`` operations split over ``threads`` threads; operations per second.

    ``setup(stack)`` runs in each thread before the clock starts and returns ``op(i)``,
    called for this thread's share of ``i`` in ``range(ops)``; what it pushes on ``stack``
    (closing its connection) runs after every thread finished.
    """
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []
    stack = contextlib.ExitStack()

    def body(t: int) -> None:
        try:
            op = setup(stack)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()
            raise
        barrier.wait()
        try:
            for i in range(t, ops, threads):
                op(i)
        except BaseException as exc:
            errors.append(exc)
            raise

    workers = [threading.Thread(target=body, args=(t,), daemon=True) for t in range(threads)]
    with stack:
        for worker in workers:
            worker.start()
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait()
        started = time.perf_counter()
        for worker in workers:
            worker.join()
        elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"a benchmark thread failed: {errors[0]!r}") from errors[0]
    return ops / elapsed


class Limits:
    """The cases, sharing one throw-away database (and vhost, and service)."""

    def __init__(self, engine: Engine, args: argparse.Namespace) -> None:
        self.engine = engine
        self.args = args
        self.ops: int = args.ops
        self.connections: int = args.connections
        self._tag = 0
        with engine.begin() as conn:
            conn.execute(
                text(
                    f"CREATE TABLE {_RAW_TABLE} "
                    "(LIKE outbox.operations INCLUDING DEFAULTS INCLUDING INDEXES)"
                )
            )
            conn.execute(
                text(
                    f"CREATE TABLE {_CHECKED_TABLE} (LIKE outbox.operations "
                    "INCLUDING DEFAULTS INCLUDING INDEXES INCLUDING CONSTRAINTS)"
                )
            )

    # --- PostgreSQL -----------------------------------------------------------------------

    def insert_commit(self, connections: int, *, checked: bool = False) -> float:
        """Raw driver: the row enqueue() writes, one per transaction, a connection per thread.

        ``checked``: into a table with ``outbox.operations``' CHECK constraints too.
        """
        tag = self._next_tag()
        statement = _RAW_INSERT.format(table=_CHECKED_TABLE if checked else _RAW_TABLE)

        def setup(stack: contextlib.ExitStack) -> Callable[[int], None]:
            raw = self.engine.raw_connection()
            stack.callback(raw.close)
            conn = raw.driver_connection
            assert conn is not None  # noqa: S101

            def op(i: int) -> None:
                payload = f'{{"version":"1.0.{i}"}}'
                conn.execute(
                    statement,
                    (f"raw-{tag}-{i}", "bench.tool", "web", payload, "a" * 64, "b" * 64, "{}"),
                )
                conn.commit()

            return op

        return _in_threads(connections, self.ops, setup)

    def enqueue_budgeted_commit(self, connections: int, *, keys: int) -> float:
        """``outbox.enqueue`` + COMMIT of a budgeted tool (docs/budgets.md): a budget over
        ``bench.budgeted`` by ``requested_by`` too large to refuse anything, the threads
        spread over ``keys`` keys (1: every enqueue waits for the key's lock)."""
        tag = self._next_tag()
        with self.engine.begin() as conn:
            conn.execute(text("DELETE FROM outbox.relays"))
        publish_budgets_committed(
            self.engine,
            [Budget(name="bench", tools=("bench.budgeted",), window_s=3600, max_operations=10**9)],
        )

        def setup(stack: contextlib.ExitStack) -> Callable[[int], None]:
            conn = stack.enter_context(self.engine.connect())

            def op(i: int) -> None:
                with conn.begin():
                    api.enqueue(
                        conn,
                        tool="bench.budgeted",
                        target="web",
                        payload={"version": f"1.0.{i}"},
                        intent_key=f"budgeted-{tag}-{i}",
                        requested_by=f"agent-{i % keys}",
                    )

            return op

        return _in_threads(connections, self.ops, setup)

    def enqueue_commit(self, connections: int, *, bell: bool = False) -> float:
        """``outbox.enqueue`` + COMMIT, one intent per transaction, a connection per thread
        (as the raw case: a Session that checks a connection out per transaction adds the
        pool's own cost, whatever runs inside). ``bell``: a relay says it waits on its bell,
        so every enqueue NOTIFYs (a relay keeping up); else none does (a relay in a backlog,
        or none running)."""
        tag = self._next_tag()
        with self.engine.begin() as conn:
            conn.execute(text("DELETE FROM outbox.relays"))
            if bell:
                sql.relay.announce_relay(conn, "bench", pid=0, host="bench", idle=True)

        def setup(stack: contextlib.ExitStack) -> Callable[[int], None]:
            conn = stack.enter_context(self.engine.connect())

            def op(i: int) -> None:
                with conn.begin():
                    api.enqueue(
                        conn,
                        tool="bench.tool",
                        target="web",
                        payload={"version": f"1.0.{i}"},
                        intent_key=f"enqueue-{tag}-{i}",
                    )

            return op

        return _in_threads(connections, self.ops, setup)

    def enqueue_session_commit(self) -> float:
        """``outbox.enqueue`` + COMMIT on one thread, as an agent writes it (the README): its
        own engine (SQLAlchemy's defaults: no pre-ping), one ``Session``, ``session.begin()``
        per intent, so a pool checkout and checkin per intent."""
        tag = self._next_tag()

        def setup(stack: contextlib.ExitStack) -> Callable[[int], None]:
            agents = sqlalchemy.create_engine(self.engine.url, pool_size=1)
            stack.callback(agents.dispose)
            session = stack.enter_context(Session(agents))

            def op(i: int) -> None:
                with session.begin():
                    api.enqueue(
                        session,
                        tool="bench.tool",
                        target="web",
                        payload={"version": f"1.0.{i}"},
                        intent_key=f"session-{tag}-{i}",
                    )

            return op

        return _in_threads(1, self.ops, setup)

    def enqueue_many_commit(self, connections: int) -> float:
        """``outbox.enqueue_many`` of ``BATCH`` intents + COMMIT: intents per second."""
        tag = self._next_tag()
        batches = max(1, self.ops // BATCH)

        def setup(stack: contextlib.ExitStack) -> Callable[[int], None]:
            session = stack.enter_context(Session(self.engine))

            def op(b: int) -> None:
                with session.begin():
                    api.enqueue_many(
                        session,
                        [
                            api.Intent(
                                "bench.tool",
                                "web",
                                {"version": f"1.0.{b}.{i}"},
                                intent_key=f"many-{tag}-{b}-{i}",
                            )
                            for i in range(BATCH)
                        ],
                    )

            return op

        return _in_threads(connections, batches, setup) * BATCH

    def _planned_rows(self, tool: str) -> list[UUID]:
        """``ops`` fresh `planned` rows (not timed)."""
        tag = self._next_tag()
        with self.engine.begin() as conn:
            rows = conn.execute(
                text(
                    "INSERT INTO outbox.operations (intent_key, tool, target, payload, "
                    "payload_hash, intent_hash) SELECT :tag || '-' || g, :tool, 'web', "
                    "'{\"v\": 1}', :h, outbox.intent_hash(:tool, 'web', :h) "
                    "FROM generate_series(1, :n) g RETURNING id"
                ),
                # The payload and hashes dispatch() checks before sending.
                {"tag": f"rows-{tag}", "tool": tool, "n": self.ops, "h": _payload_hash({"v": 1})},
            )
            return [row.id for row in rows]

    def sent_cas(self, connections: int) -> float:
        """The dispatcher's `planned -> sent` compare-and-set, durably committed."""
        ids = self._planned_rows("bench.tool")

        def setup(stack: contextlib.ExitStack) -> Callable[[int], None]:
            conn = self.engine.connect()
            stack.callback(conn.close)

            def op(i: int) -> None:
                with conn.begin():
                    sql.locks.require_synchronous_commit(conn)
                    transitions.apply(
                        conn,
                        transitions.mark_sent(ids[i], attempt=0, reason="dispatching attempt 1"),
                    )

            return op

        return _in_threads(connections, self.ops, setup)

    def lock_round_trip(self) -> float:
        """``try_lock`` + ``unlock`` of a fresh key, autocommit: two round trips."""
        keys = [operation_lock_key(uuid.uuid4()) for _ in range(self.ops)]

        def setup(stack: contextlib.ExitStack) -> Callable[[int], None]:
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            stack.callback(conn.close)

            def op(i: int) -> None:
                if not sql.locks.try_lock(conn, keys[i]):
                    raise RuntimeError("an advisory lock nobody holds was busy")
                sql.locks.unlock(conn, keys[i])

            return op

        return _in_threads(1, self.ops, setup)

    def operation_lock(self) -> float:
        """``outbox.workers.locking.operation_lock`` entered and left, as dispatch() does it."""
        from outbox.workers.locking import operation_lock  # noqa: PLC0415 -- the workers layer

        ids = [uuid.uuid4() for _ in range(self.ops)]

        def setup(stack: contextlib.ExitStack) -> Callable[[int], None]:
            def op(i: int) -> None:
                with operation_lock(self.engine, ids[i]) as conn:
                    if conn is None:
                        raise RuntimeError("an operation lock nobody holds was busy")

            return op

        return _in_threads(1, self.ops, setup)

    def dispatch_noop(self, threads: int) -> float:
        """``dispatch()`` with a tool that returns Applied at once: the worker's DB path."""
        from outbox.tools.python import tool  # noqa: PLC0415
        from outbox.tools.registry import ToolRegistry  # noqa: PLC0415
        from outbox.tools.results import Applied, DispatchResult  # noqa: PLC0415
        from outbox.workers.dispatch import Outcome, dispatch  # noqa: PLC0415

        registry = ToolRegistry(contracts=ContractTable())

        @tool("bench.noop", registry=registry)
        def noop(call: Any) -> DispatchResult:
            return Applied(remote_ref=f"ref-{call.operation_id}")

        ids = self._planned_rows("bench.noop")

        def setup(stack: contextlib.ExitStack) -> Callable[[int], None]:
            def op(i: int) -> None:
                report = dispatch(ids[i], engine=self.engine, registry=registry)
                if report.outcome is not Outcome.CONFIRMED:
                    raise RuntimeError(f"dispatch() ended {report.outcome}: {report.detail}")

            return op

        return _in_threads(threads, self.ops, setup)

    def _next_tag(self) -> int:
        self._tag += 1
        return self._tag


def _payload_hash(payload: Any) -> str:
    from outbox.canonical import canonical_json, payload_hash  # noqa: PLC0415

    return payload_hash(canonical_json(payload))


# --- RabbitMQ -----------------------------------------------------------------------------

_BODY = [
    [],
    {
        "operation_id": "0190f1a2-0000-7000-8000-000000000000",
        "tool": "deploy.create_release",
        "target": "web",
    },
    {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
]


def kombu_publish(url: str, messages: int, *, confirm: bool) -> float:
    """Persistent messages to a durable queue, one after the other; messages per second.

    Without confirms the clock stops after a synchronous round trip on the same channel
    (a passive queue declare), so every message has reached the broker.
    """
    from kombu import Connection, Exchange, Producer, Queue  # noqa: PLC0415

    exchange = Exchange("bench", type="direct", durable=True)
    queue = Queue("bench", exchange, routing_key="bench", durable=True)
    options = {"confirm_publish": True} if confirm else {}
    with Connection(url, transport_options=options) as connection:
        channel = connection.channel()
        bound = queue(channel)
        bound.declare()
        producer = Producer(channel, exchange, routing_key="bench", serializer="json")
        producer.publish(_BODY, delivery_mode=2)  # the first publish opens what it needs
        started = time.perf_counter()
        for _ in range(messages):
            producer.publish(_BODY, delivery_mode=2)
        bound.queue_declare(passive=True)
        elapsed = time.perf_counter() - started
        bound.purge()
    return messages / elapsed


def relay_publisher(
    url: str, messages: int, batch: int = 200, *, database_url: str | None = None
) -> float:
    """The relay's publisher (Celery ``send_task``, confirms in flight per batch) on the
    broker at ``url``; with ``database_url`` instead, on that database as broker (one
    transaction per batch, issue 35), its messages deleted afterwards."""
    from celery import Celery  # noqa: PLC0415

    from outbox.config import load_settings  # noqa: PLC0415
    from outbox.workers.app import BROKER_MESSAGE_TABLE, celery_settings  # noqa: PLC0415
    from outbox.workers.publish import CeleryPublisher  # noqa: PLC0415

    app = Celery("bench-relay")
    settings = (
        load_settings(database_url=database_url)
        if database_url is not None
        else load_settings(broker_url=url)
    )
    app.conf.update(celery_settings(settings, deployment="bench-limits"))
    if database_url is not None:
        try:
            return _timed_publish(CeleryPublisher(app), messages, batch)
        finally:
            with create_engine(database_url).begin() as conn:
                conn.execute(text(f"DELETE FROM {BROKER_MESSAGE_TABLE}"))
    rate = _timed_publish(CeleryPublisher(app), messages, batch)
    with app.connection_for_write() as connection:
        channel = connection.default_channel
        for name in (app.amqp.queues["dispatch"].name, "celeryev"):
            with contextlib.suppress(Exception):
                channel.queue_purge(name)
    return rate


def _timed_publish(publisher: Any, messages: int, batch: int) -> float:
    """Messages per second through ``publisher`` (a ``CeleryPublisher``), in ``batch``es,
    after one publish that connects and declares; closed at the end."""
    from outbox.relay import OutboundMessage  # noqa: PLC0415

    try:
        out = [
            OutboundMessage(uuid.uuid4(), "deploy.create_release", "web")
            for _ in range(messages + 1)
        ]
        publisher.publish(out[:1])  # connect, declare, confirm mode
        started = time.perf_counter()
        for i in range(1, len(out), batch):
            chunk = out[i : i + batch]
            confirmed = publisher.publish(chunk)
            if len(confirmed) != len(chunk):
                raise RuntimeError(f"{len(chunk) - len(confirmed)} messages not confirmed")
        return messages / (time.perf_counter() - started)
    finally:
        publisher.close()


# --- the reference service ----------------------------------------------------------------

_PATH = "/projects/web/releases"
_JSON = b'{"version": "1.0.0"}'


def _httpx_client(url: str, stack: contextlib.ExitStack) -> Callable[[int], None]:
    client = stack.enter_context(httpx.Client(base_url=url, timeout=30))

    def op(_i: int) -> None:
        response = client.post(_PATH, content=_JSON, headers={"Idempotency-Key": uuid.uuid4().hex})
        if response.status_code != 201:
            raise RuntimeError(f"the service answered {response.status_code}")

    op(0)  # open the keep-alive connection before the clock starts
    return op


class _RawClient:
    """HTTP/1.1 over one keep-alive socket, the request prebuilt: next to no client cost."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.head = (
            f"POST {_PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(_JSON)}\r\nIdempotency-Key: "
        ).encode()
        self.buffer = b""

    def post(self, _i: int) -> None:
        self.sock.sendall(self.head + uuid.uuid4().hex.encode() + b"\r\n\r\n" + _JSON)
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head, _, rest = self.buffer.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 201"):
            raise RuntimeError(f"the service answered {head[:40]!r}")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(rest) < length:
            rest += self._recv()
        self.buffer = rest[length:]

    def _read(self) -> None:
        self.buffer += self._recv()

    def _recv(self) -> bytes:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise RuntimeError("the service closed the connection")
        return chunk

    def close(self) -> None:
        self.sock.close()


def service_ceiling(service: ServiceProcess, clients: int, requests: int, *, raw: bool) -> Rate:
    """POSTs with distinct keys from ``clients`` keep-alive connections; requests/s and the
    service's CPU use (% of one core) meanwhile."""

    def setup(stack: contextlib.ExitStack) -> Callable[[int], None]:
        if not raw:
            return _httpx_client(service.url, stack)
        client = _RawClient(service.url)
        stack.callback(client.close)
        client.post(0)
        return client.post

    service.clear()
    cpu_before, wall_before = process_cpu_s(service.pid), time.perf_counter()
    rate = _in_threads(clients, requests, setup)
    wall = time.perf_counter() - wall_before
    cpu = process_cpu_s(service.pid) - cpu_before
    kind = "raw sockets" if raw else "httpx"
    service.clear()
    return {
        f"service ceiling, {kind}, {clients} connections": (rate, PER_S),
        f"service CPU meanwhile ({kind})": (100 * cpu / wall, "% core"),
        # Includes what setup cost it (a request per connection): a slight overestimate.
        f"service CPU per request ({kind})": (1e6 * cpu / (requests + clients), "us"),
    }


# --- the run ------------------------------------------------------------------------------


def _cases(
    limits: Limits, broker_url: str | None, service: ServiceProcess, args: argparse.Namespace
) -> list[Case]:
    n = args.connections

    def one(name: str, measure: Callable[[], float]) -> Callable[[], Rate]:
        return lambda: {name: (measure(), PER_S)}

    pg, ours, rabbit, http = "PostgreSQL (psycopg)", "our statements", "RabbitMQ", "service"
    cases = [
        Case("insert 1", one("INSERT+COMMIT, 1 connection", lambda: limits.insert_commit(1)), pg),
        Case(
            "insert n",
            one(f"INSERT+COMMIT, {n} connections", lambda: limits.insert_commit(n)),
            pg,
        ),
        Case(
            "insert checked n",
            one(
                f"INSERT+COMMIT, CHECK constraints too, {n} connections",
                lambda: limits.insert_commit(n, checked=True),
            ),
            pg,
        ),
        Case(
            "enqueue 1",
            one("enqueue()+COMMIT, 1 connection", lambda: limits.enqueue_commit(1)),
            ours,
        ),
        Case(
            "enqueue budgeted 1",
            one(
                "enqueue()+COMMIT of a budgeted tool, 1 connection",
                lambda: limits.enqueue_budgeted_commit(1, keys=1),
            ),
            ours,
        ),
        Case(
            "enqueue budgeted n",
            one(
                f"enqueue()+COMMIT of a budgeted tool, {n} connections, {n} keys",
                lambda: limits.enqueue_budgeted_commit(n, keys=n),
            ),
            ours,
        ),
        Case(
            "enqueue session 1",
            one(
                "enqueue()+COMMIT, a Session's transaction per intent, 1 thread",
                limits.enqueue_session_commit,
            ),
            ours,
        ),
        Case(
            "enqueue n",
            one(f"enqueue()+COMMIT, {n} connections", lambda: limits.enqueue_commit(n)),
            ours,
        ),
        Case(
            "enqueue bell n",
            one(
                f"enqueue()+COMMIT, bell ringing, {n} connections",
                lambda: limits.enqueue_commit(n, bell=True),
            ),
            ours,
        ),
        Case(
            "enqueue_many n",
            one(
                f"enqueue_many({BATCH})+COMMIT, {n} connections, intents",
                lambda: limits.enqueue_many_commit(n),
            ),
            ours,
        ),
        Case("cas 1", one("sent CAS+COMMIT, 1 connection", lambda: limits.sent_cas(1)), ours),
        Case("cas n", one(f"sent CAS+COMMIT, {n} connections", lambda: limits.sent_cas(n)), ours),
        Case("lock", one("try_lock+unlock, 1 connection", limits.lock_round_trip), ours),
        Case("oplock", one("operation_lock() in+out, 1 thread", limits.operation_lock), ours),
        Case(
            "dispatch",
            one(f"dispatch(), no-op tool, {n} threads", lambda: limits.dispatch_noop(n)),
            ours,
        ),
    ]
    if broker_url is not None:
        messages = args.messages
        cases += [
            Case(
                "publish",
                one(
                    "kombu publish, no confirms",
                    lambda: kombu_publish(broker_url, messages, confirm=False),
                ),
                rabbit,
            ),
            Case(
                "publish confirm",
                one(
                    "kombu publish, confirm each",
                    lambda: kombu_publish(broker_url, messages, confirm=True),
                ),
                rabbit,
            ),
            Case(
                "relay publisher",
                one(
                    "relay publisher, batches of 200, confirms in flight",
                    lambda: relay_publisher(broker_url, messages),
                ),
                rabbit,
            ),
        ]
    database_url = limits.engine.url.render_as_string(hide_password=False)
    messages = args.messages
    cases += [
        Case(
            f"db publisher {size}",
            one(
                f"relay publisher, database broker, batches of {size}",
                functools.partial(relay_publisher, "", messages, size, database_url=database_url),
            ),
            "the database as broker",
        )
        for size in (200, 1)
    ]
    requests, clients = args.requests, args.clients
    cases += [
        Case(
            "service httpx",
            lambda: service_ceiling(service, clients, requests, raw=False),
            http,
        ),
        Case("service raw", lambda: service_ceiling(service, clients, requests, raw=True), http),
    ]
    return cases


def _ratios(results: Results, n: int, clients: int) -> None:
    results.ratio(
        f"INSERT+COMMIT: {n} connections / 1",
        f"INSERT+COMMIT, {n} connections",
        "INSERT+COMMIT, 1 connection",
    )
    results.ratio(
        "enqueue() / raw INSERT (1 connection)",
        "enqueue()+COMMIT, 1 connection",
        "INSERT+COMMIT, 1 connection",
    )
    results.ratio(
        "enqueue(): a Session per intent / a held Connection (1)",
        "enqueue()+COMMIT, a Session's transaction per intent, 1 thread",
        "enqueue()+COMMIT, 1 connection",
    )
    results.ratio(
        f"enqueue() / raw INSERT ({n} connections)",
        f"enqueue()+COMMIT, {n} connections",
        f"INSERT+COMMIT, {n} connections",
    )
    results.ratio(
        f"raw INSERT: CHECK constraints too / without ({n} connections)",
        f"INSERT+COMMIT, CHECK constraints too, {n} connections",
        f"INSERT+COMMIT, {n} connections",
    )
    results.ratio(
        f"enqueue() / raw INSERT, CHECK constraints too ({n} connections)",
        f"enqueue()+COMMIT, {n} connections",
        f"INSERT+COMMIT, CHECK constraints too, {n} connections",
    )
    results.ratio(
        f"enqueue(), bell ringing / not ({n} connections)",
        f"enqueue()+COMMIT, bell ringing, {n} connections",
        f"enqueue()+COMMIT, {n} connections",
    )
    results.ratio(
        f"enqueue_many({BATCH}) / raw INSERT ({n} connections), per intent",
        f"enqueue_many({BATCH})+COMMIT, {n} connections, intents",
        f"INSERT+COMMIT, {n} connections",
    )
    results.ratio(
        "sent CAS / raw INSERT (1 connection)",
        "sent CAS+COMMIT, 1 connection",
        "INSERT+COMMIT, 1 connection",
    )
    results.ratio(
        f"sent CAS / raw INSERT ({n} connections)",
        f"sent CAS+COMMIT, {n} connections",
        f"INSERT+COMMIT, {n} connections",
    )
    results.ratio(
        f"dispatch() / sent CAS ({n})",
        f"dispatch(), no-op tool, {n} threads",
        f"sent CAS+COMMIT, {n} connections",
    )
    results.ratio(
        "publish: confirm each / no confirms",
        "kombu publish, confirm each",
        "kombu publish, no confirms",
    )
    results.ratio(
        "publish: relay publisher / kombu no confirms",
        "relay publisher, batches of 200, confirms in flight",
        "kombu publish, no confirms",
    )
    results.ratio(
        "service: httpx / raw sockets",
        f"service ceiling, httpx, {clients} connections",
        f"service ceiling, raw sockets, {clients} connections",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--ops", type=int, default=2000, help="operations per database case")
    parser.add_argument("--connections", type=int, default=8, help="the 'N connections' cases")
    parser.add_argument("--messages", type=int, default=5000, help="messages per AMQP case")
    parser.add_argument("--requests", type=int, default=5000, help="requests per service case")
    parser.add_argument("--clients", type=int, default=16, help="service connections")
    parser.add_argument("--broker-url", help="an AMQP URL to use as it is (no vhost is made)")
    parser.add_argument(
        "--cases",
        type=lambda value: [name.strip() for name in value.split(",") if name.strip()],
        help="only these cases, comma-separated, by the names the progress lines print "
        "(default: all)",
    )
    args = parser.parse_args(argv)
    logging.getLogger("amqp").setLevel(logging.ERROR)  # acks arriving while a channel closes
    if args.smoke:
        args.rounds, args.ops, args.messages, args.requests = 1, 100, 200, 300
    use_rabbitmq = bool(args.broker_url) or rabbitmq_available()
    results = Results(
        f"limits: {args.rounds} rounds, {args.ops} database operations, {args.messages} "
        f"messages, {args.requests} requests per case"
    )
    with contextlib.ExitStack() as stack:
        db_url = stack.enter_context(throwaway_database(args.url))
        engine = create_engine(db_url, pool_size=args.connections + 4, max_overflow=8)
        stack.callback(engine.dispose)
        limits = Limits(engine, args)
        broker_url = stack.enter_context(_maybe_vhost(use_rabbitmq, args.broker_url))
        service = stack.enter_context(ServiceProcess(port=0))
        cases = _cases(limits, broker_url, service, args)
        if args.cases:
            unknown = sorted(set(args.cases) - {case.name for case in cases})
            if unknown:
                parser.error(f"unknown case(s): {', '.join(unknown)}")
            cases = [case for case in cases if case.name in args.cases]
        run_rounds(args.rounds, cases, results)
    _ratios(results, args.connections, args.clients)
    results.target(
        "enqueue() >= 0.8x a raw INSERT+COMMIT (1 connection)",
        "enqueue() / raw INSERT (1 connection)",
        at_least=0.8,
    )
    results.target(
        f"enqueue() >= 0.8x a raw INSERT+COMMIT ({args.connections} connections)",
        f"enqueue() / raw INSERT ({args.connections} connections)",
        at_least=0.8,
    )
    if not use_rabbitmq:
        results.note("RabbitMQ rows skipped: no RabbitMQ on 127.0.0.1:5672 (or no rabbitmqctl)")
    results.note(
        "Medians over rounds; ratios are computed within each round, then their median. "
        "Every client and server shares this machine's cores."
    )
    results.note(server_settings(args.url))
    print_table(results)
    write_json(args.json, [results], vars(args))
    return 0


@contextlib.contextmanager
def _maybe_vhost(use: bool, configured: str | None) -> Iterator[str | None]:
    if not use:
        yield None
        return
    with throwaway_vhost(configured) as url:
        yield url


if __name__ == "__main__":
    sys.exit(main())
