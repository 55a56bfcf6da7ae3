"""The dispatch attempt's spans, with an OpenTelemetry SDK set up in process: in the trace of
the agent that enqueued the operation, the tool call a child of the attempt, the state changes
and the outcome as events, the remote handed the call span's context, no payload value."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from sqlalchemy import Engine

from outbox import approval, tracing
from outbox.contracts import ContractTable
from outbox.dev.service import DeployService
from outbox.reconcilers.lookup import CALL_SPAN as LOOKUP_CALL_SPAN
from outbox.reconcilers.lookup import LOOKUP_SPAN, LookupOutcome, lookup
from outbox.reconcilers.route import RECONCILE_SPAN
from outbox.reconcilers.sweep import SweepConfig, Sweeper
from outbox.relay import Relay, RelayConfig
from outbox.states import State
from outbox.tools import Ambiguous, Applied, DispatchResult, ToolCall, ToolRegistry, tool
from outbox.workers.dispatch import CALL_SPAN, DISPATCH_SPAN, Outcome, dispatch
from tests.factories import age, make_operation
from tests.tool_configs import http_registry

TOOL = "deploy.create_release"
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
AGENT_SPAN_ID = 0xB7AD6B7169203331
PAYLOAD_VALUE = "payload-value-never-in-a-span"

_EXPORTER = InMemorySpanExporter()
_SET_UP = threading.Lock()


def collecting() -> InMemorySpanExporter:
    """This process's SDK tracer provider (set once: OpenTelemetry allows one), its finished
    spans collected in memory, emptied."""
    with _SET_UP:
        if not tracing.active():
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
            trace.set_tracer_provider(provider)
    assert tracing.active()
    _EXPORTER.clear()
    return _EXPORTER


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """The spans finished during the test (:func:`collecting`)."""
    yield collecting()
    _EXPORTER.clear()


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
    assert attempt.parent.span_id == AGENT_SPAN_ID
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
    assert one.parent.span_id == AGENT_SPAN_ID
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
    assert looked.parent.span_id == AGENT_SPAN_ID
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
        assert span.parent.span_id == AGENT_SPAN_ID
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
    assert (span.parent.trace_id, span.parent.span_id) == (TRACE_ID, AGENT_SPAN_ID)
    assert (span.attributes or {})["outbox.decision"] == "human"
    assert [e.name for e in span.events] == ["outbox.state.needs_human"]
