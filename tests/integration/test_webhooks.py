"""Escalation webhooks against a real PostgreSQL and a real HTTP receiver on 127.0.0.1."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from uuid import UUID

import pytest
from opentelemetry import trace as otel_trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError
from standardwebhooks import Webhook

from outbox import sql, webhooks
from outbox.config import WEBHOOK_EVENT_NAMES, Settings, get_settings, load_settings
from outbox.errors import ConfigError, StaleTransition
from outbox.logs import Action
from outbox.models import Delivery, DeliveryStatus, WebhookEvent
from outbox.reconcilers.webhooks import (
    DeliveryConfig,
    WebhookDeliverer,
    backoff_s,
    deliver_one,
)
from outbox.states import Actor, State
from tests.factories import apply_move, make_operation, move, reload
from tests.integration.test_tracing_spans import AGENT_SPAN_ID, TRACE_ID
from tests.otel import collecting

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()


@dataclass(frozen=True)
class Received:
    """One request as the receiver saw it."""

    path: str
    headers: dict[str, str]
    body: bytes
    #: The receiver's clock when the request arrived (seconds since the epoch).
    at: float


class Receiver:
    """A real HTTP server on 127.0.0.1 that records every request and answers from a script."""

    def __init__(self, port: int = 0, *, delay_s: float = 0.0) -> None:
        self.requests: list[Received] = []
        self._answers: list[int] = []
        self._lock = threading.Lock()
        self._delay_s = delay_s
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        self._closed = False

    @property
    def url(self) -> str:
        """Where the outbox should POST."""
        return f"http://127.0.0.1:{self.port}/hooks/outbox"

    def answer(self, *statuses: int) -> None:
        """Answer the next requests with these statuses, then 200."""
        with self._lock:
            self._answers = list(statuses)

    def _record(self, received: Received) -> int:
        with self._lock:
            self.requests.append(received)
            return self._answers.pop(0) if self._answers else 200

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                headers = {name.lower(): value for name, value in self.headers.items()}
                status = receiver._record(Received(self.path, headers, body, time.time()))
                time.sleep(receiver._delay_s)
                self.send_response(status)
                if 300 <= status < 400:
                    self.send_header("location", f"http://127.0.0.1:{receiver.port}/elsewhere")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the test reads `requests`, not stderr."""

        return Handler

    def close(self) -> None:
        """Stop serving and free the port (connections to it are then refused)."""
        if not self._closed:
            self._closed = True
            self.server.shutdown()
            self.server.server_close()
            self._thread.join(timeout=5)


Configure = Callable[..., None]


@pytest.fixture
def configure(monkeypatch: pytest.MonkeyPatch) -> Iterator[Configure]:
    """Set (or unset) this process's OUTBOX_WEBHOOK_* variables; get_settings() re-reads them."""

    def apply(url: str | None, *, secret: str | None = SECRET, events: str | None = None) -> None:
        for name, value in (
            ("OUTBOX_WEBHOOK_URL", url),
            ("OUTBOX_WEBHOOK_SECRET", secret),
            ("OUTBOX_WEBHOOK_EVENTS", events),
        ):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        get_settings.cache_clear()

    apply(None, secret=None)
    yield apply
    # Runs before monkeypatch restores the environment: the next get_settings() reads it afresh.
    get_settings.cache_clear()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A live receiver, closed after the test."""
    server = Receiver()
    yield server
    server.close()


@pytest.fixture
def webhook(configure: Configure, receiver: Receiver) -> Receiver:
    """Webhooks on, pointed at the receiver, with the default events."""
    configure(receiver.url)
    return receiver


MakeDeliverer = Callable[..., WebhookDeliverer]


@pytest.fixture
def make_deliverer(engine: Engine) -> Iterator[MakeDeliverer]:
    """Build deliverers from the current settings; their HTTP clients are closed after the test."""
    made: list[WebhookDeliverer] = []

    def make(**config: Any) -> WebhookDeliverer:
        deliverer = WebhookDeliverer(engine, DeliveryConfig(**config))
        made.append(deliverer)
        return deliverer

    yield make
    for deliverer in made:
        deliverer.close()


def deliveries(engine: Engine, operation_id: UUID | None = None) -> list[Delivery]:
    """The committed deliveries (of one operation), oldest first."""
    with engine.connect() as conn:
        found = sql.webhooks.list_deliveries(conn, operation_id=operation_id, limit=1000)
    return found[::-1]


def only_delivery(engine: Engine) -> Delivery:
    """The one committed delivery."""
    found = deliveries(engine)
    assert len(found) == 1, found
    return found[0]


def age_deliveries(engine: Engine, seconds: float, *columns: str) -> None:
    """Move these timestamp columns of every delivery ``seconds`` into the past."""
    assignments = ", ".join(f"{c} = {c} - make_interval(secs => :s)" for c in columns)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE outbox.webhook_deliveries SET {assignments}"), {"s": seconds})


def seconds_to_next_attempt(engine: Engine, delivery_id: UUID) -> float:
    """How far in the future the delivery's next attempt is, by the database clock."""
    with engine.connect() as conn:
        return float(
            conn.execute(
                text(
                    "SELECT extract(epoch FROM next_attempt_at - clock_timestamp()) "
                    "FROM outbox.webhook_deliveries WHERE id = :id"
                ),
                {"id": delivery_id},
            ).scalar_one()
        )


def escalate(engine: Engine) -> UUID:
    """A committed operation that was just moved to needs_human by the reconciler."""
    return make_operation(engine, State.NEEDS_HUMAN).id


def verified(received: Received) -> Any:
    """The body as Standard Webhooks' own verifier accepts it (raises if the signature is bad)."""
    return Webhook(SECRET).verify(received.body, received.headers)


# --- recording, in the move's transaction --------------------------------------------------


def test_escalation_writes_one_pending_delivery_in_the_same_transaction(
    engine: Engine, webhook: Receiver
) -> None:
    """Moving to needs_human writes one pending delivery, visible only with the move's commit."""
    op = make_operation(engine, State.UNKNOWN)
    with engine.connect() as conn:
        apply_move(
            conn,
            op.id,
            from_state=State.UNKNOWN,
            to_state=State.NEEDS_HUMAN,
            actor=Actor.RECONCILER,
            reason="no lookup, no dedup contract",
        )
        inside = sql.webhooks.list_deliveries(conn)
        assert [(d.event, d.status) for d in inside] == [
            (WebhookEvent.NEEDS_HUMAN, DeliveryStatus.PENDING)
        ]
        assert deliveries(engine) == [], "another connection saw an uncommitted delivery"
        conn.rollback()
    assert deliveries(engine) == []
    assert reload(engine, op.id).state is State.UNKNOWN

    move(engine, op, State.NEEDS_HUMAN, Actor.RECONCILER)
    delivery = only_delivery(engine)
    assert (delivery.operation_id, delivery.event) == (op.id, WebhookEvent.NEEDS_HUMAN)
    assert (delivery.status, delivery.attempts, delivery.delivered_at) == (
        DeliveryStatus.PENDING,
        0,
        None,
    )


def test_no_url_configured_writes_nothing(engine: Engine, configure: Configure) -> None:
    """With OUTBOX_WEBHOOK_URL unset, escalating and resolving write no delivery."""
    op = make_operation(engine, State.NEEDS_HUMAN)
    move(engine, op, State.CONFIRMED, Actor.OPERATOR, remote_ref="rel-9")
    assert deliveries(engine) == []


def test_a_refused_move_writes_no_delivery(engine: Engine, webhook: Receiver) -> None:
    """A transition whose compare-and-set misses writes no delivery."""
    op = make_operation(engine, State.UNKNOWN)
    with engine.connect() as conn, pytest.raises(StaleTransition):
        apply_move(
            conn,
            op.id,
            from_state=State.SENT,
            to_state=State.NEEDS_HUMAN,
            actor=Actor.SWEEP,
            reason="stale",
        )
    assert deliveries(engine) == []


def test_the_message_names_the_operation_and_the_resolve_command(
    engine: Engine, webhook: Receiver
) -> None:
    """The payload carries the operation's identity, hash and resolve command; never its payload."""
    op = make_operation(
        engine, State.NEEDS_HUMAN, payload={"email": "alice@example.com"}, intent_key="k-1"
    )
    op = reload(engine, op.id)
    body = only_delivery(engine).payload
    assert body["type"] == "operation.needs_human"
    assert body["timestamp"].endswith("Z")
    data = body["data"]
    assert data == {
        "operation_id": str(op.id),
        "intent_key": "k-1",
        "agent": "",
        "tool": op.tool,
        "target": op.target,
        "state": "needs_human",
        "from_state": "unknown",
        "attempts": op.attempts,
        "remote_ref": None,
        "payload_hash": op.payload_hash,
        "reason": "factory",
        "actor": "reconciler",
        "resolve_command": data["resolve_command"],
    }
    assert data["resolve_command"].startswith(f"outbox ops resolve {op.id} ")
    assert f"--expect-attempts {op.attempts} " in data["resolve_command"]
    assert f"--payload-hash {op.payload_hash} " in data["resolve_command"]
    text_body = json.dumps(body)
    assert "alice@example.com" not in text_body
    assert SECRET not in text_body


def test_the_message_links_to_the_console_page_when_its_address_is_set(
    engine: Engine, webhook: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With OUTBOX_CONSOLE_URL set, data.console_url is the operation's console page."""
    monkeypatch.setenv("OUTBOX_CONSOLE_URL", "https://outbox.example.com/")
    get_settings.cache_clear()
    op = make_operation(engine, State.NEEDS_HUMAN)
    data = only_delivery(engine).payload["data"]
    assert data["console_url"] == f"https://outbox.example.com/operations/{op.id}"


def test_resolving_an_escalation_writes_a_resolved_delivery(
    engine: Engine, webhook: Receiver
) -> None:
    """An operator's needs_human -> confirmed writes a 'resolved' delivery (the follow-up)."""
    op = make_operation(engine, State.NEEDS_HUMAN)
    move(engine, op, State.CONFIRMED, Actor.OPERATOR, remote_ref="rel-7", reason="seen")
    escalated, resolved = deliveries(engine, op.id)
    assert (escalated.event, resolved.event) == (WebhookEvent.NEEDS_HUMAN, WebhookEvent.RESOLVED)
    data = resolved.payload["data"]
    assert resolved.payload["type"] == "operation.resolved"
    assert (data["state"], data["from_state"], data["actor"]) == (
        "confirmed",
        "needs_human",
        "operator",
    )
    assert (data["remote_ref"], data["reason"], data["resolve_command"]) == ("rel-7", "seen", None)


@pytest.mark.parametrize(
    ("events", "start", "to_state", "actor", "expected"),
    [
        pytest.param(
            None, State.SENT, State.CONFIRMED, Actor.DISPATCHER, [], id="default-confirmed"
        ),
        pytest.param(None, State.SENT, State.FAILED, Actor.DISPATCHER, [], id="default-failed"),
        pytest.param(
            "confirmed,failed",
            State.SENT,
            State.CONFIRMED,
            Actor.DISPATCHER,
            ["confirmed"],
            id="confirmed",
        ),
        pytest.param(
            "confirmed,failed", State.SENT, State.FAILED, Actor.DISPATCHER, ["failed"], id="failed"
        ),
        pytest.param(
            "confirmed,failed",
            State.UNKNOWN,
            State.NEEDS_HUMAN,
            Actor.RECONCILER,
            [],
            id="needs-human-not-subscribed",
        ),
        pytest.param(
            "resolved,confirmed",
            State.NEEDS_HUMAN,
            State.CONFIRMED,
            Actor.EVIDENCE,
            ["resolved", "confirmed"],
            id="resolved-and-confirmed",
        ),
        pytest.param(
            "needs_human,resolved,confirmed,failed",
            State.NEEDS_HUMAN,
            State.PLANNED,
            Actor.OPERATOR,
            ["resolved"],
            id="replay-is-resolved",
        ),
    ],
)
def test_only_subscribed_events_are_recorded(
    engine: Engine,
    configure: Configure,
    receiver: Receiver,
    events: str | None,
    start: State,
    to_state: State,
    actor: Actor,
    expected: list[str],
) -> None:
    """A move writes one delivery per event it makes that OUTBOX_WEBHOOK_EVENTS subscribes to."""
    configure(receiver.url, events=events)
    op = make_operation(engine, start)
    before = {d.id for d in deliveries(engine)}
    columns = {"remote_ref": "rel-1"} if to_state is State.CONFIRMED else {}
    move(engine, op, to_state, actor, **columns)
    new = [d.event.value for d in deliveries(engine) if d.id not in before]
    assert sorted(new) == sorted(expected)


# --- delivery -------------------------------------------------------------------------------


def test_the_deliverer_posts_a_message_the_library_verifies(
    engine: Engine, webhook: Receiver, make_deliverer: MakeDeliverer
) -> None:
    """The deliverer POSTs the stored body with Standard Webhooks headers that verify."""
    escalate(engine)
    pending = only_delivery(engine)
    result = make_deliverer().run_once()
    assert (result.delivered, result.retried, result.abandoned) == (1, 0, 0)
    [received] = webhook.requests
    assert received.path == "/hooks/outbox"
    assert received.headers["content-type"] == "application/json"
    assert received.headers["webhook-id"] == str(pending.id)
    assert received.headers["webhook-signature"].startswith("v1,")
    assert verified(received) == pending.payload
    done = only_delivery(engine)
    assert (done.status, done.attempts, done.last_status, done.last_error) == (
        DeliveryStatus.DELIVERED,
        1,
        200,
        None,
    )
    assert done.delivered_at is not None
    assert make_deliverer().run_once().attempted == 0


def test_a_delivery_is_a_client_span_in_the_operations_trace(
    engine: Engine, webhook: Receiver, make_deliverer: MakeDeliverer
) -> None:
    """With tracing on, each delivery attempt is an outbox.webhook.deliver CLIENT span, child
    of the trace context the operation was enqueued with, naming the event and the status."""
    spans = collecting()
    agent = NonRecordingSpan(
        SpanContext(TRACE_ID, AGENT_SPAN_ID, is_remote=False, trace_flags=TraceFlags(1))
    )
    with otel_trace.use_span(agent):
        op = make_operation(engine, State.NEEDS_HUMAN)
    assert make_deliverer().run_once().delivered == 1
    (span,) = [s for s in spans.get_finished_spans() if s.name == "outbox.webhook.deliver"]
    assert span.kind is SpanKind.CLIENT
    assert span.parent is not None
    assert op.traceparent is not None  # its enqueue span's context, in the agent's trace
    assert (span.parent.trace_id, f"{span.parent.span_id:016x}") == (
        TRACE_ID,
        op.traceparent[36:52],
    )
    attributes = span.attributes or {}
    assert attributes["outbox.operation.id"] == str(op.id)
    assert (attributes["outbox.webhook.event"], attributes["http.response.status_code"]) == (
        "needs_human",
        200,
    )


def test_a_failing_receiver_gets_the_same_id_with_fresh_signatures_until_it_accepts(
    engine: Engine, webhook: Receiver, make_deliverer: MakeDeliverer
) -> None:
    """500, 500, 200: three attempts, one webhook-id, each freshly timestamped and signed."""
    escalate(engine)
    delivery_id = only_delivery(engine).id
    webhook.answer(500, 500)
    deliverer = make_deliverer()

    assert deliverer.run_once().retried == 1
    # 5 s ± 20 % jitter, set at the attempt and read a moment later: the lower bounds allow
    # for that moment (CI once read 3.9992 s).
    assert 3 <= seconds_to_next_attempt(engine, delivery_id) <= 6
    assert deliverer.run_once().attempted == 0, "retried before its backoff"
    # An hour passes: a timestamp kept from the first try would now be refused as too old.
    age_deliveries(engine, 3600, "next_attempt_at", "created_at")
    assert deliverer.run_once().retried == 1
    assert 7 <= seconds_to_next_attempt(engine, delivery_id) <= 12
    age_deliveries(engine, 3600, "next_attempt_at", "created_at")
    assert deliverer.run_once().delivered == 1

    assert len(webhook.requests) == 3
    assert {r.headers["webhook-id"] for r in webhook.requests} == {str(delivery_id)}
    assert len({r.body for r in webhook.requests}) == 1
    for received in webhook.requests:
        verified(received)
        assert abs(int(received.headers["webhook-timestamp"]) - received.at) < 5
    done = only_delivery(engine)
    assert (done.status, done.attempts, done.last_status) == (DeliveryStatus.DELIVERED, 3, 200)


def test_a_receiver_that_is_down_is_retried_later(
    engine: Engine, webhook: Receiver, make_deliverer: MakeDeliverer
) -> None:
    """Connection refused leaves the row pending with the error; it is delivered once back up."""
    escalate(engine)
    port = webhook.port
    webhook.close()
    deliverer = make_deliverer()
    assert deliverer.run_once().retried == 1
    failed = only_delivery(engine)
    assert (failed.status, failed.attempts, failed.last_status) == (DeliveryStatus.PENDING, 1, None)
    assert "ConnectError" in (failed.last_error or "")
    assert seconds_to_next_attempt(engine, failed.id) > 3

    back = Receiver(port)
    try:
        age_deliveries(engine, 3600, "next_attempt_at")
        assert deliverer.run_once().delivered == 1
        assert [r.headers["webhook-id"] for r in back.requests] == [str(failed.id)]
    finally:
        back.close()


def test_redirects_are_not_followed(
    engine: Engine, webhook: Receiver, make_deliverer: MakeDeliverer
) -> None:
    """A 307 answer is a failed attempt, retried later; the Location is never requested."""
    escalate(engine)
    webhook.answer(307)
    assert make_deliverer().run_once().retried == 1
    assert [r.path for r in webhook.requests] == ["/hooks/outbox"]
    assert only_delivery(engine).last_status == 307


def test_a_delivery_failing_past_the_give_up_period_is_abandoned(
    engine: Engine,
    webhook: Receiver,
    make_deliverer: MakeDeliverer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Older than give_up_after_s and failing: abandoned, with a warning, and never sent again."""
    escalate(engine)
    age_deliveries(engine, 3 * 86400 + 60, "created_at")
    webhook.answer(500)
    deliverer = make_deliverer()
    with caplog.at_level(logging.WARNING, logger="outbox.reconcilers.webhooks"):
        assert deliverer.run_once().abandoned == 1
    gone = only_delivery(engine)
    assert (gone.status, gone.attempts, gone.last_status) == (DeliveryStatus.ABANDONED, 1, 500)
    [warning] = [
        r for r in caplog.records if getattr(r, "action", None) == Action.WEBHOOK_ABANDONED
    ]
    assert warning.levelno == logging.WARNING
    assert getattr(warning, "delivery_id", None) == str(gone.id)
    age_deliveries(engine, 3600, "next_attempt_at")
    assert deliverer.run_once().attempted == 0
    assert len(webhook.requests) == 1


def test_give_up_is_measured_from_creation_and_a_late_success_still_counts(
    engine: Engine, webhook: Receiver, make_deliverer: MakeDeliverer
) -> None:
    """A failing row younger than the period is retried; an older one that succeeds is delivered."""
    escalate(engine)
    age_deliveries(engine, 3 * 86400 - 600, "created_at")
    webhook.answer(500)
    deliverer = make_deliverer()
    assert deliverer.run_once().retried == 1
    assert only_delivery(engine).status is DeliveryStatus.PENDING
    age_deliveries(engine, 3600, "created_at", "next_attempt_at")
    assert deliverer.run_once().delivered == 1


def test_logs_carry_actions(
    engine: Engine,
    webhook: Receiver,
    make_deliverer: MakeDeliverer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failed attempt logs webhook_retry and a success webhook_delivered, never the URL."""
    escalate(engine)
    webhook.answer(503)
    deliverer = make_deliverer()
    with caplog.at_level(logging.INFO, logger="outbox.reconcilers.webhooks"):
        deliverer.run_once()
        age_deliveries(engine, 3600, "next_attempt_at")
        deliverer.run_once()
    actions = [
        getattr(r, "action", None)
        for r in caplog.records
        if r.name == "outbox.reconcilers.webhooks"
    ]
    assert actions == [Action.WEBHOOK_RETRY, Action.WEBHOOK_DELIVERED]
    assert all("/hooks/outbox" not in r.getMessage() for r in caplog.records)


def test_a_process_killed_after_the_escalation_commit_still_delivers(
    engine: Engine, webhook: Receiver, make_deliverer: MakeDeliverer
) -> None:
    """The move committed on its own connection; a deliverer started later sends its webhook."""
    op = make_operation(engine, State.UNKNOWN)
    with engine.connect() as conn:
        apply_move(
            conn,
            op.id,
            from_state=State.UNKNOWN,
            to_state=State.NEEDS_HUMAN,
            actor=Actor.RECONCILER,
            reason="no lookup",
        )
        conn.commit()
    # Nothing of that process survives but the committed rows: a new deliverer finds them.
    assert make_deliverer().run_once().delivered == 1
    assert [verified(r)["data"]["operation_id"] for r in webhook.requests] == [str(op.id)]


def test_a_deliverer_killed_mid_send_is_replaced_after_its_lease(
    engine: Engine, webhook: Receiver, make_deliverer: MakeDeliverer
) -> None:
    """A row leased by a deliverer that died is left alone until the lease ends, then delivered."""
    escalate(engine)
    config = DeliveryConfig()
    with engine.begin() as conn:
        [claimed] = sql.webhooks.claim_due(conn, limit=10, lease_s=config.lease_s)
    # The claiming deliverer is gone (never POSTed, never recorded).
    deliverer = make_deliverer()
    assert deliverer.run_once().attempted == 0
    age_deliveries(engine, config.lease_s + 1, "next_attempt_at")
    assert deliverer.run_once().delivered == 1
    assert [r.headers["webhook-id"] for r in webhook.requests] == [str(claimed.id)]
    assert only_delivery(engine).attempts == 1


def test_a_lost_lease_does_not_overwrite_the_new_holder(
    engine: Engine, webhook: Receiver, make_deliverer: MakeDeliverer
) -> None:
    """An outcome fenced on an expired, re-claimed lease is not recorded."""
    escalate(engine)
    with engine.begin() as conn:
        [first] = sql.webhooks.claim_due(conn, limit=10, lease_s=300)
    age_deliveries(engine, 301, "next_attempt_at")
    with engine.begin() as conn:
        [second] = sql.webhooks.claim_due(conn, limit=10, lease_s=300)
        assert sql.webhooks.record_delivered(conn, first, status=200) is None
        assert sql.webhooks.record_delivered(conn, second, status=200) == 1
    assert only_delivery(engine).status is DeliveryStatus.DELIVERED


def test_two_deliverers_at_once_deliver_each_row_once(
    engine: Engine, configure: Configure, make_deliverer: MakeDeliverer
) -> None:
    """Two deliverers racing over the same rows send each webhook exactly once (SKIP LOCKED)."""
    slow = Receiver(delay_s=0.02)
    try:
        configure(slow.url)
        for _ in range(12):
            escalate(engine)
        deliverers = [make_deliverer(batch_size=2), make_deliverer(batch_size=2)]
        barrier = threading.Barrier(2)
        totals: list[int] = []
        errors: list[BaseException] = []

        def drain(deliverer: WebhookDeliverer) -> None:
            try:
                barrier.wait(timeout=10)
                done = 0
                while (result := deliverer.run_once()).attempted:
                    done += result.delivered
                totals.append(done)
            except BaseException as exc:  # noqa: BLE001 -- reported by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=drain, args=(d,)) for d in deliverers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == []
        assert sum(totals) == 12
        sent = Counter(r.headers["webhook-id"] for r in slow.requests)
        assert len(sent) == 12
        assert set(sent.values()) == {1}
        assert {d.status for d in deliveries(engine)} == {DeliveryStatus.DELIVERED}
    finally:
        slow.close()


def test_deliver_one_sends_only_that_delivery(engine: Engine, webhook: Receiver) -> None:
    """deliver_one sends the delivery it names and leaves the others pending."""
    escalate(engine)
    escalate(engine)
    first, second = deliveries(engine)
    assert deliver_one(engine, second.id).delivered == 1
    assert [r.headers["webhook-id"] for r in webhook.requests] == [str(second.id)]
    assert deliver_one(engine, second.id).attempted == 0
    assert {d.id: d.status for d in deliveries(engine)} == {
        first.id: DeliveryStatus.PENDING,
        second.id: DeliveryStatus.DELIVERED,
    }


def test_the_deliverer_sends_nothing_when_webhooks_are_off(
    engine: Engine, webhook: Receiver, configure: Configure, make_deliverer: MakeDeliverer
) -> None:
    """Rows written while webhooks were on wait, untouched, while the URL is unset."""
    escalate(engine)
    configure(None, secret=None)
    assert make_deliverer().run_once().attempted == 0
    assert webhook.requests == []
    assert only_delivery(engine).status is DeliveryStatus.PENDING


# --- settings, backoff, schema -------------------------------------------------------------


def _settings(**values: Any) -> Settings:
    return load_settings(**values)


def test_a_url_without_a_secret_is_refused_naming_the_variable(
    engine: Engine, configure: Configure
) -> None:
    """OUTBOX_WEBHOOK_URL without OUTBOX_WEBHOOK_SECRET stops the deliverer at start-up."""
    settings = _settings(webhook_url="https://hooks.example.com/x")
    with pytest.raises(ConfigError, match="OUTBOX_WEBHOOK_SECRET"):
        webhooks.check_settings(settings)
    with pytest.raises(ConfigError, match="OUTBOX_WEBHOOK_SECRET"):
        WebhookDeliverer(engine, settings=settings)


@pytest.mark.parametrize(
    "secret",
    ["not base64 !!", "whsec_", "whsec_" + base64.b64encode(b"short").decode()],
)
def test_a_malformed_secret_is_refused(configure: Configure, secret: str) -> None:
    """A secret that is not whsec_ + base64 of at least 24 bytes is refused, naming the variable."""
    settings = _settings(webhook_url="https://hooks.example.com/x", webhook_secret=secret)
    with pytest.raises(ConfigError, match="OUTBOX_WEBHOOK_SECRET"):
        webhooks.check_settings(settings)


@pytest.mark.parametrize(
    "url", ["ftp://hooks.example.com/x", "file:///etc/passwd", "gopher://h/", "hooks.example.com"]
)
def test_only_http_and_https_urls_are_accepted(configure: Configure, url: str) -> None:
    """Any other scheme is refused when the settings load, naming OUTBOX_WEBHOOK_URL."""
    with pytest.raises(ConfigError, match="OUTBOX_WEBHOOK_URL"):
        _settings(webhook_url=url, webhook_secret=SECRET)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8080/hook", "https://hooks.example.com/x?t=1"])
def test_http_and_https_urls_with_a_secret_pass(configure: Configure, url: str) -> None:
    """An http(s) URL with a valid secret yields the endpoint; its repr hides the URL."""
    endpoint = webhooks.check_settings(_settings(webhook_url=url, webhook_secret=SECRET))
    assert endpoint is not None
    assert endpoint.url == url
    assert url not in repr(endpoint)


def test_webhooks_are_off_without_a_url(configure: Configure) -> None:
    """No URL: check_settings says webhooks are off, whatever the secret."""
    assert webhooks.check_settings(_settings()) is None


def test_the_event_names_match_the_settings() -> None:
    """Every event the settings accept is one the core can produce, and no other."""
    assert {event.value for event in WebhookEvent} == WEBHOOK_EVENT_NAMES


def test_backoff_doubles_from_five_seconds_and_is_capped_at_an_hour() -> None:
    """Retry delays start near 5 s, roughly double, and never exceed one hour."""
    config = DeliveryConfig()
    for attempts, expected in ((1, 5.0), (2, 10.0), (3, 20.0), (8, 640.0)):
        assert 0.8 * expected <= backoff_s(attempts, config) <= 1.2 * expected
    assert backoff_s(12, config) <= 3600.0
    assert backoff_s(1000, config) == 3600.0


def test_a_lease_shorter_than_a_batch_is_refused() -> None:
    """A lease that a batch of POSTs at their timeout could outlast is a configuration error."""
    with pytest.raises(ValueError, match="lease_s"):
        DeliveryConfig(batch_size=10, timeout_s=10, lease_s=60)


def test_the_schema_refuses_a_delivered_row_without_delivered_at(
    engine: Engine, webhook: Receiver
) -> None:
    """CHECK: status 'delivered' if and only if delivered_at is set."""
    escalate(engine)
    with pytest.raises(IntegrityError, match="delivered_iff_delivered_at"), engine.begin() as conn:
        conn.execute(text("UPDATE outbox.webhook_deliveries SET status = 'delivered'"))


def test_run_forever_delivers_until_stopped(
    engine: Engine, webhook: Receiver, make_deliverer: MakeDeliverer
) -> None:
    """run_forever delivers a row written while it runs, then returns promptly on stop()."""
    deliverer = make_deliverer(poll_interval_s=0.05)
    thread = threading.Thread(target=deliverer.run_forever)
    thread.start()
    try:
        escalate(engine)
        deadline = time.monotonic() + 10
        while not webhook.requests and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        deliverer.stop()
        thread.join(timeout=5)
    assert not thread.is_alive()
    assert len(webhook.requests) == 1
    assert only_delivery(engine).status is DeliveryStatus.DELIVERED


def test_unstorable_reasons_and_errors_are_stored_escaped(
    engine: Engine, webhook: Receiver
) -> None:
    """A move's reason and a delivery's error holding NUL or bytes that are not UTF-8 are
    stored escaped, so neither the escalation nor its failed delivery is lost."""
    op = make_operation(engine, State.UNKNOWN)
    move(engine, op, State.NEEDS_HUMAN, Actor.RECONCILER, reason="HTTP 200: a\x00b\udcff")
    with engine.begin() as conn:
        [claimed] = sql.webhooks.claim_due(conn, limit=10, lease_s=300)
        recorded = sql.webhooks.record_failed(
            conn,
            claimed,
            status=502,
            error="HTTP 502 Bad\x00Gateway",
            retry_in_s=5,
            give_up_after_s=3600,
        )
    assert recorded is not None
    assert json.loads(claimed.body)["data"]["reason"] == "HTTP 200: a\\x00b\\xff"
    assert only_delivery(engine).last_error == "HTTP 502 Bad\\x00Gateway"


# --- guard events: about a guard or budget key, not one operation ----------------------------


def _record_circuit_opened(engine: Engine) -> bool:
    with engine.begin() as conn:
        at = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
        return webhooks.record_guard_event(
            conn,
            WebhookEvent.CIRCUIT_OPENED,
            subject="breaker:deploy.create_release:project-a",
            data={"failures": 5, "open_until": "later"},
            at=at,
        )


def test_a_guard_event_is_delivered_signed_with_its_subject(
    engine: Engine, webhook: Receiver, make_deliverer: MakeDeliverer
) -> None:
    """A guard event's row names its subject, not an operation; it is sent as guard.<event>."""
    assert _record_circuit_opened(engine)
    row = only_delivery(engine)
    assert (row.operation_id, row.subject) == (None, "breaker:deploy.create_release:project-a")
    assert make_deliverer().run_once().delivered == 1
    (received,) = webhook.requests
    body = verified(received)
    assert body["type"] == "guard.circuit_opened"
    assert body["data"] == {
        "subject": "breaker:deploy.create_release:project-a",
        "failures": 5,
        "open_until": "later",
    }


def test_an_unsubscribed_guard_event_writes_nothing(
    engine: Engine, configure: Configure, receiver: Receiver
) -> None:
    """Without the event in OUTBOX_WEBHOOK_EVENTS (or without a URL) no row is written."""
    configure(receiver.url, events="needs_human")
    assert not _record_circuit_opened(engine)
    configure(None, secret=None)
    assert not _record_circuit_opened(engine)
    assert deliveries(engine) == []


def test_a_delivery_about_nothing_is_refused_by_the_database(engine: Engine) -> None:
    """A row with neither an operation nor a subject breaks a CHECK."""
    with pytest.raises(IntegrityError, match="about_something"), engine.begin() as conn:
        sql.webhooks.insert_deliveries(
            conn, [{"operation_id": None, "event": "circuit_opened", "payload": {}}]
        )


def test_an_operation_event_is_not_a_guard_event(engine: Engine, webhook: Receiver) -> None:
    """record_guard_event refuses an operation's event."""
    with (
        pytest.raises(ValueError, match="needs_human is about an operation"),
        engine.begin() as conn,
    ):
        webhooks.record_guard_event(
            conn,
            WebhookEvent.NEEDS_HUMAN,
            subject="x",
            data={},
            at=conn.execute(text("SELECT clock_timestamp()")).scalar_one(),
        )
