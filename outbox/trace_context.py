"""The caller's W3C trace context, recorded with an operation at enqueue (issue 34).

An operation is an agent's intent that lives on across processes, hours and people; its
caller's trace context (``traceparent``, ``tracestate``) is stored with it, immutable like the
payload (migration 0026), so that every later stage's span joins the agent's trace
(docs/observability.md). Without a caller's trace nothing is recorded.

The context comes from, in order: the one a door passed on explicitly (the HTTP API's
``traceparent`` / ``tracestate`` headers, an MCP request's ``_meta``: :func:`within`), else
the current OpenTelemetry span of the calling code (``outbox.enqueue`` inside an agent's
span). Nothing here imports OpenTelemetry unless the process already did: code that never
imported ``opentelemetry.trace`` cannot have a current span, so an agent without tracing
pays one dictionary lookup per enqueue.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

#: W3C Trace Context, version-format: version, trace-id, parent-id, trace-flags (lowercase
#: hex); a future version may append fields after a dash.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")

#: The W3C limit a vendor may truncate tracestate to; a longer one is dropped, not cut.
MAX_TRACESTATE = 512


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A W3C trace context: the ``traceparent`` header's value and the ``tracestate``'s."""

    traceparent: str
    tracestate: str | None = None

    @property
    def trace_id(self) -> str:
        """The 32 hex digits naming the trace."""
        return self.traceparent[3:35]

    @property
    def span_id(self) -> str:
        """The 16 hex digits naming the caller's span (the parent of the enqueue)."""
        return self.traceparent[36:52]

    @property
    def sampled(self) -> bool:
        """The caller's sampled flag."""
        return bool(int(self.traceparent[53:55], 16) & 1)

    def headers(self) -> dict[str, str]:
        """The W3C headers carrying this context to a remote."""
        headers = {"traceparent": self.traceparent}
        if self.tracestate:
            headers["tracestate"] = self.tracestate
        return headers


def parse(traceparent: str | None, tracestate: str | None = None) -> TraceContext | None:
    """The context these header values carry, or ``None`` for a missing or invalid
    ``traceparent`` (W3C: a receiver ignores what it cannot parse; an invalid tracestate is
    dropped, the traceparent kept)."""
    if traceparent is None:
        return None
    value = traceparent.strip()
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace_id, span_id, _flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    if version != "00":  # a later version: keep the fields version 00 knows
        value = value[:55]
    state = tracestate.strip() if tracestate is not None else None
    if not state or len(state) > MAX_TRACESTATE or not state.isprintable():
        state = None
    return TraceContext(value, state)


def stored(traceparent: str | None, tracestate: str | None) -> TraceContext | None:
    """An operation's stored context (checked by :func:`parse` when it was recorded), or
    ``None`` for an operation enqueued without a caller's trace."""
    return None if traceparent is None else TraceContext(traceparent, tracestate)


#: The context a door passed on for the call it runs (:func:`within`), over the current span.
_passed: ContextVar[TraceContext | None] = ContextVar("outbox_trace_context", default=None)


@contextmanager
def passed(context: TraceContext | None) -> Iterator[None]:
    """Within this block, :func:`current` is ``context`` (when not ``None``)."""
    token = _passed.set(context)
    try:
        yield
    finally:
        _passed.reset(token)


def within(context: TraceContext | None, call: Callable[..., T]) -> Callable[..., T]:
    """``call`` running with :func:`current` equal to ``context``: for a call run elsewhere
    (``run_sync``'s greenlet has a context of its own), captured where the caller's is."""
    if context is None:
        return call

    def run(*args: object, **kwargs: object) -> T:
        with passed(context):
            return call(*args, **kwargs)

    return run


def current() -> TraceContext | None:
    """The caller's trace context: the current OpenTelemetry span's when it is in the trace
    of the one passed on (:func:`passed`: an instrumented server's span for the request),
    else the one passed on, else the current span's, else ``None`` (no caller's trace)."""
    context = _passed.get()
    # Nobody imported the tracing API: no span can be current (and none is imported here).
    if "opentelemetry.trace" not in sys.modules:
        return context
    from opentelemetry import trace  # noqa: PLC0415 -- imported already (above): no cost

    span_context = trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return context
    if context is not None and f"{span_context.trace_id:032x}" != context.trace_id:
        # The current span is not in the door's trace (a server span of another request's):
        # the context the door was handed wins. In it (an instrumented server's span, child
        # of the request's traceparent), the current span is the nearer parent.
        return context
    traceparent = (
        f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-"
        f"{int(span_context.trace_flags):02x}"
    )
    return TraceContext(traceparent, span_context.trace_state.to_header() or None)
