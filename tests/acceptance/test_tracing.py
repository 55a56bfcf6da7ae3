"""Issue 34's acceptance test: one trace from the agent's span to the remote's answer, with the
agent's ``outbox enqueue``, the relay, a worker, beat and the API as real processes exporting
OTLP over HTTP to a receiver in this test (decoded with opentelemetry-proto), on RabbitMQ and
on the database broker.

The agent's span is the caller's context at ``enqueue`` here (its trace and span ids chosen by
the test, handed to ``outbox enqueue`` as ``TRACEPARENT``); the enqueue is a span of that
trace and the parent of every later outbox span about the operation, the remote must be sent
a ``traceparent`` of it, no span may carry a payload value, and the processes' log lines
written inside those spans carry the trace id.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import tokens
from outbox.dev.tool_config import http_tool_toml
from outbox.models import TokenScope
from outbox.states import State
from tests import trace_waterfall
from tests.acceptance.conftest import clean_environment, run_outbox
from tests.api_server import running_api
from tests.otlp import Receiver, Span, receiving
from tests.processes import Services, wait_until
from tests.tool_configs import TOOL
from tests.trace_waterfall import in_tree

pytestmark = pytest.mark.slow

#: The agent's span: the caller's context at enqueue.
AGENT_TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
AGENT_SPAN_ID = 0x00F067AA0BA902B7
#: Payload values that must appear in no span (nor in any span event or attribute).
CONFIRMED_VERSION = "9.8.7-payload-only"
UNKNOWN_VERSION = "6.5.4-payload-only"
APPROVED_VERSION = "3.2.1-payload-only"


@dataclass
class Remote:
    """The test's HTTP service: what it saw, and the first POST of ``fail_key`` is a 500."""

    fail_key: str | None = None
    port: int = 0
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _RemoteServer(ThreadingHTTPServer):
    remote: Remote


class _RemoteHandler(BaseHTTPRequestHandler):
    server: _RemoteServer

    def do_POST(self) -> None:
        """A dispatch: 201 with an id, except the forced failure (500: the outcome is
        unknown, and the lookup then finds the release)."""
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        remote = self.server.remote
        key = self.headers.get("Idempotency-Key", "")
        with remote.lock:
            remote.requests.append(("POST", self.path, dict(self.headers.items())))
            failing = key == remote.fail_key
        if failing:
            self._answer(500, {"error": "lost the answer"})
        else:
            self._answer(201, {"id": f"rel-{key}"})

    def do_GET(self) -> None:
        """A lookup by key: the release exists."""
        remote = self.server.remote
        with remote.lock:
            remote.requests.append(("GET", self.path, dict(self.headers.items())))
        self._answer(200, {"id": "rel-" + self.path.rsplit("/", 1)[-1]})

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


@pytest.fixture
def remote() -> Iterator[Remote]:
    """The test's HTTP service, on a free port."""
    server = _RemoteServer(("127.0.0.1", 0), _RemoteHandler)
    server.remote = Remote()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    server.remote.port = server.server_address[1]
    try:
        yield server.remote
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """The OTLP receiver, on a free port."""
    with receiving() as running:
        yield running


@pytest.fixture
def stack_env(
    database_url: str, broker: str | None, remote: Remote, receiver: Receiver, tmp_path: Path
) -> dict[str, str]:
    """Every process exports OTLP/HTTP to the receiver, quickly (200 ms batches); the tool's
    in-flight horizon is short, so a lookup follows an unknown outcome within seconds."""
    config = tmp_path / "tools.toml"
    config.write_text(
        http_tool_toml(
            f"http://127.0.0.1:{remote.port}",
            timeout_s=2.0,
            send_deadline_s=1.0,
            inflight_horizon_s=8,
        ),
        encoding="utf-8",
    )
    env = clean_environment(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_CONFIG=str(config),
        OUTBOX_HOME=str(tmp_path / "home"),
        OUTBOX_REPUBLISH_AFTER="5",
        OUTBOX_SWEEP_INTERVAL="1",
        OUTBOX_OTEL="1",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.port}",
        OTEL_BSP_SCHEDULE_DELAY="200",
    )
    if broker is not None:
        env["OUTBOX_BROKER_URL"] = broker
    return env


@dataclass(frozen=True)
class Enqueued:
    """What ``outbox enqueue --json`` printed of the operation."""

    id: str
    traceparent: str
    payload_hash: str


#: The agent's span as W3C traceparent: what a traced script hands ``outbox enqueue``.
AGENT_TRACEPARENT = f"00-{AGENT_TRACE_ID:032x}-{AGENT_SPAN_ID:016x}-01"


def _enqueue_in_agent_span(
    env: dict[str, str], target: str, version: str, *, require_approval: bool = False
) -> Enqueued:
    """Enqueue as a traced agent's script does: ``outbox enqueue`` with its span's context in
    ``TRACEPARENT`` (and tracing on: its enqueue span exported like the components')."""
    done = run_outbox(
        "enqueue",
        f"--tool={TOOL}",
        f"--target={target}",
        f"--payload={json.dumps({'version': version})}",
        "--json",
        *(["--require-approval"] if require_approval else []),
        env={**env, "TRACEPARENT": AGENT_TRACEPARENT},
        timeout=120,
    )
    assert done.code == 0, done.stderr
    data = json.loads(done.stdout)
    return Enqueued(data["id"], data["traceparent"], data["payload_hash"])


def _state(engine: Engine, operation_id: object) -> str:
    with engine.connect() as conn:
        return str(
            conn.execute(
                text("SELECT state FROM outbox.operations WHERE id = :id"), {"id": operation_id}
            ).scalar_one()
        )


def _named(spans: list[Span], name: str) -> list[Span]:
    return [s for s in spans if s.name == name]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("broker", ["rabbitmq", "database"], indirect=True)
def test_one_trace_from_the_agents_span_to_the_remotes_answer(
    engine: Engine,
    services: Services,
    stack_env: dict[str, str],
    remote: Remote,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    """The enqueue is a span of the agent's trace and the parent of the operation's publish
    and dispatch attempt spans, the HTTP call's aiohttp span a child of the call span and the
    remote handed its traceparent, a forced unknown outcome's lookup lands in the same trace,
    the sweep's runs are spans naming what they looked at, no span carries a payload value,
    and the worker's log lines inside those spans carry the trace id; an approval through the
    HTTP API is a span of the same trace naming the approver, linked to the API's request span
    (the API's request spans children of the caller's traceparent, their query redacted)."""
    confirmed = _enqueue_in_agent_span(stack_env, "web", CONFIRMED_VERSION)
    unknown = _enqueue_in_agent_span(stack_env, "api", UNKNOWN_VERSION)
    gated = _enqueue_in_agent_span(stack_env, "db", APPROVED_VERSION, require_approval=True)
    with Session(engine) as session, session.begin():
        operator = tokens.create_token(session, name="alice", scope=TokenScope.OPERATOR).token
    # Stored: the enqueue span's context, in the agent's trace.
    assert confirmed.traceparent.startswith(f"00-{AGENT_TRACE_ID:032x}-")
    assert confirmed.traceparent != AGENT_TRACEPARENT
    remote.fail_key = unknown.id

    services.start("worker", "worker", "-c", "2", "-P", "threads")
    services.start("relay", "relay")
    services.start("beat", "beat")

    wait_until(
        lambda: _state(engine, confirmed.id) == State.CONFIRMED.value,
        timeout=90,
        what="the traced operation confirmed",
    )
    wait_until(
        lambda: _state(engine, unknown.id) == State.CONFIRMED.value,
        timeout=120,
        what="the unknown operation confirmed by its lookup",
    )
    # Every span of both operations exported (batches every 200 ms).
    wait_until(
        lambda: (
            bool(_named(receiver.of(unknown.id), "outbox.lookup"))
            and bool(_named(receiver.of(confirmed.id), "outbox.dispatch"))
            and bool(_named(receiver.all(), "outbox.sweep"))
        ),
        timeout=30,
        what="the spans exported",
    )

    # The remote saw the trace: the HTTP call's context, in the agent's trace.
    posts = [headers for method, _path, headers in remote.requests if method == "POST"]
    assert posts, remote.requests
    for headers in posts:
        assert headers["traceparent"].startswith(f"00-{AGENT_TRACE_ID:032x}-"), headers

    spans = receiver.of(confirmed.id)
    assert {s.trace_id for s in spans} == {AGENT_TRACE_ID}
    (enqueue,) = _named(spans, "outbox.enqueue")
    (publish,) = _named(spans, "outbox.publish")
    (dispatch,) = _named(spans, "outbox.dispatch")
    (call,) = _named(spans, "outbox.tool.call")
    # The enqueue: a PRODUCER child of the agent's span, its context the one stored.
    assert enqueue.parent_span_id == AGENT_SPAN_ID
    assert enqueue.kind == 4  # SPAN_KIND_PRODUCER
    assert enqueue.service == "outbox-cli"
    assert enqueue.attributes["outbox.intent.existing"] is False
    assert confirmed.traceparent.split("-")[2] == f"{enqueue.span_id:016x}"
    # publish and dispatch are children of the enqueue; the call of the attempt.
    assert publish.parent_span_id == enqueue.span_id
    assert publish.kind == 4  # SPAN_KIND_PRODUCER
    assert dispatch.parent_span_id == enqueue.span_id
    assert dispatch.kind == 5  # SPAN_KIND_CONSUMER
    assert call.parent_span_id == dispatch.span_id
    assert call.kind == 3  # SPAN_KIND_CLIENT
    # The attempt links the Celery task run it was part of (the Celery instrumentation's).
    everything = {(s.trace_id, s.span_id): s for s in receiver.all()}
    runs = [everything[link].name for link in dispatch.links if link in everything]
    assert any(name.startswith("run/") for name in runs), runs
    # The aiohttp instrumentation's CLIENT span, child of the call span, showing the URL
    # template (never the rendered URL); the remote was handed its context.
    (http,) = [s for s in receiver.all() if s.parent_span_id == call.span_id]
    assert http.kind == 3  # SPAN_KIND_CLIENT
    assert http.attributes["http.request.method"] == "POST"
    assert "{target}" in str(http.attributes.get("url.full")), http.attributes
    (confirmed_post,) = [
        h for m, _p, h in remote.requests if m == "POST" and h["Idempotency-Key"] == confirmed.id
    ]
    assert confirmed_post["traceparent"].split("-")[2] == f"{http.span_id:016x}"
    # The outcome, and the state change to sent as an event.
    assert dispatch.attributes["outbox.outcome"] == "confirmed"
    assert "outbox.state.sent" in [name for name, _ in dispatch.events]
    assert dispatch.attributes["outbox.tool"] == TOOL
    assert dispatch.attributes["outbox.target"] == "web"

    # The unknown outcome's lookup, later, in the same trace, under its enqueue.
    unknown_spans = receiver.of(unknown.id)
    assert {s.trace_id for s in unknown_spans} == {AGENT_TRACE_ID}
    (unknown_enqueue,) = _named(unknown_spans, "outbox.enqueue")
    (attempt,) = _named(unknown_spans, "outbox.dispatch")
    assert attempt.attributes["outbox.outcome"] == "unknown"
    lookups = _named(unknown_spans, "outbox.lookup")
    assert lookups
    assert all(lookup.parent_span_id == unknown_enqueue.span_id for lookup in lookups)
    gets = [h for m, _p, h in remote.requests if m == "GET"]
    assert gets
    assert all(h["traceparent"].startswith(f"00-{AGENT_TRACE_ID:032x}-") for h in gets)

    # The sweep: one span per run, naming what it looked at (the unknown operation, once due).
    sweeps = _named(receiver.all(), "outbox.sweep")
    assert all(s.service == "outbox-worker" for s in sweeps)
    assert all("outbox.sweep.examined" in s.attributes for s in sweeps)
    assert any(s.attributes["outbox.sweep.examined"] >= 1 for s in sweeps)

    # An approval through the API: a span of the agent's trace naming the approver.
    home = tmp_path / "api-home"
    home.mkdir()
    api_env = {
        **stack_env,
        "OUTBOX_HOME": str(home),
        "OUTBOX_CONSOLE_HASH_RATE": "1000",
        "OTEL_SERVICE_NAME": "outbox-api",
    }
    with running_api(api_env, tmp_path / "api.log") as api:
        answer = httpx.post(
            f"{api.url}/v1/operations/{gated.id}/approve",
            json={"payload_hash": gated.payload_hash},
            headers={"Authorization": f"Bearer {operator}"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        listed = httpx.get(
            f"{api.url}/v1/operations",
            params={"intent_key": "a-key-never-in-a-span"},
            headers={"Authorization": f"Bearer {operator}", "traceparent": AGENT_TRACEPARENT},
            timeout=30,
        )
        assert listed.status_code == 200, listed.text
        wait_until(
            lambda: (
                bool(_named(receiver.of(gated.id), "outbox.approve"))
                and bool(_named(receiver.all(), "GET /v1/operations"))
            ),
            timeout=30,
            what="the approval's and the listing's spans exported",
        )
    # The listing's request span: a child of the caller's traceparent, its query redacted.
    (listing,) = _named(receiver.all(), "GET /v1/operations")
    assert (listing.trace_id, listing.parent_span_id) == (AGENT_TRACE_ID, AGENT_SPAN_ID)
    assert listing.attributes["url.query"] == "REDACTED"
    assert b"a-key-never-in-a-span" not in listing.raw
    (gated_enqueue,) = _named(receiver.of(gated.id), "outbox.enqueue")
    (approve,) = _named(receiver.of(gated.id), "outbox.approve")
    assert approve.trace_id == AGENT_TRACE_ID
    assert approve.parent_span_id == gated_enqueue.span_id
    assert approve.attributes["outbox.decided_by"] == "alice"
    assert approve.service == "outbox-api"
    # Linked to the FastAPI instrumentation's SERVER span of the request that decided it.
    everything = {(s.trace_id, s.span_id): s for s in receiver.all()}
    (request,) = [everything[link] for link in approve.links if link in everything]
    assert request.kind == 2  # SPAN_KIND_SERVER
    assert request.name == "POST /v1/operations/{operation_id}/approve"

    # No payload value in any span, its attributes or events.
    for span in receiver.all():
        for version in (CONFIRMED_VERSION, UNKNOWN_VERSION, APPROVED_VERSION):
            assert version.encode() not in span.raw, span.name

    # The worker's log lines written inside the operation's spans carry the trace id.
    worker_log = dict(services.logs())["worker"]
    assert f"trace_id={AGENT_TRACE_ID:032x}" in worker_log, worker_log[-3000:]

    # The unknown operation's trace drawn as a waterfall (docs/observability.md's screenshot).
    _draw(receiver, unknown_enqueue, stack_env)


#: Where the waterfall of the last run is kept to look at (not in git).
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "tracing"
#: docs/observability.md's screenshot, written under OUTBOX_WRITE_DOCS_SCREENSHOT=1.
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "trace.png"


def _draw(receiver: Receiver, enqueue: Span, env: dict[str, str]) -> None:
    """The operation's spans (its enqueue and everything under it) as a waterfall page, kept
    in test-artifacts/tracing/ with its screenshot (when Debian's Chromium is there), and
    as docs/img/trace.png under OUTBOX_WRITE_DOCS_SCREENSHOT=1 (the RabbitMQ run)."""
    spans = in_tree([s for s in receiver.all() if s.trace_id == AGENT_TRACE_ID], [enqueue])
    html = trace_waterfall.render(
        spans, "One operation's trace: enqueued, sent, unknown, looked up, confirmed"
    )
    assert "outbox.lookup" in html
    name = "database" if "OUTBOX_BROKER_URL" not in env else "rabbitmq"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"trace-{name}.html").write_text(html, encoding="utf-8")
    if not trace_waterfall.CHROMIUM.exists():
        return
    trace_waterfall.screenshot(html, ARTIFACTS / f"trace-{name}.png")
    if os.environ.get("OUTBOX_WRITE_DOCS_SCREENSHOT") == "1" and name == "rabbitmq":
        trace_waterfall.screenshot(html, DOCS_SCREENSHOT)
