"""Prometheus metrics read from a real PostgreSQL, scraped through the registry and over HTTP."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from uuid import UUID

import httpx
import pytest
from prometheus_client import CollectorRegistry, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from sqlalchemy import Engine, insert, make_url, text
from sqlalchemy.orm import Session

from outbox import transitions
from outbox.db import create_engine
from outbox.metrics import DISPATCH_BUCKETS, OutboxCollector, serve_metrics
from outbox.schema import webhook_deliveries
from outbox.states import Actor, State
from tests.acceptance.conftest import REPO, clean_environment, run_outbox
from tests.factories import age, apply_move, make_operation, move
from tests.processes import wait_until
from tests.proxy import database_proxy

DEPLOY = "deploy.create_release"
BILLING = "billing.charge"
LIVE = ("planned", "sent", "unknown", "needs_human", "awaiting_approval")


@dataclass(frozen=True)
class Samples:
    """One scrape's samples, looked up by name and labels."""

    values: dict[tuple[str, frozenset[tuple[str, str]]], float]

    @classmethod
    def of(cls, families: Iterable[Metric]) -> Samples:
        values = {}
        for family in families:
            for sample in family.samples:
                values[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
        return cls(values)

    def get(self, name: str, **labels: str) -> float | None:
        """The sample's value, or None when the scrape did not carry it."""
        return self.values.get((name, frozenset(labels.items())))

    def __call__(self, name: str, **labels: str) -> float:
        value = self.get(name, **labels)
        assert value is not None, f"no sample {name}{labels} in {sorted(self.names())}"
        return value

    def names(self) -> set[str]:
        """Every sample name in the scrape."""
        return {name for name, _labels in self.values}

    def labelled(self, name: str) -> dict[frozenset[tuple[str, str]], float]:
        """Every sample of ``name``, by its labels."""
        return {labels: v for (n, labels), v in self.values.items() if n == name}


def scrape(collector: Collector) -> Samples:
    """One scrape through a registry of its own, as the HTTP endpoint does it."""
    registry = CollectorRegistry()
    registry.register(collector)
    return Samples.of(registry.collect())


def scrape_http(url: str) -> Samples:
    """One scrape over HTTP, parsed with prometheus_client's own text parser."""
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return Samples.of(text_string_to_metric_families(response.text))


def moves(samples: Samples, from_state: str, to_state: str, actor: str) -> float:
    """``outbox_transitions_total`` for one move and actor."""
    return samples(
        "outbox_transitions_total", from_state=from_state, to_state=to_state, actor=actor
    )


@pytest.fixture
def collector(engine: Engine) -> OutboxCollector:
    """A collector on the emptied test database, counting from now."""
    started = OutboxCollector(engine)
    assert started.baseline()
    return started


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- read from the tables -----------------------------------------------------------------


def test_operations_are_counted_by_state_and_tool(
    engine: Engine, collector: OutboxCollector
) -> None:
    """Exact counts per (state, tool), every state present for each tool (0 when empty)."""
    for state in (State.PLANNED, State.PLANNED, State.SENT, State.CANCELLED):
        make_operation(engine, state, tool=DEPLOY)
    for state in (State.CONFIRMED, State.NEEDS_HUMAN, State.NEEDS_HUMAN, State.UNKNOWN):
        make_operation(engine, state, tool=BILLING)

    samples = scrape(collector)

    expected = {
        (DEPLOY, "planned"): 2,
        (DEPLOY, "sent"): 1,
        (DEPLOY, "cancelled"): 1,
        (BILLING, "confirmed"): 1,
        (BILLING, "needs_human"): 2,
        (BILLING, "unknown"): 1,
    }
    found = samples.labelled("outbox_operations")
    assert len(found) == 2 * len(State)
    for tool in (DEPLOY, BILLING):
        for state in State:
            assert samples("outbox_operations", state=state.value, tool=tool) == expected.get(
                (tool, state.value), 0
            )
    assert samples("outbox_database_up") == 1
    assert samples("outbox_scrape_error") == 0


def test_an_empty_outbox_reads_zero_everywhere(collector: OutboxCollector) -> None:
    """No operations: no operation series, every oldest age 0, every delivery status 0."""
    samples = scrape(collector)
    assert samples.labelled("outbox_operations") == {}
    for state in LIVE:
        assert samples("outbox_oldest_age_seconds", state=state) == 0
    for status in ("pending", "delivered", "abandoned"):
        assert samples("outbox_webhook_deliveries", status=status) == 0
    assert samples("outbox_webhook_deliveries_retrying") == 0
    assert samples("outbox_check_overdue_seconds") == 0
    assert samples("outbox_escalations_total") == 0
    assert samples("outbox_exporter_events_behind") == 0


def test_oldest_age_is_how_long_the_oldest_has_waited_in_each_live_state(
    engine: Engine, collector: OutboxCollector
) -> None:
    """planned since due, sent since sent_at, unknown and needs_human since they entered the
    state; a row backing off is not waiting yet, and terminal rows do not count."""
    planned = make_operation(engine, State.PLANNED)
    age(engine, planned.id, 120, "available_at", "created_at")
    backing_off = make_operation(engine, State.PLANNED)
    age(engine, backing_off.id, 5000, "created_at")
    age(engine, backing_off.id, -3600, "available_at")  # due in an hour: not waiting
    sent = make_operation(engine, State.SENT)
    age(engine, sent.id, 300, "sent_at", "first_sent_at")
    make_operation(engine, State.SENT)  # a fresh one does not lower the oldest
    unknown = make_operation(engine, State.UNKNOWN)
    age(engine, unknown.id, 60, "updated_at")
    age(engine, unknown.id, -300, "next_check_at")  # its next check is not due yet
    human = make_operation(engine, State.NEEDS_HUMAN)
    age(engine, human.id, 600, "updated_at")
    old_but_terminal = make_operation(engine, State.CONFIRMED)
    age(engine, old_but_terminal.id, 9000, "created_at", "updated_at")

    samples = scrape(collector)

    for state, waited in (("planned", 120), ("sent", 300), ("unknown", 60), ("needs_human", 600)):
        value = samples("outbox_oldest_age_seconds", state=state)
        assert waited <= value < waited + 30, (state, value)
    assert samples.labelled("outbox_oldest_age_seconds").keys() == {
        frozenset({("state", state)}) for state in LIVE
    }
    assert samples("outbox_check_overdue_seconds") == 0


def test_an_overdue_check_shows_how_late_the_reconciler_is(
    engine: Engine, collector: OutboxCollector
) -> None:
    """The earliest next_check_at among unknown rows that has passed, in seconds."""
    late = make_operation(engine, State.UNKNOWN)
    age(engine, late.id, 240, "next_check_at")
    make_operation(engine, State.UNKNOWN)  # due just now
    later = make_operation(engine, State.UNKNOWN)
    age(engine, later.id, -600, "next_check_at")
    value = scrape(collector)("outbox_check_overdue_seconds")
    assert 240 <= value < 270


def test_only_backing_off_planned_rows_read_zero(
    engine: Engine, collector: OutboxCollector
) -> None:
    """A planned row due only in the future has waited for nobody yet."""
    later = make_operation(engine, State.PLANNED)
    age(engine, later.id, -600, "available_at")
    assert scrape(collector)("outbox_oldest_age_seconds", state="planned") == 0


def test_the_oldest_ages_are_index_probes(engine: Engine) -> None:
    """Each live state's minimum reads its partial index (docs/metrics.md's cost claim)."""
    from outbox.sql.metrics import _OLDEST  # noqa: PLC0415 -- the exporter's own statement

    with engine.begin() as conn:
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        plan = "\n".join(row[0] for row in conn.execute(text("EXPLAIN " + str(_OLDEST.compile()))))
    for index in (
        "ix_operations_planned_due",
        "ix_operations_sent_since",
        "ix_operations_unknown_next_check",
        "ix_operations_needs_human_since",
        "ix_operations_awaiting_approval_expires",
    ):
        assert index in plan, plan


def _deliveries(engine: Engine, operation_id: UUID, rows: list[dict[str, object]]) -> None:
    with engine.begin() as conn:
        for row in rows:
            conn.execute(
                insert(webhook_deliveries).values(
                    operation_id=operation_id, event="needs_human", payload={}, **row
                )
            )
        if any(row.get("status") == "delivered" for row in rows):
            return
        conn.execute(
            insert(webhook_deliveries).values(
                operation_id=operation_id,
                event="resolved",
                payload={},
                status="delivered",
                attempts=1,
                last_status=200,
                delivered_at=text("clock_timestamp()"),
            )
        )


def test_webhook_deliveries_by_status_and_the_retrying_ones(
    engine: Engine, collector: OutboxCollector
) -> None:
    """Counts per status; `retrying` is the pending ones that already failed at least once."""
    op = make_operation(engine, State.NEEDS_HUMAN)
    _deliveries(
        engine,
        op.id,
        [
            {"status": "pending", "attempts": 0},
            {"status": "pending", "attempts": 0},
            {"status": "pending", "attempts": 3, "last_status": 503},
            {"status": "abandoned", "attempts": 9, "last_error": "connection refused"},
            {"status": "abandoned", "attempts": 12, "last_status": 500},
        ],
    )

    samples = scrape(collector)

    assert samples("outbox_webhook_deliveries", status="pending") == 3
    assert samples("outbox_webhook_deliveries", status="abandoned") == 2
    assert samples("outbox_webhook_deliveries", status="delivered") == 1
    assert samples("outbox_webhook_deliveries_retrying") == 1


# --- folded from the events -----------------------------------------------------------------


def test_transitions_escalations_and_dispatch_latency_count_from_the_exporters_start(
    engine: Engine,
) -> None:
    """Events before the start are not counted; each move after it is, exactly once."""
    before = make_operation(engine, State.NEEDS_HUMAN)
    collector = OutboxCollector(engine)
    assert collector.baseline()
    assert before.state is State.NEEDS_HUMAN  # its four events came before the start

    # planned -> sent, 0.3 s at the remote, -> confirmed.
    op = make_operation(engine, State.PLANNED)
    op = move(engine, op, State.SENT, Actor.DISPATCHER)
    time.sleep(0.3)
    move(engine, op, State.CONFIRMED, Actor.DISPATCHER, remote_ref="r-1")
    # planned -> sent -> unknown -> needs_human: one escalation.
    make_operation(engine, State.NEEDS_HUMAN)
    make_operation(engine, State.CANCELLED)
    first = scrape(collector)
    # A note that changes no state is not a transition.
    with Session(engine) as session, session.begin():
        transitions.note(
            session,
            op.id,
            state=State.CONFIRMED,
            attempt=1,
            actor=Actor.EVIDENCE,
            reason="a late outcome",
        )
    second = scrape(collector)

    for samples in (first, second):
        counted = {
            tuple(dict(labels)[k] for k in ("from_state", "to_state", "actor")): value
            for labels, value in samples.labelled("outbox_transitions_total").items()
            if value
        }
        assert counted == {
            ("none", "planned", "agent"): 3,
            ("planned", "sent", "dispatcher"): 2,
            ("sent", "confirmed", "dispatcher"): 1,
            ("sent", "unknown", "dispatcher"): 1,
            ("unknown", "needs_human", "reconciler"): 1,
            ("planned", "cancelled", "agent"): 1,
        }
        # Every allowed move is exported from the start, at 0, so rate() sees its first one.
        assert moves(samples, "needs_human", "planned", "operator") == 0
        assert samples("outbox_escalations_total") == 1

        confirmed = {"to_state": "confirmed", "actor": "dispatcher"}
        assert samples("outbox_dispatch_seconds_count", **confirmed) == 1
        assert 0.3 <= samples("outbox_dispatch_seconds_sum", **confirmed) < 10
        assert samples("outbox_dispatch_seconds_bucket", le="0.25", **confirmed) == 0
        assert samples("outbox_dispatch_seconds_bucket", le="10.0", **confirmed) == 1
        assert samples("outbox_dispatch_seconds_bucket", le="+Inf", **confirmed) == 1
        assert samples("outbox_dispatch_seconds_count", to_state="unknown", actor="dispatcher") == 1
        assert samples("outbox_dispatch_seconds_count", to_state="failed", actor="dispatcher") == 0
        assert len(samples.labelled("outbox_dispatch_seconds_bucket")) == 6 * (
            len(DISPATCH_BUCKETS) + 1
        )


def test_latency_is_per_attempt(engine: Engine, collector: OutboxCollector) -> None:
    """A second attempt's latency runs from its own `sent`, not the first attempt's; the
    sweep's moves are told apart by their actor."""
    op = make_operation(engine, State.PLANNED)
    op = move(engine, op, State.SENT, Actor.DISPATCHER)
    time.sleep(1.2)
    # The request provably never left: back to planned, then a fast second attempt.
    op = move(engine, op, State.PLANNED, Actor.DISPATCHER)
    op = move(engine, op, State.SENT, Actor.DISPATCHER)
    move(engine, op, State.FAILED, Actor.DISPATCHER, last_error="422")

    lost = make_operation(engine, State.SENT)
    move(engine, lost, State.UNKNOWN, Actor.SWEEP)  # its dispatcher died: the sweep moved it

    samples = scrape(collector)

    assert samples("outbox_dispatch_seconds_count", to_state="unknown", actor="sweep") == 1
    assert samples("outbox_dispatch_seconds_count", to_state="unknown", actor="dispatcher") == 0
    assert samples("outbox_dispatch_seconds_count", to_state="planned", actor="dispatcher") == 1
    assert samples("outbox_dispatch_seconds_sum", to_state="planned", actor="dispatcher") >= 1.2
    assert samples("outbox_dispatch_seconds_count", to_state="failed", actor="dispatcher") == 1
    assert (
        samples("outbox_dispatch_seconds_bucket", to_state="failed", actor="dispatcher", le="1.0")
        == 1
    )


def test_an_event_committed_after_a_later_one_is_still_counted(
    engine: Engine, collector: OutboxCollector
) -> None:
    """Event ids are handed out at insert, not commit: a gap the cursor passed is looked up
    again, so a slow transaction's move is counted late, never lost."""
    slow = make_operation(engine, State.PLANNED)
    fast = make_operation(engine, State.PLANNED)
    baseline = scrape(collector)
    assert moves(baseline, "none", "planned", "agent") == 2

    with Session(engine) as session, session.begin():
        apply_move(
            session,
            slow.id,
            from_state=State.PLANNED,
            to_state=State.SENT,
            actor=Actor.DISPATCHER,
            reason="holds the lower event id, commits last",
        )
        move(engine, fast, State.CANCELLED, Actor.AGENT)
        during = scrape(collector)
    after = scrape(collector)

    def sent(samples: Samples) -> float:
        return moves(samples, "planned", "sent", "dispatcher")

    def cancelled(samples: Samples) -> float:
        return moves(samples, "planned", "cancelled", "agent")

    assert (sent(during), cancelled(during)) == (0, 1)
    assert (sent(after), cancelled(after)) == (1, 1)
    assert sent(scrape(collector)) == 1  # counted once


def test_a_burst_is_folded_in_bounded_batches(engine: Engine) -> None:
    """At most event_batch events per scrape; the rest wait, shown as events_behind."""
    collector = OutboxCollector(engine, event_batch=2)
    assert collector.baseline()
    for _ in range(5):
        make_operation(engine, State.PLANNED)

    enqueued = []
    behind = []
    for _ in range(4):
        samples = scrape(collector)
        enqueued.append(moves(samples, "none", "planned", "agent"))
        behind.append(samples("outbox_exporter_events_behind"))
    assert enqueued == [2, 4, 5, 5]
    assert behind == [3, 1, 0, 0]


def test_an_emptied_event_log_restarts_the_count(engine: Engine) -> None:
    """Events gone from under the cursor (a restore, a truncate): counting resumes at once."""
    for _ in range(3):
        make_operation(engine, State.PLANNED)
    collector = OutboxCollector(engine)
    assert collector.baseline()
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE outbox.operations, outbox.events RESTART IDENTITY CASCADE"))
    assert scrape(collector)("outbox_exporter_events_behind") == 0
    make_operation(engine, State.PLANNED)
    assert moves(scrape(collector), "none", "planned", "agent") == 1


def test_concurrent_scrapes_count_every_event_once(engine: Engine) -> None:
    """The HTTP server scrapes in parallel threads; the lock keeps the counters exact."""
    server = serve_metrics(engine, "127.0.0.1", 0)
    try:
        stop = threading.Event()
        failures: list[BaseException] = []

        def scrape_until_stopped() -> None:
            while not stop.is_set():
                try:
                    scrape_http(server.url)
                except BaseException as exc:  # noqa: BLE001 -- reported by the test
                    failures.append(exc)
                    return

        scrapers = [threading.Thread(target=scrape_until_stopped) for _ in range(6)]
        for scraper in scrapers:
            scraper.start()
        for _ in range(20):
            make_operation(engine, State.CONFIRMED)
        stop.set()
        for scraper in scrapers:
            scraper.join(timeout=30)
        assert failures == []
        samples = scrape_http(server.url)
    finally:
        server.shutdown()
    assert moves(samples, "none", "planned", "agent") == 20
    assert moves(samples, "sent", "confirmed", "dispatcher") == 20
    assert samples("outbox_dispatch_seconds_count", to_state="confirmed", actor="dispatcher") == 20


# --- over HTTP, and when the database is gone --------------------------------------------------


def test_the_http_endpoint_serves_every_metric(engine: Engine) -> None:
    """The real endpoint on a free port: every documented metric, parsed by prometheus_client."""
    server = serve_metrics(engine, "127.0.0.1", 0)
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        op = make_operation(engine, State.SENT, tool=BILLING)
        age(engine, op.id, 90, "sent_at", "first_sent_at")
        make_operation(engine, State.NEEDS_HUMAN, tool=BILLING)
        samples = scrape_http(server.url)
    finally:
        server.shutdown()

    assert samples("outbox_database_up") == 1
    assert samples("outbox_scrape_error") == 0
    assert samples("outbox_scrape_duration_seconds") > 0
    assert samples("outbox_operations", state="sent", tool=BILLING) == 1
    assert samples("outbox_operations", state="needs_human", tool=BILLING) == 1
    assert samples("outbox_oldest_age_seconds", state="sent") >= 90
    assert samples("outbox_escalations_total") == 1
    assert moves(samples, "unknown", "needs_human", "reconciler") == 1
    assert samples("outbox_dispatch_seconds_count", to_state="unknown", actor="dispatcher") == 1
    assert samples("outbox_webhook_deliveries", status="pending") == 0
    assert {
        "outbox_webhook_deliveries_retrying",
        "outbox_check_overdue_seconds",
        "outbox_exporter_events_behind",
        "outbox_dispatch_seconds_bucket",
        "outbox_dispatch_seconds_sum",
    } <= samples.names()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url, timeout=2)


def test_an_unreachable_database_still_answers_with_database_up_0(admin_url: str) -> None:
    """Nothing listens: the scrape answers (registry and HTTP), database_up 0, no table gauges."""
    nowhere = create_engine(make_url(admin_url).set(port=_free_port()).render_as_string(False))
    try:
        collector = OutboxCollector(nowhere)
        assert not collector.baseline()
        samples = scrape(collector)
        server = serve_metrics(nowhere, "127.0.0.1", 0)
        try:
            over_http = scrape_http(server.url)
        finally:
            server.shutdown()
    finally:
        nowhere.dispose()
    for found in (samples, over_http):
        assert found("outbox_database_up") == 0
        assert found("outbox_scrape_error") == 1
        assert found.labelled("outbox_operations") == {}
        assert found.labelled("outbox_oldest_age_seconds") == {}
        assert found.get("outbox_webhook_deliveries_retrying") is None
        assert found.get("outbox_check_overdue_seconds") is None
        assert found("outbox_escalations_total") == 0


def test_counters_live_through_a_database_outage(engine: Engine, database_url: str) -> None:
    """Cut the connection: database_up 0 and the counters kept; restored: counting resumes."""
    proxy, proxied_url = database_proxy(database_url)
    through = create_engine(proxied_url)
    try:
        collector = OutboxCollector(through)
        assert collector.baseline()
        make_operation(engine, State.NEEDS_HUMAN)
        assert scrape(collector)("outbox_escalations_total") == 1

        proxy.cut()
        make_operation(engine, State.NEEDS_HUMAN)  # while the exporter cannot see
        down = scrape(collector)
        assert down("outbox_database_up") == 0
        assert down("outbox_escalations_total") == 1

        proxy.restore()
        wait_until(
            lambda: scrape(collector)("outbox_database_up") == 1, timeout=10, what="reconnect"
        )
        back = scrape(collector)
        assert back("outbox_escalations_total") == 2
        assert back("outbox_operations", state="needs_human", tool=DEPLOY) == 2
    finally:
        through.dispose()
        proxy.cut()


# --- the command line --------------------------------------------------------------------------


def test_metrics_help_explains_itself() -> None:
    """`outbox metrics --help`: where it listens, what it reads, what happens when the
    database is down, and where the alert rules are."""
    result = run_outbox("metrics", "--help", env=clean_environment())
    assert result.code == 0, result.stderr
    # rich wraps and boxes the help: compare words, not lines.
    words = " ".join(result.stdout.replace("│", " ").split())
    for fragment in (
        "http://HOST:PORT/metrics",
        "127.0.0.1",
        "9464",
        "SIGTERM",
        "outbox_database_up 0",
        "docs/metrics.md",
        "--port",
        "--host",
    ):
        assert fragment in words, fragment


def test_metrics_command_serves_until_sigterm(engine: Engine, database_url: str) -> None:
    """The real command: prints its URL, serves the table's numbers, exits 0 on SIGTERM."""
    make_operation(engine, State.UNKNOWN)
    port = _free_port()
    with subprocess.Popen(
        [sys.executable, "-m", "outbox", "metrics", "--port", str(port)],
        env=clean_environment(OUTBOX_DATABASE_URL=database_url),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline().strip()
            served = line == f"serving metrics on http://127.0.0.1:{port}/metrics"
            if served:
                samples = scrape_http(f"http://127.0.0.1:{port}/metrics")
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=15)
        finally:
            if process.poll() is None:
                process.kill()
            _out, errors = process.communicate()
    assert served, f"printed {line!r}; stderr: {errors}"
    assert process.returncode == 0, errors
    assert "Traceback" not in errors, errors
    assert samples("outbox_operations", state="unknown", tool=DEPLOY) == 1


def test_metrics_command_refuses_a_taken_port(
    cli_env_for_metrics: dict[str, str], busy_port: int
) -> None:
    """A port already in use: one error line, exit 1."""
    result = run_outbox("metrics", "--port", str(busy_port), env=cli_env_for_metrics)
    assert result.code == 1
    assert "Traceback" not in result.stderr
    assert f"cannot listen on 127.0.0.1:{busy_port}" in result.stderr


@pytest.fixture
def cli_env_for_metrics(database_url: str, engine: Engine) -> dict[str, str]:
    """The CLI's environment on the (emptied) test database."""
    return clean_environment(OUTBOX_DATABASE_URL=database_url)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else is listening on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])
