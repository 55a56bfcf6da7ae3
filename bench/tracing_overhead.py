"""What outbox's tracing costs per span helper, in process: off (no SDK) and on (SDK, batch).

Measures, as the median of ``--rounds`` repeats, the per-call cost of the helpers the hot
paths call (``outbox.trace_context.current`` at every enqueue; ``outbox.tracing.operation_span``
with one ``state_event`` for each dispatch stage), in three states of one process:

* nothing imported ``opentelemetry.trace`` (an agent or worker without tracing);
* the API imported, no SDK tracer provider (tracing off in a process that imports the API);
* an SDK ``TracerProvider`` with a ``BatchSpanProcessor`` (in-memory exporter): tracing on,
  sampling at 100 %, export cost left out.

Usage: python bench/tracing_overhead.py [--rounds 5] [--calls 100000] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
import timeit
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from outbox import trace_context, tracing
from outbox.models import Operation
from outbox.states import State


def _operation() -> Operation:
    now = datetime.now(UTC)
    return Operation(
        id=uuid.uuid4(),
        intent_key="k",
        tool="deploy.create_release",
        target="web",
        payload={},
        payload_hash="0" * 64,
        state=State.PLANNED,
        attempts=0,
        checks=0,
        maybe_applied=False,
        remote_ref=None,
        result=None,
        last_error=None,
        metadata={},
        requested_by=None,
        created_at=now,
        updated_at=now,
        available_at=now,
        published_at=None,
        first_sent_at=None,
        sent_at=None,
        next_check_at=None,
        replay_deadline=None,
        resolved_at=None,
        attempt_budget_base=0,
        intent_hash="0" * 64,
        traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    )


def _median_us(call: Callable[[], object], calls: int, rounds: int) -> float:
    return statistics.median(timeit.repeat(call, number=calls, repeat=rounds)) / calls * 1e6


def main() -> None:
    """Print the per-call cost of each helper in each state."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--smoke", action="store_true", help="a few calls: does it still run")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.calls = 1, 1000
    op = _operation()

    def span() -> None:
        with tracing.operation_span("bench", op) as current:
            tracing.state_event(current, op)

    def row(state: str, calls: int) -> None:
        current = _median_us(trace_context.current, calls, args.rounds)
        spanned = _median_us(span, calls, args.rounds)
        print(f"{state:<36} current() {current:8.2f} us   span+event {spanned:8.2f} us")

    row("nothing imported opentelemetry.trace", args.calls)
    from opentelemetry import trace  # noqa: PLC0415 -- the second state: the API imported

    row("API imported, no SDK", args.calls)
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: PLC0415
        InMemorySpanExporter,
    )

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    trace.set_tracer_provider(provider)
    row("SDK on (batch processor, 100 %)", max(1, args.calls // 20))
    provider.shutdown()


if __name__ == "__main__":
    main()
