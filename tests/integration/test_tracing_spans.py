"""The outbox's spans, with an OpenTelemetry SDK set up in process: the enqueue a child of the
agent's span and the parent of the operation's later spans (its context is the one stored),
the dispatch attempt with its tool call a child, the state changes and the outcome as events,
the remote handed the call span's context, the sweep's run, MCP tool calls, no payload value."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from sqlalchemy import Engine

from outbox import api, approval, trace_context, tracing
from outbox.contracts import ContractTable
from outbox.dev.service import DeployService
from outbox.errors import IntentConflict
from outbox.reconcilers.lookup import CALL_SPAN as LOOKUP_CALL_SPAN
from outbox.reconcilers.lookup import LOOKUP_SPAN, LookupOutcome, lookup
from outbox.reconcilers.route import RECONCILE_SPAN
from outbox.reconcilers.sweep import SweepConfig, Sweeper
from outbox.relay import Relay, RelayConfig
from outbox.states import State
from outbox.tools import Ambiguous, Applied, DispatchResult, ToolCall, ToolRegistry, tool
from outbox.workers.dispatch import CALL_SPAN, DISPATCH_SPAN, Outcome, dispatch
from tests.factories import age, make_operation
from tests.otel import collecting, enqueue_spans, traceparent_of
from tests.tool_configs import http_registry

TOOL = "deploy.create_release"
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
AGENT_SPAN_ID = 0xB7AD6B7169203331
PAYLOAD_VALUE = "payload-value-never-in-a-span"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The spans finished during the test (:func:`collecting`)."""
    exporter = collecting()
    yield exporter
    exporter.clear()


class Remote:
    """A Python tool's remote recording the trace context each call was handed."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.answer: DispatchResult = Applied("ref-1")

    def __call__(self, call: ToolCall) -> DispatchResult:
        self.calls.append(call)
        return self.answer


@pytest.fixture
def registry() -> ToolRegistry:
    return ToolRegistry(ContractTable())


@pytest.fixture
def remote(registry: ToolRegistry) -> Remote:
    target = Remote()
    tool(TOOL, timeout=2, send_deadline=2, inflight_horizon=60, registry=registry)(target)
    return target


def _enqueued_in_agent_span(engine: Engine, **kwargs: Any) -> Any:
    span = NonRecordingSpan(
        SpanContext(TRACE_ID, AGENT_SPAN_ID, is_remote=False, trace_flags=TraceFlags(1))
    )
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        return make_operation(engine, payload={"secret": PAYLOAD_VALUE}, **kwargs)
    finally:
        otel_context.detach(token)


def _enqueue_span_id(op: Any) -> int:
    """The span id of ``op``'s stored context: its outbox.enqueue span's, the parent of the
    operation's later spans."""
    assert op.traceparent is not None
    return int(op.traceparent[36:52], 16)


def _by_name(finished: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in finished}


def _no_payload_value(finished: tuple[ReadableSpan, ...]) -> None:
    for span in finished:
        values = [str(v) for v in (span.attributes or {}).values()]
        values += [str(v) for e in span.events for v in (e.attributes or {}).values()]
        assert not any(PAYLOAD_VALUE in value for value in values), span.name


def test_an_attempt_is_a_child_of_the_agents_span_and_its_call_a_child_of_it(
    engine: Engine, registry: ToolRegistry, remote: Remote, spans: InMemorySpanExporter
) -> None:
    """outbox.dispatch (CONSUMER) has the agent's span as parent, outbox.tool.call (CLIENT) the
    attempt; sent and the outcome are events; the tool was handed the call span's context."""
    op = _enqueued_in_agent_span(engine)
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.CONFIRMED
    finished = spans.get_finished_spans()
    named = _by_name(finished)
    attempt, call = named[DISPATCH_SPAN], named[CALL_SPAN]
    assert attempt.context is not None
    assert call.context is not None
    assert attempt.context.trace_id == call.context.trace_id == TRACE_ID
    assert attempt.parent is not None
    assert attempt.parent.span_id == _enqueue_span_id(op)
    assert call.parent is not None
    assert call.parent.span_id == attempt.context.span_id
    assert (attempt.kind, call.kind) == (SpanKind.CONSUMER, SpanKind.CLIENT)
    attributes = attempt.attributes or {}
    assert attributes[tracing.OPERATION_ID] == str(op.id)
    assert (attributes[tracing.TOOL], attributes[tracing.TARGET]) == (TOOL, "project-a")
    assert (attributes[tracing.OUTCOME], attributes[tracing.ATTEMPT]) == ("confirmed", 1)
    assert [e.name for e in attempt.events] == ["outbox.state.sent", "outbox.outcome"]
    assert (call.attributes or {})["outbox.result"] == "Applied"
    (handed,) = remote.calls
    assert handed.trace is not None
    assert handed.trace.trace_id == f"{TRACE_ID:032x}"
    assert handed.trace.span_id == f"{call.context.span_id:016x}"
    _no_payload_value(finished)


def test_an_operation_without_a_caller_trace_gets_a_trace_of_its_own(
    engine: Engine, registry: ToolRegistry, remote: Remote, spans: InMemorySpanExporter
) -> None:
    """No stored context: the attempt is a root span; an ambiguous answer's outcome is unknown."""
    remote.answer = Ambiguous("timeout")
    op = make_operation(engine, payload={"secret": PAYLOAD_VALUE})
    assert op.traceparent is None
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.UNKNOWN
    named = _by_name(spans.get_finished_spans())
    assert named[DISPATCH_SPAN].parent is None
    assert (named[DISPATCH_SPAN].attributes or {})[tracing.OUTCOME] == "unknown"
    _no_payload_value(spans.get_finished_spans())


class _Confirming:
    """A publisher whose broker confirms every message but ``refused``'s."""

    def __init__(self, refused: set[Any]) -> None:
        self.refused = refused

    def publish(self, messages: Any) -> set[Any]:
        return {m.operation_id for m in messages} - self.refused

    def close(self) -> None:
        pass


def test_the_relay_publish_is_a_producer_span_in_each_operations_trace(
    engine: Engine, spans: InMemorySpanExporter
) -> None:
    """Each claimed operation gets an outbox.publish PRODUCER span, child of its agent's span
    (a root span without one), saying whether the broker confirmed it."""
    traced = _enqueued_in_agent_span(engine)
    untraced = make_operation(engine)
    relay = Relay(engine, _Confirming({untraced.id}), RelayConfig())
    assert relay.run_once().claimed == 2
    published = {
        (s.attributes or {})[tracing.OPERATION_ID]: s
        for s in spans.get_finished_spans()
        if s.name == tracing.PUBLISH_SPAN
    }
    one, other = published[str(traced.id)], published[str(untraced.id)]
    assert one.kind is SpanKind.PRODUCER
    assert one.context is not None
    assert one.context.trace_id == TRACE_ID
    assert one.parent is not None
    assert one.parent.span_id == _enqueue_span_id(traced)
    assert other.parent is None
    assert (
        (one.attributes or {})["outbox.published"],
        (other.attributes or {})["outbox.published"],
    ) == (True, False)


def test_a_lookup_of_an_unknown_operation_lands_in_the_agents_trace(
    engine: Engine, spans: InMemorySpanExporter, tmp_path: Path
) -> None:
    """An attempt that committed then timed out is unknown; its lookup's span (outbox.lookup,
    its call outbox.tool.lookup a CLIENT child) is in the agent's trace, outcome confirmed."""
    with DeployService(port=0, fault_delay_s=2.0) as service:
        registry = http_registry(tmp_path, service.url, inflight_horizon_s=60)
        op = _enqueued_in_agent_span(engine)
        service.faults.arm_key(str(op.id), "commit_then_timeout", 1)
        assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.UNKNOWN
        spans.clear()
        assert lookup(op.id, engine=engine, registry=registry).outcome is LookupOutcome.CONFIRMED
    named = _by_name(spans.get_finished_spans())
    looked, call = named[LOOKUP_SPAN], named[LOOKUP_CALL_SPAN]
    assert looked.context is not None
    assert looked.context.trace_id == TRACE_ID
    assert looked.parent is not None
    assert looked.parent.span_id == _enqueue_span_id(op)
    assert call.parent is not None
    assert call.parent.span_id == looked.context.span_id
    assert call.kind is SpanKind.CLIENT
    http = call.attributes or {}
    assert (http["http.request.method"], http["server.address"]) == ("GET", "127.0.0.1")
    assert (looked.attributes or {})[tracing.OUTCOME] == "confirmed"
    _no_payload_value(spans.get_finished_spans())


def test_an_approval_and_a_rejection_are_spans_naming_the_approver(
    engine: Engine, spans: InMemorySpanExporter
) -> None:
    """outbox.approve and outbox.reject spans are in the agent's trace, with
    outbox.decided_by and the move as an event."""
    approved = _enqueued_in_agent_span(engine, state=State.AWAITING_APPROVAL)
    rejected = _enqueued_in_agent_span(engine, state=State.AWAITING_APPROVAL)
    with engine.begin() as conn:
        approval.approve(conn, approved.id, payload_hash=approved.payload_hash, by="alice")
        approval.reject(conn, rejected.id, by="bob", reason="not today")
    named = _by_name(spans.get_finished_spans())
    for name, op, who, state in (
        ("outbox.approve", approved, "alice", "planned"),
        ("outbox.reject", rejected, "bob", "cancelled"),
    ):
        span = named[name]
        assert span.parent is not None
        assert span.parent.span_id == _enqueue_span_id(op)
        attributes = span.attributes or {}
        assert (attributes[tracing.OPERATION_ID], attributes[tracing.DECIDED_BY]) == (
            str(op.id),
            who,
        )
        assert [e.name for e in span.events] == [f"outbox.state.{state}"]


def test_an_escalation_by_the_sweep_lands_in_the_agents_trace(
    engine: Engine, registry: ToolRegistry, remote: Remote, spans: InMemorySpanExporter
) -> None:
    """An unknown operation without lookup or dedup, past its horizon, is escalated by the
    sweep: an outbox.reconcile span in the agent's trace, decision human, needs_human event."""
    remote.answer = Ambiguous("timeout")
    op = _enqueued_in_agent_span(engine)
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.UNKNOWN
    age(engine, op.id, 120, "sent_at", "first_sent_at")
    spans.clear()
    sweeper = Sweeper(
        engine, registry=registry, config=SweepConfig(sent_timeout_s=5, sent_max_age_s=60)
    )
    assert sweeper.run_once().escalated == 1
    (span,) = [s for s in spans.get_finished_spans() if s.name == RECONCILE_SPAN]
    assert span.parent is not None
    assert (span.parent.trace_id, span.parent.span_id) == (TRACE_ID, _enqueue_span_id(op))
    assert (span.attributes or {})["outbox.decision"] == "human"
    assert [e.name for e in span.events] == ["outbox.state.needs_human"]


def _in_agent_span() -> Any:
    return trace.use_span(
        NonRecordingSpan(
            SpanContext(TRACE_ID, AGENT_SPAN_ID, is_remote=False, trace_flags=TraceFlags(1))
        ),
        end_on_exit=False,
    )


def test_an_enqueue_is_a_producer_span_in_the_agents_trace_whose_context_is_stored(
    engine: Engine, spans: InMemorySpanExporter
) -> None:
    """enqueue in the agent's span is an outbox.enqueue PRODUCER child of it, naming the new
    operation; the operation's stored context is that span's; the same intent again is a
    second span marked existing, the stored context unchanged."""
    with _in_agent_span(), engine.begin() as conn:
        op = api.enqueue(
            conn, tool=TOOL, target="e-1", payload={"secret": PAYLOAD_VALUE}, intent_key="e-1"
        )
    with _in_agent_span(), engine.begin() as conn:
        again = api.enqueue(
            conn, tool=TOOL, target="e-1", payload={"secret": PAYLOAD_VALUE}, intent_key="e-1"
        )
    first, second = enqueue_spans(spans, op.id)
    assert first.kind is SpanKind.PRODUCER
    assert first.parent is not None
    assert (first.parent.trace_id, first.parent.span_id) == (TRACE_ID, AGENT_SPAN_ID)
    assert op.traceparent == traceparent_of(first)
    assert again.id == op.id
    assert again.traceparent == op.traceparent
    attributes = first.attributes or {}
    assert (attributes[tracing.TOOL], attributes[tracing.TARGET]) == (TOOL, "e-1")
    assert attributes["messaging.operation.type"] == "create"
    assert (attributes[tracing.EXISTING], (second.attributes or {})[tracing.EXISTING]) == (
        False,
        True,
    )
    _no_payload_value(spans.get_finished_spans())


def test_a_batch_gives_each_operation_its_own_enqueue_span(
    engine: Engine, spans: InMemorySpanExporter
) -> None:
    """enqueue_many records one outbox.enqueue span per operation, each operation storing its
    own span's context."""
    with _in_agent_span(), engine.begin() as conn:
        ops = api.enqueue_many(conn, [api.Intent(TOOL, f"b-{n}", {"n": n}) for n in range(3)])
    for op in ops:
        (span,) = enqueue_spans(spans, op.id)
        assert span.parent is not None
        assert span.parent.span_id == AGENT_SPAN_ID
        assert op.traceparent == traceparent_of(span)
    assert len({op.traceparent for op in ops}) == 3


def test_a_refused_enqueue_is_an_error_span(engine: Engine, spans: InMemorySpanExporter) -> None:
    """An intent key conflict leaves an outbox.enqueue span with an error status naming it."""
    make_operation(engine, target="c-1", intent_key="c-1")
    spans.clear()
    with pytest.raises(IntentConflict), _in_agent_span(), engine.begin() as conn:
        api.enqueue(conn, tool=TOOL, target="c-2", payload={}, intent_key="c-1")
    (span,) = [s for s in spans.get_finished_spans() if s.name == tracing.ENQUEUE_SPAN]
    assert span.status.status_code is trace.StatusCode.ERROR
    assert span.status.description == "IntentConflict"


def test_without_a_caller_trace_an_enqueue_makes_no_span(
    engine: Engine, spans: InMemorySpanExporter
) -> None:
    """Tracing on but no caller's trace: no outbox.enqueue span, nothing stored."""
    op = make_operation(engine)
    assert op.traceparent is None
    assert [s for s in spans.get_finished_spans() if s.name == tracing.ENQUEUE_SPAN] == []


def test_a_sweep_run_is_one_span_naming_what_it_looked_at_and_moved(
    engine: Engine, registry: ToolRegistry, remote: Remote, spans: InMemorySpanExporter
) -> None:
    """One outbox.sweep span per run with outbox.sweep.examined and .moved; the escalation it
    decides is an outbox.reconcile span in the agent's trace, linked to the sweep's."""
    remote.answer = Ambiguous("timeout")
    op = _enqueued_in_agent_span(engine)
    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.UNKNOWN
    age(engine, op.id, 120, "sent_at", "first_sent_at")
    spans.clear()
    sweeper = Sweeper(
        engine, registry=registry, config=SweepConfig(sent_timeout_s=5, sent_max_age_s=60)
    )
    assert sweeper.run_once().escalated == 1
    (sweep,) = [s for s in spans.get_finished_spans() if s.name == tracing.SWEEP_SPAN]
    attributes = sweep.attributes or {}
    assert isinstance(examined := attributes[tracing.SWEEP_EXAMINED], int)
    assert examined >= 1
    assert (attributes[tracing.SWEEP_MOVED], attributes["outbox.sweep.escalated"]) == (1, 1)
    (decided,) = [s for s in spans.get_finished_spans() if s.name == RECONCILE_SPAN]
    assert sweep.context is not None
    assert [link.context.span_id for link in decided.links] == [sweep.context.span_id]
    assert sweeper.run_once().escalated == 0
    spans.clear()
    sweeper.run_once()
    (idle,) = [s for s in spans.get_finished_spans() if s.name == tracing.SWEEP_SPAN]
    assert (idle.attributes or {})[tracing.SWEEP_MOVED] == 0


def test_async_tool_calls_in_one_thread_each_see_their_own_call_span(
    engine: Engine, registry: ToolRegistry, spans: InMemorySpanExporter
) -> None:
    """Two async tool calls run on the same thread's event loop one after the other each
    see their own outbox.tool.call span as the current one (not the first call's)."""
    seen: list[str | None] = []

    async def remote(call: ToolCall) -> DispatchResult:
        here = trace_context.current()
        seen.append(here.span_id if here is not None else None)
        return Applied(f"ref-{call.operation_id}")

    tool(TOOL, timeout=2, send_deadline=2, inflight_horizon=60, registry=registry)(remote)
    first, second = _enqueued_in_agent_span(engine), _enqueued_in_agent_span(engine)
    for op in (first, second):
        assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.CONFIRMED
    calls = [s for s in spans.get_finished_spans() if s.name == CALL_SPAN]
    expected = []
    for call_span in calls:
        assert call_span.context is not None
        expected.append(f"{call_span.context.span_id:016x}")
    assert len(set(seen)) == 2
    assert seen == expected


_SQL_SCRIPT = """
import asyncio, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import text
from outbox import tracing
from outbox.db import create_async_engine, create_engine

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
print(tracing.setup("outbox-relay", instrument=("sqlalchemy",)))
url = sys.argv[1]
engine = create_engine(url)
with engine.connect() as conn:
    conn.execute(text("SELECT 1"))

async def main():
    aengine = create_async_engine(url)
    async with aengine.connect() as conn:
        await conn.execute(text("SELECT 2"))
    await aengine.dispose()

asyncio.run(main())
print(sorted({s.attributes.get("db.statement") or s.attributes.get("db.query.text") or ""
              for s in exporter.get_finished_spans()} - {""}))
"""


@pytest.mark.parametrize("sql", ["1", ""])
def test_sql_statement_spans_only_with_outbox_otel_sql(database_url: str, sql: str) -> None:
    """With tracing on, SQLAlchemy's per-statement spans (sync and async engines) are made
    only when OUTBOX_OTEL_SQL=1."""
    env = {**os.environ, "OUTBOX_OTEL": "1", "OUTBOX_OTEL_SQL": sql}
    done = subprocess.run(
        [sys.executable, "-c", _SQL_SCRIPT, database_url],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "True"
    assert lines[-1] == ("['SELECT 1', 'SELECT 2']" if sql == "1" else "[]"), done.stdout
