"""Workers that take only the relay's messages say so (``consumer:`` rows in
``outbox.relays``), and a relay standing by for the takers does not make them wait
(:mod:`outbox.workers.message_only`). Real PostgreSQL; the whole stack, killed workers
included, in tests/acceptance/test_mixed_workers.py."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from celery import Celery
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import api, sql
from outbox.config import get_settings
from outbox.relay import Relay, RelayConfig
from outbox.workers import listening, message_only
from outbox.workers.app import DISPATCH_TASK, task_queues
from outbox.workers.direct import dispatch_queue, taker_name
from outbox.workers.message_only import Announce, Announcer, MessageOnly
from outbox.workers.publish import CeleryPublisher
from tests.processes import wait_for_session_end, wait_until


@pytest.fixture
def own_engine(database_url: str) -> Iterator[Engine]:
    """An engine of the worker's own (no pool: a closed connection ends its session)."""
    engine = create_engine(database_url, poolclass=NullPool)
    yield engine
    engine.dispose()


def _rows(engine: Engine) -> dict[str, tuple[bool, int | None]]:
    """``outbox.relays``: name -> (idle, the pid of the session that wrote it)."""
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT name, idle, backend_pid FROM outbox.relays"))
        return {str(name): (bool(idle), backend) for name, idle, backend in rows}


def _consumers(engine: Engine) -> bool:
    with engine.connect() as conn:
        return sql.relay.takers(conn, heartbeat_within_s=30).consumers


def _enqueue(engine: Engine) -> str:
    with Session(engine) as session, session.begin():
        return str(api.enqueue(session, tool="deploy.create", target="t", payload={}).id)


def test_a_message_only_worker_s_row_is_written_kept_fresh_and_removed(
    engine: Engine, own_engine: Engine
) -> None:
    """Written at once, never idle (enqueue's bell is not for it), its heartbeat refreshed;
    a relay sees it; stopped, the row is gone."""
    name = taker_name(sql.relay.CONSUMER_PREFIX)
    announcer = Announcer(own_engine, name, every_s=0.1)
    announcer.start()
    try:
        wait_until(lambda: name in _rows(engine), timeout=10.0, interval=0.05, what="its row")
        idle, backend = _rows(engine)[name]
        assert not idle
        assert backend is not None
        assert _consumers(engine)
        with engine.connect() as conn:
            first = conn.execute(
                text("SELECT heartbeat_at FROM outbox.relays WHERE name = :n"), {"n": name}
            ).scalar_one()

        def refreshed() -> bool:
            with engine.connect() as conn:
                return bool(
                    conn.execute(
                        text("SELECT heartbeat_at > :t FROM outbox.relays WHERE name = :n"),
                        {"n": name, "t": first},
                    ).scalar_one()
                )

        wait_until(refreshed, timeout=10.0, interval=0.05, what="its heartbeat refreshed")
    finally:
        announcer.stop()
    assert name not in _rows(engine)
    assert not _consumers(engine)


def test_a_row_whose_session_was_ended_is_written_again(engine: Engine, own_engine: Engine) -> None:
    """The database ends the row's session (a restart, an operator's pg_terminate_backend):
    the row stops counting, and the announcer writes it again on a new session."""
    name = taker_name(sql.relay.CONSUMER_PREFIX)
    announcer = Announcer(own_engine, name, every_s=0.2)
    announcer.start()
    try:
        wait_until(lambda: name in _rows(engine), timeout=10.0, interval=0.05, what="its row")
        _, backend = _rows(engine)[name]
        with engine.connect() as conn:
            assert conn.execute(
                text("SELECT pg_terminate_backend(:pid)"), {"pid": backend}
            ).scalar_one()

        def written_again() -> bool:
            _, now = _rows(engine).get(name, (False, None))
            return now is not None and now != backend and _consumers(engine)

        wait_until(written_again, timeout=15.0, interval=0.05, what="the row on a new session")
    finally:
        announcer.stop()
    assert name not in _rows(engine)


def test_a_row_whose_session_ended_counts_no_more(engine: Engine) -> None:
    """A worker SIGKILLed leaves its row with a fresh heartbeat; the session that wrote it
    ends with the process's socket, and from then on a relay does not count it."""
    name = taker_name(sql.relay.CONSUMER_PREFIX)
    worker_conn = engine.connect()
    try:
        with worker_conn.begin():
            sql.relay.announce_relay(worker_conn, name, pid=1, host="elsewhere", idle=False)
        backend = worker_conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        worker_conn.commit()
        assert _consumers(engine)
    finally:
        worker_conn.invalidate()  # the socket closes, as a SIGKILLed process's does
        worker_conn.close()

    wait_for_session_end(engine, backend)
    assert not _consumers(engine)


@pytest.mark.parametrize("consumers", [False, True], ids=["takers-only", "mixed"])
def test_a_relay_standing_by_leaves_rows_to_takers_briefly_when_a_worker_takes_only_messages(
    engine: Engine, rabbitmq_app: Celery, consumers: bool
) -> None:
    """Standing by, the relay claims a row never published only once it has been due
    standby_hold_back_s (60 s here); with a message-only worker alive, defer_to_takers_s."""
    publisher = CeleryPublisher(rabbitmq_app, engine=engine)
    relay = Relay(engine, publisher, RelayConfig(standby_hold_back_s=60.0, defer_to_takers_s=1.0))
    relay.standing_by, relay.consumers = True, consumers
    try:
        _enqueue(engine)
        assert relay.run_once().claimed == 0  # fresh: the takers' for now
        with engine.begin() as conn:
            conn.execute(
                text("UPDATE outbox.operations SET available_at = available_at - interval '2s'")
            )
        assert relay.run_once().claimed == (1 if consumers else 0)
    finally:
        publisher.close()


def test_a_relay_sees_a_message_only_worker_come_and_go(
    engine: Engine, rabbitmq_app: Celery
) -> None:
    """The relay's look at the flags (every poll interval until it stands by) notices the
    message-only worker's row, and notices it gone."""
    name = taker_name(sql.relay.CONSUMER_PREFIX)
    publisher = CeleryPublisher(rabbitmq_app, engine=engine)
    relay = Relay(engine, publisher, RelayConfig(poll_interval_s=0.1))
    runner = threading.Thread(target=relay.run_forever)
    runner.start()
    try:
        with engine.begin() as conn:
            sql.relay.announce_relay(conn, name, pid=1, host="h", idle=False)
        wait_until(lambda: relay.consumers, timeout=10.0, interval=0.05, what="seen")
        with engine.begin() as conn:
            sql.relay.forget_relay(conn, name)
        wait_until(lambda: not relay.consumers, timeout=10.0, interval=0.05, what="gone")
    finally:
        relay.stop()
        runner.join(10)


def test_a_relay_standing_by_sees_a_message_only_worker_come_and_go_within_a_poll(
    engine: Engine, own_engine: Engine, rabbitmq_app: Celery
) -> None:
    """Standing by, a relay looks at the flags only once a heartbeat interval (60 s here):
    the worker's ring as it writes its row, and as it removes it, makes the relay look again
    after its poll (0.5 s). (Without the rings this waits out the heartbeat interval and
    fails.)"""
    taker = taker_name(sql.relay.TAKER_PREFIX)
    publisher = CeleryPublisher(rabbitmq_app, engine=engine)
    relay = Relay(engine, publisher, RelayConfig(poll_interval_s=0.5, heartbeat_s=60.0))
    runner = threading.Thread(target=relay.run_forever)
    runner.start()
    announcer = Announcer(own_engine, taker_name(sql.relay.CONSUMER_PREFIX))
    try:
        with engine.begin() as conn:  # a taker lives: the relay stands by
            sql.relay.announce_relay(conn, taker, pid=1, host="h", idle=False)
        wait_until(lambda: relay.standing_by, timeout=10.0, interval=0.05, what="standing by")
        assert not relay.consumers
        announcer.start()
        wait_until(lambda: relay.consumers, timeout=5.0, interval=0.05, what="seen within a poll")
        announcer.stop()
        wait_until(
            lambda: not relay.consumers, timeout=5.0, interval=0.05, what="gone within a poll"
        )
        assert relay.standing_by
    finally:
        announcer.stop()
        relay.stop()
        runner.join(10)
        with engine.begin() as conn:
            sql.relay.forget_relay(conn, taker)


@pytest.fixture
def rabbitmq_app(rabbitmq_url: str) -> Celery:
    """A Celery app on RabbitMQ with a deployment's queues of its own."""
    deployment = f"mo{uuid.uuid4().hex[:8]}"
    app = Celery("message-only-test", broker=rabbitmq_url, set_as_current=False)
    app.conf.update(
        task_queues=task_queues(deployment),
        task_routes={DISPATCH_TASK: {"queue": "dispatch"}},
        task_serializer="json",
        accept_content=["json"],
    )
    return app


@pytest.fixture
def worker_settings(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The worker's settings name the test database (the step opens its own engine)."""
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()
    listening._engines.clear()  # the step's engine, made with this test's settings


def _consumer_of(app: Celery, *kinds: str) -> SimpleNamespace:
    """What the step reads of Celery's consumer: the queues its task consumer consumes."""
    queues = [q for q in app.conf.task_queues if q.alias in kinds]
    return SimpleNamespace(task_consumer=SimpleNamespace(queues=queues))


@pytest.mark.usefixtures("worker_settings")
@pytest.mark.parametrize(
    ("kinds", "writes"), [(("dispatch", "lookup"), True), (("lookup",), False)]
)
def test_the_consumer_step_announces_only_for_a_worker_of_the_dispatch_queue(
    engine: Engine, rabbitmq_app: Celery, kinds: tuple[str, ...], writes: bool
) -> None:
    """A worker that consumes the dispatch queue writes its row when its consumer starts,
    keeps it through a restart of the consumer (a broker reconnect) and removes it at
    shutdown; a worker of other queues only writes nothing."""
    name = taker_name(sql.relay.CONSUMER_PREFIX)
    message_only.announce_as(MessageOnly(dispatch_queue(rabbitmq_app), name))
    try:
        c = _consumer_of(rabbitmq_app, *kinds)
        step = Announce(c)
        assert step.include_if(c)
        step.start(c)
        if writes:
            wait_until(lambda: name in _rows(engine), timeout=10.0, interval=0.05, what="row")
        step.stop(c)  # the consumer restarts after a broker reconnect
        step.start(c)
        assert (name in _rows(engine)) == writes
        assert (step.announcer is not None) == writes
        step.shutdown(c)
        assert name not in _rows(engine)
    finally:
        message_only.announce_as(None)
    assert not Announce(_consumer_of(rabbitmq_app, "dispatch")).include_if(c)
