"""The caller's W3C trace context is recorded with the operation at enqueue (migration 0026):
from the current OpenTelemetry span (sync and async), from a door that passed one on, never
without a caller's trace, and never changed afterwards. With tracing on (an SDK tracer provider,
set here) the context stored is the outbox.enqueue span's, a child of the caller's; without
one (a subprocess), the caller's own."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import pytest
from mcp import Client
from mcp_types import RequestParamsMeta
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, TraceState
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession

from outbox import aio, api, trace_context
from outbox.contracts import ContractTable, ToolContract
from outbox.db import create_async_engine
from outbox.mcp import McpContext, create_server
from outbox.trace_context import TraceContext
from tests.factories import reload
from tests.otel import collecting, enqueue_spans, traceparent_of

TOOL = "deploy.create_release"
PAYLOAD: dict[str, Any] = {"version": "1.2.3"}
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SPAN_ID = 0xB7AD6B7169203331
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@contextmanager
def agent_span(tracestate: TraceState | None = None) -> Iterator[None]:
    """The agent's current span, as its tracing SDK would have started it."""
    span = NonRecordingSpan(
        SpanContext(
            TRACE_ID,
            SPAN_ID,
            is_remote=False,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
            trace_state=tracestate,
        )
    )
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        otel_context.detach(token)


@pytest.fixture(autouse=True)
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process (tests/otel.py): the spans finished during the test."""
    exporter = collecting()
    yield exporter
    exporter.clear()


def recorded_under(
    engine: Engine, spans: InMemorySpanExporter, operation_id: object, caller: str
) -> tuple[str | None, str | None]:
    """Check that the operation's stored traceparent is its enqueue span's, a child of the
    ``caller`` traceparent; the stored (traceparent, tracestate)."""
    first, *_ = enqueue_spans(spans, str(operation_id))
    assert first.parent is not None
    assert (f"{first.parent.trace_id:032x}", f"{first.parent.span_id:016x}") == (
        caller[3:35],
        caller[36:52],
    )
    found = stored(engine, operation_id)
    assert found[0] == traceparent_of(first)
    return found


def stored(engine: Engine, operation_id: object) -> tuple[str | None, str | None]:
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT traceparent, tracestate FROM outbox.operations WHERE id = :id"),
            {"id": operation_id},
        ).one()
    return row.traceparent, row.tracestate


def test_enqueue_in_an_agent_span_records_its_context(
    engine: Engine, spans: InMemorySpanExporter
) -> None:
    """enqueue inside the agent's span stores a context in that span's trace, its tracestate
    kept."""
    with agent_span(TraceState([("rojo", "00f067aa0ba902b7")])), engine.begin() as conn:
        op = api.enqueue(conn, tool=TOOL, target="t-1", payload=PAYLOAD)
    found = recorded_under(engine, spans, op.id, TRACEPARENT)
    assert found[1] == "rojo=00f067aa0ba902b7"
    assert (op.traceparent, op.tracestate) == found
    assert reload(engine, op.id) == op


def test_enqueue_without_a_caller_trace_records_nothing(engine: Engine) -> None:
    """Without a current span (or an invalid one) both columns stay NULL."""
    with engine.begin() as conn:
        op = api.enqueue(conn, tool=TOOL, target="t-2", payload=PAYLOAD)
    assert (op.traceparent, op.tracestate) == (None, None)
    assert stored(engine, op.id) == (None, None)
    token = otel_context.attach(trace.set_span_in_context(trace.INVALID_SPAN))
    try:
        with engine.begin() as conn:
            op = api.enqueue(conn, tool=TOOL, target="t-3", payload=PAYLOAD)
    finally:
        otel_context.detach(token)
    assert stored(engine, op.id) == (None, None)


def test_enqueue_many_records_the_context_of_each(
    engine: Engine, spans: InMemorySpanExporter
) -> None:
    """Every operation of a batch enqueued in the agent's span carries its context."""
    with agent_span(), engine.begin() as conn:
        ops = api.enqueue_many(
            conn, [api.Intent(TOOL, f"m-{n}", PAYLOAD, intent_key=f"m-{n}") for n in range(3)]
        )
    for op in ops:
        assert recorded_under(engine, spans, op.id, TRACEPARENT) == (op.traceparent, None)


def test_a_context_passed_on_by_a_door_wins_over_the_current_span(
    engine: Engine, spans: InMemorySpanExporter
) -> None:
    """The HTTP API's or MCP's caller context (passed) is recorded, not the server's span."""
    theirs = TraceContext("00-11111111111111111111111111111111-2222222222222222-01", "k=v")
    with agent_span(), trace_context.passed(theirs), engine.begin() as conn:
        op = api.enqueue(conn, tool=TOOL, target="t-4", payload=PAYLOAD)
    assert recorded_under(engine, spans, op.id, theirs.traceparent)[1] == "k=v"


def test_the_same_intent_again_keeps_the_first_context(
    engine: Engine, spans: InMemorySpanExporter
) -> None:
    """A retry of the same intent from another trace finds the operation, its context unchanged."""
    with agent_span(), engine.begin() as conn:
        first = api.enqueue(conn, tool=TOOL, target="t-5", payload=PAYLOAD, intent_key="same")
    other = TraceContext("00-11111111111111111111111111111111-2222222222222222-01")
    with trace_context.passed(other), engine.begin() as conn:
        again = api.enqueue(conn, tool=TOOL, target="t-5", payload=PAYLOAD, intent_key="same")
    assert again.id == first.id
    assert recorded_under(engine, spans, first.id, TRACEPARENT) == (first.traceparent, None)


def test_the_context_is_immutable(engine: Engine) -> None:
    """An UPDATE of the stored traceparent is refused by the immutability trigger."""
    with agent_span(), engine.begin() as conn:
        op = api.enqueue(conn, tool=TOOL, target="t-6", payload=PAYLOAD)
    with pytest.raises(DBAPIError, match="traceparent is immutable"), engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox.operations SET traceparent = NULL WHERE id = :id"), {"id": op.id}
        )
    assert stored(engine, op.id) == (op.traceparent, None)


@pytest.mark.parametrize("kind", ["connection", "session"])
def test_async_enqueue_records_the_agent_span_of_its_task(
    engine: Engine, spans: InMemorySpanExporter, database_url: str, kind: str
) -> None:
    """outbox.aio.enqueue takes the context of the awaiting task (run_sync's greenlet has its
    own), on an AsyncConnection and an AsyncSession."""

    async def main() -> Any:
        async_engine = create_async_engine(database_url)
        try:
            with agent_span():
                if kind == "connection":
                    async with async_engine.begin() as conn:
                        op = await aio.enqueue(conn, tool=TOOL, target=f"a-{kind}", payload=PAYLOAD)
                else:
                    async with AsyncSession(async_engine) as session, session.begin():
                        op = await aio.enqueue(
                            session, tool=TOOL, target=f"a-{kind}", payload=PAYLOAD
                        )
            return op
        finally:
            await aio.close()
            await async_engine.dispose()

    op = asyncio.run(main())
    assert recorded_under(engine, spans, op.id, TRACEPARENT) == (op.traceparent, None)


def test_an_mcp_call_with_a_trace_context_in_its_meta_records_it(
    engine: Engine, spans: InMemorySpanExporter, database_url: str
) -> None:
    """An MCP tools/call is a SERVER span (the MCP SDK's), child of the traceparent in its
    request's _meta, its enqueue a child of it, the tracestate kept; a call without one is
    recorded in the server span's trace."""
    table = ContractTable()
    table.register(ToolContract(name=TOOL))

    async def session() -> list[str]:
        async_engine = create_async_engine(database_url)
        context = McpContext(engine=async_engine, contracts=table, wait_s=0, agent="tester")
        try:
            async with Client(create_server(context)) as client:
                traced = await client.call_tool(
                    "deploy_create_release",
                    {"intent_key": "mcp-traced", "target": "web", "payload": PAYLOAD},
                    meta=cast(RequestParamsMeta, {"traceparent": TRACEPARENT, "tracestate": "k=v"}),
                )
                plain = await client.call_tool(
                    "deploy_create_release",
                    {"intent_key": "mcp-plain", "target": "web", "payload": PAYLOAD},
                )
            ids = []
            for result in (traced, plain):
                assert result.is_error is False, result.content
                assert isinstance(result.structured_content, dict)
                ids.append(result.structured_content["operation_id"])
            return ids
        finally:
            await aio.close()
            await async_engine.dispose()

    traced_id, plain_id = asyncio.run(session())
    calls = {
        str((s.attributes or {})["jsonrpc.request.id"]): s
        for s in spans.get_finished_spans()
        if s.name == "tools/call deploy_create_release" and s.kind is SpanKind.SERVER
    }
    traced_call, plain_call = (calls[key] for key in sorted(calls))
    assert traced_call.kind is SpanKind.SERVER
    assert traced_call.parent is not None
    assert f"{traced_call.parent.span_id:016x}" == TRACEPARENT[36:52]
    assert recorded_under(engine, spans, traced_id, traceparent_of(traced_call))[1] == "k=v"
    # Without one in _meta, the server's own span is the caller's trace (tracing is on).
    assert recorded_under(engine, spans, plain_id, traceparent_of(plain_call))[1] is None


def test_without_a_tracer_provider_the_callers_own_context_is_recorded(database_url: str) -> None:
    """In a process with the tracing API but no SDK provider (an agent not exporting), enqueue
    in a span stores that span's own traceparent and tracestate, and makes no span."""
    script = f"""
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from outbox import api, tracing
from outbox.db import create_engine
span = NonRecordingSpan(SpanContext({TRACE_ID}, {SPAN_ID}, is_remote=False,
    trace_flags=TraceFlags(1), trace_state=TraceState([("k", "v")])))
engine = create_engine({database_url!r})
with trace.use_span(span), engine.begin() as conn:
    op = api.enqueue(conn, tool={TOOL!r}, target="no-sdk", payload={{}})
print(tracing.active(), op.traceparent, op.tracestate)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", TRACEPARENT, "k=v"]
