"""An OpenTelemetry SDK tracer provider for in-process tests, its finished spans in memory.

OpenTelemetry allows one global tracer provider per process: the first test that asks for
one sets it, and every later test of the process records its spans too (so an in-process
test about tracing assumes it is on, never off; the off path runs in a subprocess).
"""

from __future__ import annotations

import threading
from uuid import UUID

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from outbox import tracing

_EXPORTER = InMemorySpanExporter()
_SET_UP = threading.Lock()


def collecting() -> InMemorySpanExporter:
    """This process's SDK tracer provider (set once), its finished spans collected in memory,
    emptied."""
    with _SET_UP:
        if not tracing.active():
            provider = TracerProvider()
            provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
            trace.set_tracer_provider(provider)
    assert tracing.active()
    _EXPORTER.clear()
    return _EXPORTER


def enqueue_spans(exporter: InMemorySpanExporter, operation_id: UUID | str) -> list[ReadableSpan]:
    """The finished ``outbox.enqueue`` spans naming this operation, oldest first."""
    return [
        s
        for s in exporter.get_finished_spans()
        if s.name == tracing.ENQUEUE_SPAN
        and (s.attributes or {}).get(tracing.OPERATION_ID) == str(operation_id)
    ]


def traceparent_of(span: ReadableSpan) -> str:
    """A finished span's own W3C traceparent (what its children's remote parent is)."""
    context = span.get_span_context()
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"
