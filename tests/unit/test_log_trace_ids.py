"""Log lines emitted while a span is current carry its trace_id and span_id (logfmt and JSON);
lines outside any span carry neither (outbox.logs)."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from outbox.logs import Action, LogFormat, formatter

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SPAN_ID = 0xB7AD6B7169203331


def _line(log_format: LogFormat) -> str:
    record = logging.LogRecord("outbox.test", logging.INFO, __file__, 1, "sent", None, None)
    record.action = Action.DISPATCH_SENT
    return formatter(log_format).format(record)


def _in_span(log_format: LogFormat) -> str:
    span = NonRecordingSpan(
        SpanContext(TRACE_ID, SPAN_ID, is_remote=False, trace_flags=TraceFlags(1))
    )
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        return _line(log_format)
    finally:
        otel_context.detach(token)


def test_a_logfmt_line_in_a_span_carries_its_ids() -> None:
    """logfmt: trace_id=<32 hex> span_id=<16 hex> after the first keys."""
    line = _in_span(LogFormat.LOGFMT)
    assert "trace_id=0af7651916cd43dd8448eb211c80319c" in line
    assert "span_id=b7ad6b7169203331" in line
    assert line.index("msg=") < line.index("trace_id=")


def test_a_json_line_in_a_span_carries_its_ids() -> None:
    """JSON: the same two keys."""
    fields = json.loads(_in_span(LogFormat.JSON))
    assert (fields["trace_id"], fields["span_id"]) == (
        "0af7651916cd43dd8448eb211c80319c",
        "b7ad6b7169203331",
    )


@pytest.mark.parametrize("log_format", list(LogFormat))
def test_a_line_outside_any_span_carries_no_ids(log_format: LogFormat) -> None:
    """No current span (or the invalid one): neither key."""
    assert "trace_id" not in _line(log_format)
    token = otel_context.attach(trace.set_span_in_context(trace.INVALID_SPAN))
    try:
        assert "span_id" not in _line(log_format)
    finally:
        otel_context.detach(token)
