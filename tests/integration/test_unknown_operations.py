"""A message naming an operation this database does not have: a warning, a report, a count."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Connection, Engine, text

from outbox import sql
from outbox.logs import Action
from outbox.metrics import serve_metrics
from outbox.reconcilers.lookup import LookupOutcome, lookup
from outbox.workers.dispatch import Outcome, dispatch
from tests.processes import wait_until

COUNTER = "outbox_unknown_operation_messages_total"


@pytest.fixture
def listener(engine: Engine) -> Iterator[Connection]:
    """A session listening on the workers' report channel, as the exporter does."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text(f"LISTEN {sql.notify.UNKNOWN_OPERATION_CHANNEL}"))
        yield conn
        conn.execute(text("UNLISTEN *"))
        for _ in conn.connection.driver_connection.notifies(timeout=0):  # type: ignore[union-attr]
            pass  # back to the pool holding no report a later listener would count


def _reports(conn: Connection) -> list[str]:
    """The first report on the channel within 2 s. Another channel's notification (a pooled
    connection's, or another test's waiter) is not a report: skipped, as the exporter does."""
    driver = conn.connection.driver_connection
    deadline = time.monotonic() + 2.0
    while (remaining := deadline - time.monotonic()) > 0:
        for notify in driver.notifies(timeout=remaining, stop_after=1):  # type: ignore[union-attr]
            if notify.channel == sql.notify.UNKNOWN_OPERATION_CHANNEL:
                return [notify.payload]
    return []


def test_a_dispatch_for_an_unknown_operation_is_a_warning_and_a_report(
    engine: Engine, listener: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """dispatch() of an id not in the database drops it with a warning naming it, and
    reports it on the channel."""
    op_id = uuid.uuid4()
    with caplog.at_level(logging.WARNING, logger="outbox.workers.dispatch"):
        report = dispatch(op_id, engine=engine)
    assert report.outcome is Outcome.GONE
    [warning] = [
        r for r in caplog.records if getattr(r, "action", None) == Action.DISPATCH_UNKNOWN_OPERATION
    ]
    assert warning.levelno == logging.WARNING
    assert getattr(warning, "operation_id", None) == str(op_id)
    assert _reports(listener) == ["dispatch"]


def test_a_lookup_for_an_unknown_operation_is_a_warning_and_a_report(
    engine: Engine, listener: Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """lookup() of an id not in the database drops it with a warning naming it, and reports
    it on the channel."""
    op_id = uuid.uuid4()
    with caplog.at_level(logging.WARNING, logger="outbox.reconcilers.lookup"):
        report = lookup(op_id, engine=engine)
    assert report.outcome is LookupOutcome.GONE
    [warning] = [
        r for r in caplog.records if getattr(r, "action", None) == Action.LOOKUP_UNKNOWN_OPERATION
    ]
    assert getattr(warning, "operation_id", None) == str(op_id)
    assert _reports(listener) == ["lookup"]


def _counts(url: str) -> dict[str, float]:
    return {
        sample.labels["task"]: sample.value
        for family in text_string_to_metric_families(httpx.get(url, timeout=5).text)
        for sample in family.samples
        if sample.name == COUNTER
    }


def test_the_exporter_counts_the_reports_by_task(engine: Engine) -> None:
    """Each report heard while the exporter listens is counted by task, from 0."""
    server = serve_metrics(engine, "127.0.0.1", 0)
    try:
        assert server.listener.listening.wait(10)
        assert _counts(server.url) == {"dispatch": 0, "lookup": 0}
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for task in ("dispatch", "dispatch", "lookup", "something-else"):
                sql.notify.notify_unknown_operation(conn, task)
        wait_until(
            lambda: _counts(server.url) == {"dispatch": 2, "lookup": 1, "other": 1},
            timeout=10,
            what="the reports counted",
        )
    finally:
        server.shutdown()
