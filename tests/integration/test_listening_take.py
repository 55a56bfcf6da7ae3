"""RabbitMQ workers that take due operations themselves while a thread is free
(``outbox.workers.listening``): the taker on its LISTEN connection, its idle flag, the message
it hands to Celery, and the relay's deferral to it. Real PostgreSQL, Celery's own message
building, kombu's own event loop; the full worker is in tests/acceptance/test_handoff_processes.py
and the kill matrix."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from kombu.asynchronous import Hub
from kombu.message import Message
from kombu.serialization import loads
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import api, sql
from outbox.doorbell import libpq_url
from outbox.relay import Relay, RelayConfig
from outbox.workers import listening
from outbox.workers.app import DISPATCH_TASK, LOOKUP_TASK, task_queues
from outbox.workers.direct import DirectDispatch, dispatch_queue, taker_name
from outbox.workers.listening import (
    BACKLOG_AFTER_TAKES,
    BUSY_AFTER_TAKES,
    BUSY_GRACE_S,
    Capture,
    ListeningTaker,
    Loop,
    NoBroker,
    task_sent_forwarder,
)
from outbox.workers.publish import CeleryPublisher
from tests.processes import wait_for_session_end

REPUBLISH_AFTER_S = 30.0
DEFER_S = 0.2
#: Operations one message of a take through a backlog names, in these tests.
OPS_PER_MESSAGE = 4


def _app(broker_url: str) -> Celery:
    """A Celery app on RabbitMQ with a deployment's queues of its own (nothing is sent: the
    take's message is built, not published)."""
    deployment = f"listening{uuid.uuid4().hex[:8]}"
    app = Celery("listening-test", broker=broker_url, set_as_current=False)
    app.conf.update(
        task_queues=task_queues(deployment),
        task_routes={DISPATCH_TASK: {"queue": "dispatch"}, LOOKUP_TASK: {"queue": "lookup"}},
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
    )
    return app


class Slots:
    """A pool's free slots, as the test says."""

    def __init__(self) -> None:
        self.free = True

    def __call__(self) -> bool:
        return self.free


#: A taker, the messages it delivered, its pool's slots.
Taker = tuple[ListeningTaker, list[Message], Slots]


@pytest.fixture
def app(rabbitmq_url: str) -> Celery:
    return _app(rabbitmq_url)


@pytest.fixture
def own_engine(database_url: str) -> Iterator[Engine]:
    """The taker's own engine, as a worker's (no pool)."""
    engine = create_engine(database_url, poolclass=NullPool)
    yield engine
    engine.dispose()


def _source(app: Celery) -> DirectDispatch:
    """A RabbitMQ worker's source of takes, as a starting worker makes it."""
    return DirectDispatch(
        app,
        dispatch_queue(app),
        REPUBLISH_AFTER_S,
        ops_per_message=OPS_PER_MESSAGE,
        name=taker_name(sql.relay.LISTENING_TAKER_PREFIX),
    )


@pytest.fixture
def taker(app: Celery, own_engine: Engine, engine: Engine) -> Iterator[Taker]:
    delivered: list[Message] = []
    slots = Slots()
    source = _source(app)
    taker = ListeningTaker(source, deliver=delivered.append, has_free_slot=slots, engine=own_engine)
    yield taker, delivered, slots
    taker.close()


def _enqueue(engine: Engine, count: int = 1) -> list[str]:
    with Session(engine) as session, session.begin():
        return [
            str(api.enqueue(session, tool="deploy.create", target=f"t{i}", payload={"i": i}).id)
            for i in range(count)
        ]


def _flags(engine: Engine) -> dict[str, bool]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT name, idle FROM outbox.relays"))
        return {str(name): bool(idle) for name, idle in rows}


def _published(engine: Engine) -> dict[str, bool]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id::text, published_at IS NOT NULL FROM outbox.operations")
        )
        return {str(op_id): bool(stamped) for op_id, stamped in rows}


def _readable(fd: int, timeout: float = 5.0) -> bool:
    ready, _, _ = select.select([fd], [], [], timeout)
    return bool(ready)


def _operation_id(message: Message) -> str:
    args, kwargs, _ = loads(message.body, message.content_type, message.content_encoding)
    assert args == []
    return str(kwargs["operation_id"])


def _operation_ids(message: Message) -> list[str]:
    """The operations a message names (one, or a batch's)."""
    _, kwargs, _ = loads(message.body, message.content_type, message.content_encoding)
    if "operation_ids" in kwargs:
        return [str(op_id) for op_id in kwargs["operation_ids"]]
    return [str(kwargs["operation_id"])]


def _relay_claim(engine: Engine, *, defer_s: float = DEFER_S) -> list[str]:
    """The relay's claim, committed (its deferral to waiting workers on)."""
    with engine.begin() as conn:
        claimed = sql.relay.claim_and_mark_due(
            conn,
            limit=10,
            republish_after_s=REPUBLISH_AFTER_S,
            defer_to_takers_s=defer_s,
            takers_heartbeat_within_s=30.0,
        )
    return [str(c.id) for c in claimed]


def _flag(engine: Engine, name: str, *, idle: bool, age_s: float = 0.0) -> None:
    with engine.begin() as conn:
        sql.relay.announce_relay(conn, name, pid=1, host="elsewhere", idle=idle)
        conn.execute(
            text(
                "UPDATE outbox.relays SET heartbeat_at = clock_timestamp()"
                " - make_interval(secs => :age) WHERE name = :name"
            ),
            {"age": age_s, "name": name},
        )


# --- the relay's deferral -----------------------------------------------------------------


def test_the_relay_leaves_a_fresh_row_to_a_waiting_worker_then_claims_it(engine: Engine) -> None:
    """While a RabbitMQ worker's flag says it waits for work, the relay claims a row never
    published only once it has been due for the deferral; afterwards it does."""
    _flag(engine, f"listening-taker:elsewhere:1:{uuid.uuid4().hex[:8]}", idle=True)
    [op_id] = _enqueue(engine)
    assert _relay_claim(engine) == []
    time.sleep(DEFER_S + 0.05)
    assert _relay_claim(engine) == [op_id]


@pytest.mark.parametrize(
    ("name", "idle", "age_s"),
    [
        pytest.param("listening-taker:elsewhere:1:busy", False, 0.0, id="its-flag-down"),
        pytest.param("listening-taker:elsewhere:1:dead", True, 60.0, id="its-heartbeat-stale"),
        pytest.param("taker:elsewhere:1:database-broker", True, 0.0, id="a-database-broker-taker"),
        pytest.param("elsewhere:1:another-relay", True, 0.0, id="another-relay"),
    ],
)
def test_the_relay_claims_at_once_when_no_worker_waits(
    engine: Engine, name: str, idle: bool, age_s: float
) -> None:
    """A busy worker (flag down), a dead one (no heartbeat for 30 s), a database broker's
    taker (the relay stands by for those in its own way) or a relay: nothing is deferred."""
    _flag(engine, name, idle=idle, age_s=age_s)
    [op_id] = _enqueue(engine)
    assert _relay_claim(engine) == [op_id]


def test_the_take_statement_defers_to_nobody(engine: Engine) -> None:
    """The worker's own take claims a fresh row at once, whatever flags are up."""
    _flag(engine, f"listening-taker:elsewhere:1:{uuid.uuid4().hex[:8]}", idle=True)
    [op_id] = _enqueue(engine)
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        taken = sql.relay.take_due(conn, limit=1, republish_after_s=REPUBLISH_AFTER_S)
    assert [str(c.id) for c in taken.claimed] == [op_id]


# --- the taker ----------------------------------------------------------------------------


def test_a_worker_with_a_free_thread_takes_what_enqueue_rang_for(
    taker: Taker, engine: Engine
) -> None:
    """Opened, it raises its flag; enqueue rings its socket; it takes the row (stamped
    published) and hands Celery the dispatch message the relay would have published."""
    worker, delivered, _ = taker
    fd = worker.open()
    assert _flags(engine) == {worker.direct.name: True}
    ids = _enqueue(engine, 2)
    assert _readable(fd), "enqueue's bell did not ring the worker's socket"
    worker.on_readable()
    assert [_operation_id(m) for m in delivered] == ids
    assert _published(engine) == dict.fromkeys(ids, True)
    message = delivered[0]
    assert message.headers["task"] == DISPATCH_TASK
    assert message.delivery_info["routing_key"] == worker.direct.queue
    assert message.content_type == "application/json"
    message.ack()  # no broker holds it: nothing to acknowledge, nothing raised
    assert message.acknowledged
    delivered[1].reject()
    assert _flags(engine) == {worker.direct.name: True}


def test_what_was_due_before_the_worker_listened_is_taken_when_it_opens(
    taker: Taker, engine: Engine
) -> None:
    """Rows committed before its LISTEN rang nobody: the opening take finds them."""
    worker, delivered, _ = taker
    ids = _enqueue(engine, 3)
    worker.open()
    assert [_operation_id(m) for m in delivered] == ids


def test_a_busy_worker_takes_nothing_lowers_its_flag_and_rings_the_relay(
    taker: Taker, engine: Engine, database_url: str
) -> None:
    """Every slot taken: rung, the worker takes nothing, lowers its flag and rings the
    relays' own channel; a relay then stands by (the worker will take as its slots free).
    A slot freed, the worker's next look takes what waits, several operations in one
    message; once a look finds nothing past the grace, the flag goes up again and the worker
    takes what enqueue rings for, one at a time."""
    worker, delivered, slots = taker
    fd = worker.open()
    with psycopg.connect(libpq_url(database_url), autocommit=True) as relay_bell:
        relay_bell.execute("LISTEN outbox_relay")
        slots.free = False
        [first] = _enqueue(engine)
        assert _readable(fd)
        worker.on_readable()
        assert delivered == []
        assert _flags(engine) == {worker.direct.name: False}
        rang = list(relay_bell.notifies(timeout=2.0, stop_after=1))
        assert [n.channel for n in rang] == ["outbox_relay"], "the relay was not rung"
    with engine.connect() as conn:
        assert sql.relay.takers(conn, heartbeat_within_s=30).live, "a relay would claim"
    # A slot frees while rows wait: the worker takes them, in one message.
    second, third = _enqueue(engine, 2)
    slots.free = True
    worker.tick()
    assert [_operation_ids(m) for m in delivered] == [[first, second, third]]
    assert _flags(engine) == {worker.direct.name: False}
    assert _relay_claim(engine) == []
    time.sleep(BUSY_GRACE_S)
    worker.tick()
    assert _flags(engine) == {worker.direct.name: True}
    [fourth] = _enqueue(engine)
    assert _readable(fd)
    worker.on_readable()
    assert [_operation_ids(m) for m in delivered[1:]] == [[fourth]]


def test_a_worker_s_tick_takes_a_row_no_commit_rang_for(taker: Taker, engine: Engine) -> None:
    """A row stamped by a worker that died (published longer than republish_after ago) rings
    nobody: the next tick of a waiting worker takes it."""
    worker, delivered, _ = taker
    worker.open()
    [op_id] = _enqueue(engine)
    with engine.begin() as conn:  # as a worker that took it and died a while ago left it
        conn.execute(text("UPDATE outbox.operations SET published_at = now() - interval '1 hour'"))
    worker.tick()
    assert [_operation_id(m) for m in delivered] == [op_id]


def test_a_closed_worker_leaves_no_flag(taker: Taker, engine: Engine) -> None:
    worker, _, _ = taker
    worker.open()
    assert _flags(engine) == {worker.direct.name: True}
    worker.close()
    assert _flags(engine) == {}
    assert not worker.listening


def test_another_publish_goes_to_the_forwarder_not_the_take() -> None:
    """Celery's ``task-sent`` event published beside the take's message is forwarded."""
    forwarded: list[Any] = []
    capture = Capture(forward=lambda body, **_: forwarded.append(body))
    with capture.capture("outbox.x.dispatch") as captured:
        capture.publish({"type": "task-sent"}, routing_key="task.sent", serializer="json")
        capture.publish({"k": 1}, routing_key="outbox.x.dispatch", serializer="json")
    assert forwarded == [{"type": "task-sent"}]
    assert [loads(m.body, m.content_type, m.content_encoding) for m in captured] == [{"k": 1}]


# --- on kombu's event loop ----------------------------------------------------------------


def _run_hub(hub: Hub, stop: threading.Event) -> None:
    while not stop.is_set():
        hub.run_once()


@contextlib.contextmanager
def _running(worker: ListeningTaker) -> Iterator[Loop]:
    """``worker`` on a kombu hub of its own, run by a thread as Celery's event loop is."""
    hub = Hub()
    loop = Loop(worker, hub)
    stop = threading.Event()
    loop.start()
    thread = threading.Thread(target=_run_hub, args=(hub, stop), daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        stop.set()
        hub.call_soon(lambda: None)  # wake the loop
        thread.join(timeout=5)
        loop.stop()
        hub.close()


def test_on_the_event_loop_a_lost_connection_is_opened_again(taker: Taker, engine: Engine) -> None:
    """The database ends the taker's session (a restart): the loop drops the socket, opens
    a new connection with backoff, raises the flag again and takes what is due."""
    worker, delivered, _ = taker
    with _running(worker):
        first = _enqueue(engine)
        _wait(lambda: len(delivered) == 1, "the first operation taken on the loop")
        with engine.connect() as conn:
            ended = conn.execute(
                text("SELECT pg_terminate_backend(:pid)"), {"pid": _backend_pid(worker)}
            ).scalar_one()
        assert ended, "the taker's session was not ended"
        second = _enqueue(engine)
        _wait(lambda: len(delivered) == 2, "the second operation taken after the reconnect")
        assert [_operation_id(m) for m in delivered] == first + second
        assert _flags(engine) == {worker.direct.name: True}


def test_on_the_event_loop_a_settled_task_wakes_a_busy_worker_to_take(
    app: Celery, own_engine: Engine, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the flag is down, a taken message's ack (its task settled, on a pool thread)
    wakes the loop, which takes what waits for the freed slot at once, not at the next look
    (pushed out of the test's reach here)."""
    monkeypatch.setattr(listening, "TICK_S", 60.0)
    monkeypatch.setattr(listening, "BUSY_CHECK_S", 60.0)
    delivered: list[Message] = []
    slots = Slots()
    slots.free = False
    source = _source(app)

    def settle() -> None:  # what the worker's own wiring calls (its loop is made below)
        loop.settled()

    channel = NoBroker(settle)
    worker = ListeningTaker(
        source,
        deliver=delivered.append,
        has_free_slot=slots,
        engine=own_engine,
        capture=Capture(channel=channel),
    )
    waiting = _enqueue(engine, 3)
    try:
        with _running(worker) as loop:  # every slot busy: the flag goes down, nothing taken
            _wait(lambda: _flags(engine) == {source.name: False}, "the busy worker's flag down")
            slots.free = True
            time.sleep(0.3)
            assert delivered == [], "taken with no word from a settled task"
            pool_thread = threading.Thread(target=channel.basic_ack, args=(1,))
            pool_thread.start()
            pool_thread.join()
            _wait(lambda: len(delivered) == 1, "the waiting operations taken for the freed slot")
            assert _operation_ids(delivered[0]) == waiting
    finally:
        worker.close()


def _backend_pid(worker: ListeningTaker) -> int:
    """The server process of the taker's connection (read on the loop's thread: a pid)."""
    conn = worker._conn
    assert conn is not None
    driver = conn.connection.driver_connection
    assert isinstance(driver, psycopg.Connection)
    return int(driver.info.backend_pid)


def _wait(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_take_s_task_sent_event_reaches_flower_s_exchange(
    app: Celery, own_engine: Engine, engine: Engine
) -> None:
    """With task events on (RabbitMQ's default), the ``task-sent`` event Celery builds beside
    the take's message is sent by the worker's event dispatcher, as the relay's publish
    would have sent it: Flower sees the task from its first state."""
    app.conf.task_send_sent_event = True
    events: list[dict[str, Any]] = []
    with app.connection_for_read() as conn, app.connection_for_write() as out:
        receiver = app.events.Receiver(conn, handlers={"task-sent": events.append})
        dispatcher = app.events.Dispatcher(out, enabled=True)
        source = DirectDispatch(
            app,
            dispatch_queue(app),
            REPUBLISH_AFTER_S,
            name=taker_name(sql.relay.LISTENING_TAKER_PREFIX),
        )
        delivered: list[Message] = []
        worker = ListeningTaker(
            source,
            deliver=delivered.append,
            has_free_slot=lambda: True,
            engine=own_engine,
            capture=Capture(forward=task_sent_forwarder(dispatcher)),
        )
        with receiver.consumer_context() as (connection, _, _):
            [op_id] = _enqueue(engine)
            try:
                worker.open()
            finally:
                worker.close()
            deadline = time.monotonic() + 5
            while not events and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError, socket.timeout):
                    connection.drain_events(timeout=0.5)
    assert [_operation_id(m) for m in delivered] == [op_id]
    [event] = events
    assert event["name"] == DISPATCH_TASK
    assert event["uuid"] == delivered[0].headers["id"]
    assert event["queue"] == source.queue


# --- the relay beside waiting workers -------------------------------------------------------


def test_a_relay_beside_a_waiting_worker_hears_its_ring_not_enqueue_s(
    app: Celery, engine: Engine
) -> None:
    """A running relay that sees a RabbitMQ worker's flag up lowers its own flag and stops
    hearing enqueue's bell: a fresh row is left to the worker for the deferral, then claimed.
    When the worker's flag goes down (it carries a backlog) and it rings the relays'
    channel, the relay stands by at once: it claims a fresh row only once it has been due
    the standby hold-back."""
    name = f"listening-taker:elsewhere:1:{uuid.uuid4().hex[:8]}"
    _flag(engine, name, idle=True)
    publisher = CeleryPublisher(app)
    config = RelayConfig(poll_interval_s=0.2, defer_to_takers_s=1.0, standby_hold_back_s=2.0)
    relay = Relay(engine, publisher, config)
    runner = threading.Thread(target=relay.run_forever, daemon=True)
    runner.start()
    try:
        _wait(lambda: relay.deferring, "the relay deferring to the waiting worker")
        _wait(lambda: _flags(engine).get(relay.name) is False, "the relay's flag down")
        [left] = _enqueue(engine)
        time.sleep(0.5)
        assert _published(engine) == {left: False}, "claimed inside the deferral"
        _wait(lambda: _published(engine)[left], "the row claimed once the deferral passed")
        # The worker goes busy: its flag goes down, it rings the relays.
        _flag(engine, name, idle=False)
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            sql.relay.ring_relays(conn)
        _wait(lambda: relay.standing_by and not relay.deferring, "the relay standing by", 2.0)
        [held] = _enqueue(engine)
        time.sleep(1.0)
        assert not _published(engine)[held], "claimed inside the standby hold-back"
        _wait(lambda: _published(engine)[held], "the row claimed after the hold-back", 5.0)
    finally:
        relay.stop()
        runner.join(10)
    assert not runner.is_alive()


def test_through_a_backlog_a_worker_lowers_its_flag_and_takes_as_slots_free(
    taker: Taker, engine: Engine
) -> None:
    """Takes that keep leaving more due make a backlog: after a few the worker's flag goes
    down (enqueue stops ringing, a relay stands by) and it takes on while a slot is free, up
    to ops_per_message operations per message; with every slot busy it takes nothing. Once a
    take finds nothing and none found any within the grace, the flag goes up again."""
    worker, delivered, slots = taker
    ids = _enqueue(engine, BACKLOG_AFTER_TAKES + OPS_PER_MESSAGE + 2)
    worker.open()
    assert [_operation_ids(m) for m in delivered] == [[i] for i in ids[:BACKLOG_AFTER_TAKES]]
    assert _flags(engine) == {worker.direct.name: False}
    # Every slot busy: rung or not, nothing is taken.
    slots.free = False
    [late] = _enqueue(engine)
    worker.on_readable()
    worker.tick()
    assert len(delivered) == BACKLOG_AFTER_TAKES
    # A slot frees: the rest, in full messages, then the flag stays down for the grace.
    slots.free = True
    worker.tick()
    rest = [*ids[BACKLOG_AFTER_TAKES:], late]
    assert [_operation_ids(m) for m in delivered[BACKLOG_AFTER_TAKES:]] == [
        rest[:OPS_PER_MESSAGE],
        rest[OPS_PER_MESSAGE:],
    ]
    assert _relay_claim(engine) == []
    worker.tick()
    assert _flags(engine) == {worker.direct.name: False}
    time.sleep(BUSY_GRACE_S)
    worker.tick()
    assert _flags(engine) == {worker.direct.name: True}


def test_a_stream_of_rings_lowers_the_flag_until_the_looks_find_nothing(
    taker: Taker, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Operations rung for one at a time, BUSY_AFTER_TAKES of them within BUSY_WINDOW_S
    (flat out): the flag goes down, so enqueue stops ringing (its NOTIFY serialises the
    agents' commits), and the relay carries the stream. (The window is widened so that a
    slow machine's enqueues still count as a stream.)"""
    monkeypatch.setattr(listening, "BUSY_WINDOW_S", 60.0)
    worker, delivered, _ = taker
    fd = worker.open()
    for _ in range(BUSY_AFTER_TAKES):
        _enqueue(engine)
        assert _readable(fd), "enqueue's bell did not ring the worker's socket"
        worker.on_readable()
    assert len(delivered) == BUSY_AFTER_TAKES
    assert _flags(engine) == {worker.direct.name: False}


@pytest.mark.parametrize(("idle", "live", "waiting"), [(True, False, True), (False, True, False)])
def test_a_relay_defers_to_a_waiting_worker_and_stands_by_for_a_busy_one(
    engine: Engine, idle: bool, live: bool, waiting: bool
) -> None:
    """A RabbitMQ worker's flag up: it waits for work (a relay leaves it fresh rows for a
    moment). Down: it carries a backlog, taking as slots free (a relay stands by)."""
    _flag(engine, f"listening-taker:elsewhere:1:{uuid.uuid4().hex[:8]}", idle=idle)
    with engine.connect() as conn:
        seen = sql.relay.takers(conn, heartbeat_within_s=30)
    assert (seen.live, seen.waiting) == (live, waiting)


def test_a_flag_whose_session_ended_counts_no_more(engine: Engine) -> None:
    """A worker killed while it waited for work leaves its flag up, its heartbeat fresh for
    30 s; the session that wrote the flag ends with the process's socket, and from then on a
    relay neither counts the flag nor defers a fresh row to it."""
    name = f"listening-taker:elsewhere:1:{uuid.uuid4().hex[:8]}"
    worker_conn = engine.connect()  # the worker's own session, kept for its life
    try:
        with worker_conn.begin():
            sql.relay.announce_relay(worker_conn, name, pid=1, host="elsewhere", idle=True)
        backend = worker_conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        worker_conn.commit()
        with engine.connect() as conn:
            assert sql.relay.takers(conn, heartbeat_within_s=30).waiting
        [op_id] = _enqueue(engine)
        assert _relay_claim(engine, defer_s=30.0) == []
    finally:
        worker_conn.invalidate()  # the socket closes, as a SIGKILLed process's does
        worker_conn.close()

    wait_for_session_end(engine, backend)
    with engine.connect() as conn:
        assert not sql.relay.takers(conn, heartbeat_within_s=30).waiting
    assert _relay_claim(engine, defer_s=30.0) == [op_id]
