"""The caller's W3C trace context is recorded with the operation at enqueue (migration 0026):
from the current OpenTelemetry span (sync and async), from a door that passed one on, never
without a caller's trace, and never changed afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import pytest
from mcp import Client
from mcp_types import RequestParamsMeta
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession

from outbox import aio, api, trace_context
from outbox.contracts import ContractTable, ToolContract
from outbox.db import create_async_engine
from outbox.mcp import McpContext, create_server
from outbox.trace_context import TraceContext
from tests.factories import reload

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


def stored(engine: Engine, operation_id: object) -> tuple[str | None, str | None]:
    with engine.connect() as conn:
        row = conn.execute(
            text("SELECT traceparent, tracestate FROM outbox.operations WHERE id = :id"),
            {"id": operation_id},
        ).one()
    return row.traceparent, row.tracestate


def test_enqueue_in_an_agent_span_records_its_context(engine: Engine) -> None:
    """enqueue inside the agent's span stores that span's traceparent and tracestate."""
    with agent_span(TraceState([("rojo", "00f067aa0ba902b7")])), engine.begin() as conn:
        op = api.enqueue(conn, tool=TOOL, target="t-1", payload=PAYLOAD)
    assert (op.traceparent, op.tracestate) == (TRACEPARENT, "rojo=00f067aa0ba902b7")
    assert stored(engine, op.id) == (TRACEPARENT, "rojo=00f067aa0ba902b7")
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


def test_enqueue_many_records_the_context_of_each(engine: Engine) -> None:
    """Every operation of a batch enqueued in the agent's span carries its context."""
    with agent_span(), engine.begin() as conn:
        ops = api.enqueue_many(
            conn, [api.Intent(TOOL, f"m-{n}", PAYLOAD, intent_key=f"m-{n}") for n in range(3)]
        )
    assert [stored(engine, op.id) for op in ops] == [(TRACEPARENT, None)] * 3
    assert [op.traceparent for op in ops] == [TRACEPARENT] * 3


def test_a_context_passed_on_by_a_door_wins_over_the_current_span(engine: Engine) -> None:
    """The HTTP API's or MCP's caller context (passed) is recorded, not the server's span."""
    theirs = TraceContext("00-11111111111111111111111111111111-2222222222222222-00", "k=v")
    with agent_span(), trace_context.passed(theirs), engine.begin() as conn:
        op = api.enqueue(conn, tool=TOOL, target="t-4", payload=PAYLOAD)
    assert stored(engine, op.id) == (theirs.traceparent, "k=v")


def test_the_same_intent_again_keeps_the_first_context(engine: Engine) -> None:
    """A retry of the same intent from another trace finds the operation, its context unchanged."""
    with agent_span(), engine.begin() as conn:
        first = api.enqueue(conn, tool=TOOL, target="t-5", payload=PAYLOAD, intent_key="same")
    other = TraceContext("00-11111111111111111111111111111111-2222222222222222-01")
    with trace_context.passed(other), engine.begin() as conn:
        again = api.enqueue(conn, tool=TOOL, target="t-5", payload=PAYLOAD, intent_key="same")
    assert again.id == first.id
    assert stored(engine, first.id) == (TRACEPARENT, None)


def test_the_context_is_immutable(engine: Engine) -> None:
    """An UPDATE of the stored traceparent is refused by the immutability trigger."""
    with agent_span(), engine.begin() as conn:
        op = api.enqueue(conn, tool=TOOL, target="t-6", payload=PAYLOAD)
    with pytest.raises(DBAPIError, match="traceparent is immutable"), engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox.operations SET traceparent = NULL WHERE id = :id"), {"id": op.id}
        )
    assert stored(engine, op.id) == (TRACEPARENT, None)


@pytest.mark.parametrize("kind", ["connection", "session"])
def test_async_enqueue_records_the_agent_span_of_its_task(database_url: str, kind: str) -> None:
    """outbox.aio.enqueue takes the context of the awaiting task (run_sync's greenlet has its
    own), on an AsyncConnection and an AsyncSession."""

    async def main() -> tuple[str | None, str | None]:
        engine = create_async_engine(database_url)
        try:
            with agent_span():
                if kind == "connection":
                    async with engine.begin() as conn:
                        op = await aio.enqueue(conn, tool=TOOL, target=f"a-{kind}", payload=PAYLOAD)
                else:
                    async with AsyncSession(engine) as session, session.begin():
                        op = await aio.enqueue(
                            session, tool=TOOL, target=f"a-{kind}", payload=PAYLOAD
                        )
            return op.traceparent, op.tracestate
        finally:
            await aio.close()
            await engine.dispose()

    assert asyncio.run(main()) == (TRACEPARENT, None)


def test_an_mcp_call_with_a_trace_context_in_its_meta_records_it(
    engine: Engine, database_url: str
) -> None:
    """An MCP tools/call whose request _meta carries traceparent/tracestate records them; a
    call without one records nothing."""
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
    assert stored(engine, traced_id) == (TRACEPARENT, "k=v")
    assert stored(engine, plain_id) == (None, None)
