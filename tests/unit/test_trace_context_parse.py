"""The W3C trace context a door is given: what is kept, what is ignored (outbox.trace_context)."""

from __future__ import annotations

import pytest

from outbox.trace_context import MAX_TRACESTATE, TraceContext, parse

VALID = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_valid_traceparent_is_kept_with_its_tracestate() -> None:
    """A version-00 traceparent and its tracestate are kept as sent, ids readable."""
    context = parse(VALID, "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")
    assert context == TraceContext(VALID, "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")
    assert (context.trace_id, context.span_id, context.sampled) == (
        "0af7651916cd43dd8448eb211c80319c",
        "b7ad6b7169203331",
        True,
    )
    assert context.headers() == {"traceparent": VALID, "tracestate": context.tracestate}


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "garbage",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",  # no flags
        "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",  # uppercase
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # zero span id
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
        f"{VALID}-extra",  # version 00 has no more fields
    ],
)
def test_an_invalid_traceparent_is_ignored(value: str | None) -> None:
    """A missing or malformed traceparent gives no context (W3C: the receiver ignores it)."""
    assert parse(value, "rojo=1") is None


def test_a_later_version_keeps_the_fields_version_00_knows() -> None:
    """A future version's extra fields are cut off, its known ones kept."""
    later = "cc" + VALID[2:]
    context = parse(f"{later}-what-comes-next")
    assert context is not None
    assert context.traceparent == later


@pytest.mark.parametrize("state", ["", "   ", "x" * (MAX_TRACESTATE + 1), "a=1\nb=2"])
def test_an_invalid_tracestate_is_dropped_and_the_traceparent_kept(state: str) -> None:
    """An empty, oversized or unprintable tracestate is dropped; the traceparent stays."""
    assert parse(VALID, state) == TraceContext(VALID, None)
    assert TraceContext(VALID).headers() == {"traceparent": VALID}
