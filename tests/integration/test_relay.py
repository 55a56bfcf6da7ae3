"""The relay against a real PostgreSQL and a real broker (RabbitMQ, and the database itself)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from kombu import Connection
from sqlalchemy import Engine, text

from outbox import faults, sql
from outbox.config import load_settings
from outbox.db import create_engine
from outbox.deployment import deployment_name
from outbox.errors import BrokerUnavailable
from outbox.relay import Relay, RelayConfig
from outbox.states import State
from outbox.workers.app import celery_settings, uses_database_broker
from outbox.workers.publish import CeleryPublisher
from tests.celery_events import TaskEvents
from tests.conftest import Databases
from tests.factories import age, make_operation, reload
from tests.processes import wait_until
from tests.proxy import TcpProxy, database_proxy


def _app(database_url: str, broker_url: str | None) -> Celery:
    settings = load_settings(database_url=database_url, broker_url=broker_url)
    app = Celery("outbox-test")
    app.conf.update(celery_settings(settings, deployment=deployment_name(settings)))
    return app


def _drain(app: Celery) -> list[dict[str, Any]]:
    """Take every message waiting in the dispatch queue; their task kwargs."""
    bodies: list[dict[str, Any]] = []
    with Connection(
        app.conf.broker_url, transport_options=app.conf.broker_transport_options
    ) as conn:
        queue = app.amqp.queues["dispatch"](conn.default_channel)
        queue.declare()
        while (message := queue.get(no_ack=True)) is not None:
            _, kwargs, _ = message.decode()
            bodies.append(kwargs)
    return bodies


@pytest.fixture(params=["rabbitmq", "database"])
def app(request: pytest.FixtureRequest, database_url: str) -> Iterator[Celery]:
    """A Celery app on RabbitMQ (a throw-away vhost) or on the test database, queue emptied."""
    broker = request.getfixturevalue("rabbitmq_url") if request.param == "rabbitmq" else None
    celery = _app(database_url, broker)
    _drain(celery)
    yield celery
    _drain(celery)


MakeRelay = Callable[..., Relay]


@pytest.fixture
def make_relay(engine: Engine) -> Iterator[MakeRelay]:
    """Build relays whose broker connections are closed after the test."""
    made: list[Relay] = []

    def make(app: Celery, *, ops_per_message: int = 1, spread: int = 16, **config: Any) -> Relay:
        # With the engine, as `outbox relay` makes it: on the database broker the relay then
        # writes a batch's messages in its claim's transaction.
        publisher = CeleryPublisher(
            app, engine=engine, ops_per_message=ops_per_message, spread=spread
        )
        relay = Relay(engine, publisher, RelayConfig(**config))
        made.append(relay)
        return relay

    yield make
    for relay in made:
        relay.publisher.close()


def test_due_rows_are_published_once_with_tool_and_target(
    engine: Engine, app: Celery, make_relay: MakeRelay
) -> None:
    """run_once publishes each due row once, marks it published, and names tool and target."""
    ops = [make_operation(engine, target=f"p{i}") for i in range(5)]
    relay = make_relay(app)
    result = relay.run_once()
    assert (result.claimed, result.published) == (5, 5)
    assert relay.run_once().claimed == 0
    messages = _drain(app)
    assert sorted(m["operation_id"] for m in messages) == sorted(str(op.id) for op in ops)
    by_id = {m["operation_id"]: m for m in messages}
    for op in ops:
        assert by_id[str(op.id)]["tool"] == op.tool
        assert by_id[str(op.id)]["target"] == op.target
        assert reload(engine, op.id).published_at is not None


def test_a_message_names_several_operations_when_told(
    engine: Engine, app: Celery, make_relay: MakeRelay
) -> None:
    """With ops_per_message=8 and spread=1, 20 due rows go out as 3 messages (6, 7, 7)
    naming every row once, all confirmed and marked published; with spread=16 a batch of
    20 goes out as 16 messages instead."""
    ops = [make_operation(engine, target=f"p{i}") for i in range(20)]
    relay = make_relay(app, ops_per_message=8, spread=1)
    assert relay.run_once().published == 20
    messages = _drain(app)
    assert sorted(len(m["operation_ids"]) for m in messages) == [6, 7, 7]
    assert sorted(i for m in messages for i in m["operation_ids"]) == sorted(str(o.id) for o in ops)
    assert all(m["tools"] == [ops[0].tool] for m in messages)
    assert all(reload(engine, op.id).published_at is not None for op in ops)
    more = [make_operation(engine, target=f"q{i}") for i in range(20)]
    spread = make_relay(app, ops_per_message=8, spread=16)
    assert spread.run_once().published == 20
    sizes = sorted(len(m.get("operation_ids", [m.get("operation_id")])) for m in _drain(app))
    assert sizes == [1] * 12 + [2] * 4
    assert len(more) == 20


@pytest.mark.parametrize("task_events", [True, False], ids=["events-on", "events-off"])
def test_the_relay_announces_task_sent_events_only_when_task_events_are_on(
    engine: Engine,
    database_url: str,
    rabbitmq_url: str,
    make_relay: MakeRelay,
    task_events: bool,
) -> None:
    """With OUTBOX_TASK_EVENTS on (the default) each published message is announced on
    Celery's event exchange as ``task-sent`` (what Flower shows); off, nothing is."""
    settings = load_settings(
        database_url=database_url, broker_url=rabbitmq_url, task_events=task_events
    )
    app = Celery("outbox-test")
    app.conf.update(celery_settings(settings, deployment=deployment_name(settings)))
    _drain(app)

    def task_sent(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [event for event in events if event.get("type") == "task-sent"]

    with TaskEvents(rabbitmq_url, app.conf.event_exchange) as listener:
        ops = [make_operation(engine, target=f"e{i}") for i in range(3)]
        assert make_relay(app).run_once().published == 3
        events = listener.collect(
            until=lambda seen: len(task_sent(seen)) >= len(ops),
            timeout=2.0 if task_events else 0.5,
        )
    announced = task_sent(events)
    assert len(_drain(app)) == 3
    assert len(announced) == (3 if task_events else 0)


def test_rows_not_due_wait_and_lost_messages_are_republished(
    engine: Engine, app: Celery, make_relay: MakeRelay
) -> None:
    """A row backing off is not published; a published row is republished after the delay."""
    waiting = make_operation(engine)
    age(engine, waiting.id, -3600, "available_at")  # an hour in the future
    published = make_operation(engine)
    relay = make_relay(app, republish_after_s=30)
    assert relay.run_once().claimed == 1
    assert relay.run_once().claimed == 0
    age(engine, published.id, 31, "published_at")
    assert relay.run_once().claimed == 1
    assert [m["operation_id"] for m in _drain(app)] == [str(published.id)] * 2


def test_batches_are_bounded(engine: Engine, app: Celery, make_relay: MakeRelay) -> None:
    """A relay claims at most batch_size rows at a time."""
    for _ in range(7):
        make_operation(engine)
    relay = make_relay(app, batch_size=3)
    assert [relay.run_once().claimed for _ in range(4)] == [3, 3, 1, 0]
    assert len(_drain(app)) == 7


def test_a_crash_between_publish_and_commit_marks_nothing(
    engine: Engine, app: Celery, make_relay: MakeRelay
) -> None:
    """A relay dying after publishing but before its commit leaves the rows unpublished."""
    ops = [make_operation(engine) for _ in range(3)]
    relay = make_relay(app)
    with faults.armed("relay_after_publish", "raise"), pytest.raises(faults.InjectedFault):
        relay.run_once()
    assert all(reload(engine, op.id).published_at is None for op in ops)
    assert relay.run_once().published == 3
    if uses_database_broker(str(app.conf.broker_url)):
        # Written in the claim's transaction: the failed batch's messages rolled back with it.
        assert len(_drain(app)) == 3
    else:
        # Published twice: harmless, the dispatcher's compare-and-set makes the second a no-op.
        assert len(_drain(app)) == 6


def test_two_relays_share_the_work(engine: Engine, app: Celery, make_relay: MakeRelay) -> None:
    """Two relays running together publish every row, none lost, none in both batches."""
    ops = [make_operation(engine) for _ in range(60)]
    relays = [make_relay(app, batch_size=7), make_relay(app, batch_size=7)]
    claimed = [0, 0]

    def drain(index: int) -> None:
        while (result := relays[index].run_once()).claimed:
            claimed[index] += result.published

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(claimed) == 60
    messages = _drain(app)
    assert sorted(m["operation_id"] for m in messages) == sorted(str(op.id) for op in ops)


def test_a_broker_outage_marks_nothing_published(
    engine: Engine, database_url: str, rabbitmq_url: str, make_relay: MakeRelay
) -> None:
    """With the broker unreachable no row is marked published; once back, all are delivered."""
    port = int(rabbitmq_url.split("@", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
    proxy = TcpProxy(port).start()
    vhost = rabbitmq_url.rsplit("/", 1)[1]
    app = _app(database_url, f"amqp://guest:guest@127.0.0.1:{proxy.port}/{vhost}")
    try:
        _drain(app)
        relay = make_relay(app)
        first = make_operation(engine)
        assert relay.run_once().published == 1
        proxy.cut()
        ops = [make_operation(engine) for _ in range(4)]
        for _ in range(3):
            with pytest.raises(BrokerUnavailable):
                relay.run_once()
        assert all(reload(engine, op.id).published_at is None for op in ops)
        proxy.restore()
        assert relay.run_once().published == 4
        ids = [m["operation_id"] for m in _drain(app)]
        assert sorted(ids) == sorted(str(op.id) for op in [first, *ops])
    finally:
        proxy.stop()


def test_the_relay_sleeps_on_notify_and_wakes_for_a_new_intent(
    engine: Engine, app: Celery, make_relay: MakeRelay
) -> None:
    """An idle relay says so, and an intent enqueued then reaches the broker well before a poll."""
    relay = make_relay(app, poll_interval_s=30)
    runner = threading.Thread(target=relay.run_forever)
    runner.start()
    try:
        _wait_until_idle(engine)
        assert _relay_idle(engine)
        started = time.monotonic()
        op = make_operation(engine)
        while reload(engine, op.id).published_at is None and time.monotonic() - started < 10:
            time.sleep(0.02)
        waited = time.monotonic() - started
        assert reload(engine, op.id).published_at is not None
        assert waited < 5, f"the bell did not wake the relay ({waited:.1f}s)"
    finally:
        relay.stop()
        runner.join(40)
    assert not runner.is_alive()
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.relays")).scalar_one() == 0
    assert [m["operation_id"] for m in _drain(app)] == [str(op.id)]


def test_a_backlog_silences_the_bell_and_the_relay_rings_it_again_when_drained(
    engine: Engine, app: Celery, make_relay: MakeRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a backlog the relay claims batch after batch with its flag down (no bell: no
    poll interval is waited); drained, it raises the flag and the next intent wakes it."""
    backlog = [make_operation(engine) for _ in range(12)]
    flags: list[bool] = []
    relay = make_relay(app, poll_interval_s=30, batch_size=2, busy_after_batches=2)
    announce = sql.relay.announce_relay

    def spy(executor: Any, name: str, **kwargs: Any) -> None:
        flags.append(kwargs["idle"])
        announce(executor, name, **kwargs)

    monkeypatch.setattr(sql.relay, "announce_relay", spy)
    runner = threading.Thread(target=relay.run_forever)
    try:
        runner.start()
        _wait_until_idle(engine)
        assert all(reload(engine, op.id).published_at is not None for op in backlog)
        assert _relay_idle(engine)
        # registered busy, lowered by the backlog's first batch, raised once when drained
        assert flags[:2] == [False, False]
        assert flags[-1] is True
        assert flags.count(True) == 1
        started = time.monotonic()
        late = make_operation(engine)
        while reload(engine, late.id).published_at is None and time.monotonic() - started < 10:
            time.sleep(0.02)
        assert reload(engine, late.id).published_at is not None
        assert time.monotonic() - started < 5, "the bell did not ring after the backlog"
    finally:
        relay.stop()
        runner.join(40)
    assert not runner.is_alive()
    assert sorted(m["operation_id"] for m in _drain(app)) == sorted(
        str(op.id) for op in [*backlog, late]
    )


def test_an_idle_relay_keeps_its_heartbeat(
    engine: Engine, app: Celery, make_relay: MakeRelay
) -> None:
    """A relay waiting on its bell still refreshes its heartbeat (peers remove silent ones)."""
    relay = make_relay(app, poll_interval_s=0.1, heartbeat_s=0.2)
    runner = threading.Thread(target=relay.run_forever)
    try:
        runner.start()
        _wait_until_idle(engine)
        first = _heartbeat(engine)
        time.sleep(1.0)
        assert _heartbeat(engine) > first
    finally:
        relay.stop()
        runner.join(40)
    assert not runner.is_alive()


def _heartbeat(engine: Engine) -> Any:
    with engine.connect() as conn:
        return conn.execute(text("SELECT max(heartbeat_at) FROM outbox.relays")).scalar_one()


def _wait_until_idle(engine: Engine, timeout_s: float = 10) -> None:
    """Until a relay says it waits on its bell (the caller asserts on what follows)."""
    deadline = time.monotonic() + timeout_s
    while not _relay_idle(engine) and time.monotonic() < deadline:
        time.sleep(0.05)


def _relay_idle(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(text("SELECT coalesce(bool_or(idle), false) FROM outbox.relays")).scalar()
        )


def test_a_cancelled_or_sent_row_is_never_published(
    engine: Engine, app: Celery, make_relay: MakeRelay
) -> None:
    """Only planned rows are claimed."""
    for state in (State.SENT, State.CANCELLED, State.CONFIRMED, State.UNKNOWN):
        make_operation(engine, state)
    assert make_relay(app).run_once().claimed == 0
    assert _drain(app) == []


def test_a_taken_message_leaves_the_database_broker_and_hidden_ones_are_pruned(
    engine: Engine, database_url: str
) -> None:
    """On the database broker the statement that takes a message deletes it; rows kombu's
    own take only hid (as releases before issue 35 left them) are deleted by the relay's
    publisher."""
    app = _app(database_url, None)
    publisher = CeleryPublisher(app, engine=engine, prune_every_s=0)
    relay = Relay(engine, publisher, RelayConfig())
    try:
        make_operation(engine)
        assert relay.run_once().published == 1
        assert len(_drain(app)) == 1
        with engine.begin() as conn:
            assert conn.execute(text("SELECT count(*) FROM outbox_kombu_message")).scalar() == 0
            conn.execute(
                text(
                    "INSERT INTO outbox_kombu_message (id, visible, payload, version, queue_id)"
                    " SELECT nextval('message_id_sequence'), false, '{}', 1, min(id)"
                    " FROM outbox_kombu_queue"
                )
            )
        make_operation(engine)
        assert relay.run_once().published == 1
        with engine.connect() as conn:
            hidden = conn.execute(
                text("SELECT count(*) FROM outbox_kombu_message WHERE visible = false")
            ).scalar_one()
        assert hidden == 0
    finally:
        publisher.close()
        _drain(app)


def test_a_database_outage_is_survived(
    engine: Engine, database_url: str, make_relay: MakeRelay
) -> None:
    """A relay whose database goes away keeps retrying and publishes once it is back."""
    proxy, through = database_proxy(database_url)
    proxied = create_engine(through)
    app = _app(database_url, None)
    _drain(app)
    relay = Relay(
        proxied,
        CeleryPublisher(app),
        RelayConfig(poll_interval_s=0.2, min_backoff_s=0.1, max_backoff_s=0.5),
    )
    runner = threading.Thread(target=relay.run_forever)
    try:
        runner.start()
        proxy.cut()
        op = make_operation(engine)
        time.sleep(1.5)
        assert reload(engine, op.id).published_at is None
        proxy.restore()
        deadline = time.monotonic() + 15
        while reload(engine, op.id).published_at is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reload(engine, op.id).published_at is not None
        assert [m["operation_id"] for m in _drain(app)] == [str(op.id)]
    finally:
        relay.stop()
        runner.join(30)
        proxy.stop()
        proxied.dispose()


def test_a_relay_whose_connection_dies_inside_a_statement_goes_on(
    engine: Engine, database_url: str
) -> None:
    """The relay's own connection (its bell: LISTEN and flag) killed while a statement on it
    waits: the statement fails, the relay drops that connection and goes on with a new one.
    (It died here: closing the dead connection raised SQLAlchemy's "rollback first" error,
    which is no DBAPIError, out of the loop's error handler; seen in a database restart.)"""
    app = _app(database_url, None)
    _drain(app)
    relay = Relay(
        engine,
        CeleryPublisher(app),
        RelayConfig(poll_interval_s=0.1, heartbeat_s=0.2, min_backoff_s=0.1, max_backoff_s=0.2),
    )
    runner = threading.Thread(target=relay.run_forever)
    try:
        runner.start()
        _wait_until_idle(engine)  # the flag is written on the bell's connection: its session
        with engine.begin() as conn:
            pid = conn.execute(
                text("SELECT backend_pid FROM outbox.relays WHERE name = :name"),
                {"name": relay.name},
            ).scalar_one()
        with engine.connect() as blocker, engine.connect() as admin:
            admin.execution_options(isolation_level="AUTOCOMMIT")
            # The next heartbeat on the bell waits for this lock: a statement in flight.
            blocker.execute(text("LOCK TABLE outbox.relays IN ACCESS EXCLUSIVE MODE"))
            waiting = text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :p")
            deadline = time.monotonic() + 10
            while not admin.execute(waiting, {"p": pid}).scalar():
                assert time.monotonic() < deadline, "the relay's statement never waited"
                time.sleep(0.05)
            assert admin.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
            blocker.rollback()
        time.sleep(1.0)
        assert runner.is_alive(), "the relay stopped when its connection died"
        op = make_operation(engine)
        wait_until(
            lambda: reload(engine, op.id).published_at is not None,
            timeout=15,
            what="a new row published by the relay",
        )
        assert [m["operation_id"] for m in _drain(app)] == [str(op.id)]
    finally:
        relay.stop()
        runner.join(30)
        relay.publisher.close()


def test_on_the_database_broker_a_batch_commits_in_the_claims_transaction(
    engine: Engine, database_url: str, make_relay: MakeRelay
) -> None:
    """The relay writes the messages in the transaction that claims and stamps the rows:
    the messages and the stamps are one commit (no worker meets a claim not yet committed)."""
    app = _app(database_url, None)
    _drain(app)
    for _ in range(5):
        make_operation(engine)
    assert make_relay(app).run_once().published == 5
    with engine.connect() as conn:
        stamps = (
            conn.execute(
                text(
                    "SELECT DISTINCT xmin::text FROM outbox.operations"
                    " WHERE published_at IS NOT NULL"
                )
            )
            .scalars()
            .all()
        )
        messages = (
            conn.execute(text("SELECT DISTINCT xmin::text FROM outbox_kombu_message"))
            .scalars()
            .all()
        )
    assert len(stamps) == 1
    assert messages == stamps
    assert len(_drain(app)) == 5


def test_a_database_broker_elsewhere_is_published_through_kombu(
    engine: Engine, database_url: str, databases: Databases
) -> None:
    """A database broker in another database than the relay's is written through kombu's
    own connection (never in the relay's transaction, which is not in that database)."""
    other = databases.create()
    app = _app(other, None)
    publisher = CeleryPublisher(app, engine=engine)
    try:
        assert not publisher.in_relay_transaction
        assert CeleryPublisher(_app(database_url, None), engine=engine).in_relay_transaction
        make_operation(engine)
        assert Relay(engine, publisher, RelayConfig()).run_once().published == 1
        assert len(_drain(app)) == 1
    finally:
        publisher.close()


def test_a_batch_on_the_database_broker_is_one_transaction(
    engine: Engine, database_url: str, make_relay: MakeRelay
) -> None:
    """On the database broker a relay batch's messages are written by one transaction."""
    app = _app(database_url, None)
    _drain(app)
    for _ in range(20):
        make_operation(engine)
    assert make_relay(app, spread=20).run_once().published == 20
    with engine.connect() as conn:
        messages, transactions = conn.execute(
            text("SELECT count(*), count(DISTINCT xmin::text) FROM outbox_kombu_message")
        ).one()
    assert (messages, transactions) == (20, 1)
    assert len(_drain(app)) == 20


def test_a_database_broker_batch_that_fails_stores_nothing(
    engine: Engine, database_url: str
) -> None:
    """A batch that fails before it ends leaves no message of it on the database broker."""
    app = _app(database_url, None)
    _drain(app)
    publisher = CeleryPublisher(app)
    try:
        producer = publisher._ensure_producer()

        def three_then_fail() -> None:
            with producer.channel.batch():
                for _ in range(3):
                    app.send_task("outbox.dispatch", kwargs={}, producer=producer, queue="dispatch")
                raise RuntimeError("half-way")

        with pytest.raises(RuntimeError, match="half-way"):
            three_then_fail()
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM outbox_kombu_message")).scalar() == 0
        # The channel is usable again: a message outside a batch is stored at once.
        app.send_task("outbox.dispatch", kwargs={}, producer=producer, queue="dispatch")
        assert len(_drain(app)) == 1
    finally:
        publisher.close()
