"""Workers that take due operations from the outbox themselves (change 38): on the database
broker in the outbox's own database, the channel consuming the dispatch queue claims a due
``planned`` row (the relay's statement: ``published_at`` stamped, ``SKIP LOCKED``) and delivers
the dispatch message the relay would have published; its idle flag makes enqueue ring it;
a relay that sees a live one stands by. Real PostgreSQL, real kombu channels."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Queue
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api, sql
from outbox.doorbell import Doorbell
from outbox.relay import Relay, RelayConfig
from outbox.workers import dbbroker
from outbox.workers.app import (
    BROKER_MESSAGE_TABLE,
    BROKER_QUEUE_TABLE,
    DISPATCH_TASK,
    LOOKUP_TASK,
    task_queues,
)
from outbox.workers.direct import DirectDispatch, dispatch_queue
from outbox.workers.publish import CeleryPublisher

OPTIONS = {"queue_tablename": BROKER_QUEUE_TABLE, "message_tablename": BROKER_MESSAGE_TABLE}
REPUBLISH_AFTER_S = 30.0


def _app(database_url: str) -> Celery:
    """A Celery app on the database broker with a deployment's queues of its own."""
    deployment = f"direct{uuid.uuid4().hex[:8]}"
    app = Celery("direct-test", broker=f"{dbbroker.ALIAS}+{database_url}", set_as_current=False)
    app.conf.update(
        task_queues=task_queues(deployment),
        task_routes={DISPATCH_TASK: {"queue": "dispatch"}, LOOKUP_TASK: {"queue": "lookup"}},
        task_serializer="json",
        accept_content=["json"],
        broker_transport_options=dict(OPTIONS),
    )
    return app


@pytest.fixture
def app(database_url: str) -> Iterator[Celery]:
    """The app, and its dispatch queue taken directly in this process (undone afterwards)."""
    celery = _app(database_url)
    dbbroker.take_directly(DirectDispatch(celery, dispatch_queue(celery), REPUBLISH_AFTER_S))
    yield celery
    dbbroker.take_directly(None)


def _enqueue(engine: Engine, count: int) -> list[str]:
    with Session(engine) as session, session.begin():
        return [
            str(api.enqueue(session, tool="deploy.create", target=f"t{i}", payload={"i": i}).id)
            for i in range(count)
        ]


def _queues(app: Celery, *kinds: str) -> list[Queue]:
    return [q for q in app.conf.task_queues if q.alias in kinds]


def _consume(
    app: Celery, kinds: tuple[str, ...], limit: int, timeout: float = 2.0
) -> list[tuple[str, dict[str, Any]]]:
    """Take up to ``limit`` messages as a worker does (drain_events), acknowledging each:
    (task name, kwargs) in the order taken."""
    got: list[tuple[str, dict[str, Any]]] = []

    def on_message(body: list[Any], message: Any) -> None:
        got.append((message.headers["task"], body[1]))
        message.ack()

    with (
        app.connection_for_read() as conn,
        conn.Consumer(_queues(app, *kinds), callbacks=[on_message], prefetch_count=1),
    ):
        while len(got) < limit:
            try:
                conn.drain_events(timeout=timeout)
            except TimeoutError:
                break
    return got


def _published(engine: Engine) -> dict[str, bool]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id::text, published_at IS NOT NULL FROM outbox.operations")
        )
        return {str(op_id): bool(stamped) for op_id, stamped in rows}


def test_a_worker_takes_a_due_operation_from_the_outbox_without_a_message(
    app: Celery, engine: Engine
) -> None:
    """No relay runs and no message exists: the consumer of the dispatch queue gets a
    dispatch message for each due operation, oldest first, each stamped published once."""
    ids = _enqueue(engine, 3)
    got = _consume(app, ("dispatch",), limit=4, timeout=1.0)
    assert [(task, kwargs["operation_id"]) for task, kwargs in got] == [
        (DISPATCH_TASK, op_id) for op_id in ids
    ]
    assert _published(engine) == dict.fromkeys(ids, True)
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {BROKER_MESSAGE_TABLE}")).scalar() == 0


def test_only_due_rows_not_published_lately_are_taken(app: Celery, engine: Engine) -> None:
    """A row backing off, and one stamped a moment ago, stay; one stamped longer than
    republish_after ago (its worker died holding it) is taken again."""
    backing_off, fresh, lost = _enqueue(engine, 3)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox.operations SET available_at = clock_timestamp() + interval '1 hour'"
                " WHERE id = :id"
            ),
            {"id": backing_off},
        )
        conn.execute(
            text("UPDATE outbox.operations SET published_at = clock_timestamp() WHERE id = :id"),
            {"id": fresh},
        )
        conn.execute(
            text(
                "UPDATE outbox.operations SET published_at = clock_timestamp() - interval '1 hour'"
                " WHERE id = :id"
            ),
            {"id": lost},
        )
    got = _consume(app, ("dispatch",), limit=3, timeout=1.0)
    assert [kwargs["operation_id"] for _, kwargs in got] == [lost]


def test_workers_taking_at_once_take_each_operation_once(database_url: str, engine: Engine) -> None:
    """Four consumers in four threads against 200 due operations: SKIP LOCKED hands each to
    exactly one of them."""
    apps = [_app(database_url) for _ in range(4)]
    # One deployment's queue for all four (as workers of one deployment share it).
    for other in apps[1:]:
        other.conf.task_queues = apps[0].conf.task_queues
    dbbroker.take_directly(DirectDispatch(apps[0], dispatch_queue(apps[0]), REPUBLISH_AFTER_S))
    try:
        ids = _enqueue(engine, 200)
        taken: list[list[tuple[str, dict[str, Any]]]] = [[] for _ in apps]

        def consume(index: int) -> None:
            taken[index] = _consume(apps[index], ("dispatch",), limit=200, timeout=1.0)

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(apps))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        dbbroker.take_directly(None)
    counts = Counter(kwargs["operation_id"] for got in taken for _, kwargs in got)
    assert set(counts) == set(ids)
    assert set(counts.values()) == {1}
    assert sum(1 for got in taken if got) >= 2  # shared, not one consumer doing it all


def test_a_backlog_of_operations_does_not_starve_the_messages(app: Celery, engine: Engine) -> None:
    """With 40 due operations waiting, a lookup message on a queue the worker also consumes
    comes out within the first MESSAGES_FIRST_EVERY takes."""
    _enqueue(engine, 40)
    with app.connection_for_write() as conn:
        producer = app.amqp.Producer(conn.default_channel)
        app.send_task(LOOKUP_TASK, kwargs={"operation_id": "x"}, producer=producer)
    got = _consume(app, ("dispatch", "lookup"), limit=dbbroker.MESSAGES_FIRST_EVERY)
    assert LOOKUP_TASK in [task for task, _ in got]


def test_an_idle_taker_is_rung_by_enqueue_and_gone_when_it_closes(
    app: Celery, engine: Engine, database_url: str
) -> None:
    """A consumer that found nothing raises its idle flag (a ``taker:`` row in
    outbox.relays): an agent's commit then NOTIFYs, and a doorbell listening as such a
    worker's does is rung. Closing the channel removes the flag."""
    assert _consume(app, ("dispatch",), limit=1, timeout=0.5) == []
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT name, idle FROM outbox.relays")).all()
        assert [(name.startswith(sql.relay.TAKER_PREFIX), idle) for name, idle in rows] == []
    # The flag lives while the channel does: watch it from inside a consumer.
    seen: list[tuple[str, bool]] = []
    bell = Doorbell(f"{dbbroker.ALIAS}+{database_url}".split("+", 1)[1], planned=lambda: True)
    try:
        assert bell.wait_listening(10)
        with (
            app.connection_for_read() as conn,
            conn.Consumer(_queues(app, "dispatch"), callbacks=[], prefetch_count=1),
        ):
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.3)
            with engine.connect() as db:
                flags = db.execute(text("SELECT name, idle FROM outbox.relays"))
                seen = [(str(name), bool(idle)) for name, idle in flags]
            bell.clear()
            _enqueue(engine, 1)
            assert bell.wait(5), "enqueue rang no bell while a taker was idle"
        with engine.connect() as db:
            assert db.execute(text("SELECT count(*) FROM outbox.relays")).scalar() == 0
    finally:
        bell.close()
    assert len(seen) == 1
    name, idle = seen[0]
    assert name.startswith(sql.relay.TAKER_PREFIX)
    assert idle


def test_a_relay_stands_by_while_a_taker_lives(
    app: Celery, engine: Engine, database_url: str
) -> None:
    """With a live taker's flag the relay leaves fresh rows to the workers and claims only
    those left untaken for standby_hold_back_s; without one it claims at once."""
    (fresh,) = _enqueue(engine, 1)
    publisher = CeleryPublisher(app, engine=engine)
    relay = Relay(engine, publisher, RelayConfig(standby_hold_back_s=5.0))
    with engine.begin() as conn:
        sql.relay.announce_relay(conn, f"{sql.relay.TAKER_PREFIX}test", pid=1, host="h", idle=True)
        assert sql.relay.takers(conn, heartbeat_within_s=30).live
    relay.standing_by = True
    assert relay.run_once().claimed == 0
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox.operations SET available_at = available_at - interval '6 seconds'")
        )
    assert relay.run_once().claimed == 1
    (old,) = _enqueue(engine, 1)
    relay.standing_by = False
    assert relay.run_once().claimed == 1
    with engine.begin() as conn:
        sql.relay.forget_relay(conn, f"{sql.relay.TAKER_PREFIX}test")
        assert not sql.relay.takers(conn, heartbeat_within_s=30).live
    publisher.close()
    assert _published(engine) == {fresh: True, old: True}


def test_a_relay_standing_by_rings_the_workers_for_a_row_no_commit_rang_for(
    app: Celery, engine: Engine, database_url: str
) -> None:
    """A row due with nobody rung for it (enqueued while no flag was up; or a backoff that
    ended): a relay standing by does not claim it, it rings enqueue's bell so that the
    workers, who otherwise poll only every few seconds, take it now."""
    (op_id,) = _enqueue(engine, 1)  # no flag up yet: no bell
    with engine.begin() as conn:
        sql.relay.announce_relay(conn, f"{sql.relay.TAKER_PREFIX}test", pid=1, host="h", idle=True)
    bell = Doorbell(database_url, planned=lambda: True)
    publisher = CeleryPublisher(app, engine=engine)
    relay = Relay(engine, publisher, RelayConfig(poll_interval_s=0.2, standby_hold_back_s=60))
    runner = threading.Thread(target=relay.run_forever)
    try:
        assert bell.wait_listening(10)
        bell.clear()
        runner.start()
        assert bell.wait(10), "the standing-by relay rang no bell for the due row"
        assert relay.standing_by
    finally:
        relay.stop()
        runner.join(10)
        bell.close()
    assert _published(engine) == {op_id: False}


def test_a_backlog_is_taken_a_message_s_worth_at_a_time(database_url: str, engine: Engine) -> None:
    """While takes keep finding work, a take claims up to ops_per_message operations into one
    message; the first ones (and a steady trickle) name one each. Every operation once."""
    celery = _app(database_url)
    dbbroker.take_directly(
        DirectDispatch(celery, dispatch_queue(celery), REPUBLISH_AFTER_S, ops_per_message=4)
    )
    try:
        ids = _enqueue(engine, 30)
        got = _consume(celery, ("dispatch",), limit=30, timeout=1.0)
    finally:
        dbbroker.take_directly(None)
    named = [
        kwargs["operation_ids"] if "operation_ids" in kwargs else [kwargs["operation_id"]]
        for _, kwargs in got
    ]
    sizes = [len(ops) for ops in named]
    assert sizes[: dbbroker.BATCH_AFTER_TAKES] == [1] * dbbroker.BATCH_AFTER_TAKES
    assert max(sizes) == 4
    assert sorted(op for ops in named for op in ops) == sorted(ids)


def test_a_take_says_whether_more_is_due(engine: Engine) -> None:
    """take_due looks one row further than it claims: a take that leaves a due row behind
    says so, the one that empties the queue does not (and claims no row it only looked at)."""
    first, second = _enqueue(engine, 2)
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        takes = [
            sql.relay.take_due(conn, limit=1, republish_after_s=REPUBLISH_AFTER_S) for _ in range(3)
        ]
    assert [([str(c.id) for c in t.claimed], t.more) for t in takes] == [
        ([first], True),
        ([second], False),
        ([], False),
    ]


def test_a_worker_rung_by_enqueue_looks_only_at_the_outbox(
    app: Celery, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once idle, a worker woken by enqueue's bell makes one statement for the operation, its
    take: it does not also look at the message table (nothing was published), nor look again
    after a take that said nothing more was due."""
    looks = {"messages": 0, "outbox": 0}
    take_message, take_due = sql.broker.take_message, sql.relay.take_due

    def counted_message(*args: Any, **kwargs: Any) -> Any:
        looks["messages"] += 1
        return take_message(*args, **kwargs)

    def counted_due(*args: Any, **kwargs: Any) -> Any:
        looks["outbox"] += 1
        return take_due(*args, **kwargs)

    monkeypatch.setattr(sql.broker, "take_message", counted_message)
    monkeypatch.setattr(sql.relay, "take_due", counted_due)
    got: list[str] = []

    def on_message(body: list[Any], message: Any) -> None:
        got.append(body[1]["operation_id"])
        message.ack()

    with (
        app.connection_for_read() as conn,
        conn.Consumer(_queues(app, "dispatch"), callbacks=[on_message], prefetch_count=1),
    ):
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.5)  # found nothing: the flag is up, enqueue rings
        # The ring its doorbell gives on connecting (look everywhere) is behind us.
        assert conn.transport.doorbell.wait_listening(10)
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.2)
        before = dict(looks)
        (op_id,) = _enqueue(engine, 1)
        conn.drain_events(timeout=10)
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.5)
    assert got == [op_id]
    assert looks == {"messages": before["messages"], "outbox": before["outbox"] + 1}


def _flags(engine: Engine) -> list[bool]:
    with engine.connect() as db:
        return [bool(idle) for (idle,) in db.execute(text("SELECT idle FROM outbox.relays"))]


def test_a_worker_fed_one_at_a_time_keeps_its_flag_up(app: Celery, engine: Engine) -> None:
    """Operations enqueued one by one, each taken before the next comes: the worker sleeps
    between them, so however many it takes its flag stays up and each is rung for (a flag
    gone down would leave the next one to the 5 s poll)."""
    count = dbbroker.BUSY_AFTER_TAKES + 4
    latencies: list[float] = []
    with (
        app.connection_for_read() as conn,
        conn.Consumer(_queues(app, "dispatch"), callbacks=[lambda body, m: m.ack()]),
    ):
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.5)
        for _ in range(count):
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.05)  # the worker sleeps until the next one
            began = time.monotonic()
            _enqueue(engine, 1)
            conn.drain_events(timeout=10)
            latencies.append(time.monotonic() - began)
        assert _flags(engine) == [True]
    assert max(latencies) < dbbroker.POLLING_INTERVAL_S / 2, latencies


def test_a_busy_worker_lowers_its_flag_and_raises_it_when_the_work_runs_out(
    app: Celery, engine: Engine
) -> None:
    """Through a backlog the flag goes down (enqueue stops ringing: the worker polls); once
    looks find nothing for BUSY_GRACE_S it goes up again, and the next operation is rung
    for."""
    _enqueue(engine, 60)
    during: list[list[bool]] = []
    taken = 0

    def on_message(body: list[Any], message: Any) -> None:
        nonlocal taken
        taken += len(body[1].get("operation_ids") or [body[1]["operation_id"]])
        message.ack()
        if taken >= 40 and not during:
            during.append(_flags(engine))

    with (
        app.connection_for_read() as conn,
        conn.Consumer(_queues(app, "dispatch"), callbacks=[on_message]),
    ):
        while taken < 60:
            conn.drain_events(timeout=10)
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=dbbroker.BUSY_GRACE_S * 10)
        assert _flags(engine) == [True]
        began = time.monotonic()
        _enqueue(engine, 1)
        conn.drain_events(timeout=10)
        assert time.monotonic() - began < dbbroker.POLLING_INTERVAL_S / 2
    assert during == [[False]]
