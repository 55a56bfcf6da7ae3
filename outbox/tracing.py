"""The outbox's own spans, in the trace of the agent that enqueued each operation (issue 34).

Every span about an operation is a child of the trace context recorded with it at enqueue
(:mod:`outbox.trace_context`, migration 0026), so that one trace view shows the agent's step,
the dispatch attempts hours later and the remote's own spans. An operation enqueued without a
caller's trace gets spans in a trace of their own. Span names and attributes:
docs/observability.md. Attributes name the operation (``outbox.operation.id``, tool, target,
state, attempt), never a payload value.

Tracing is on only where an OpenTelemetry SDK tracer provider is set: by :func:`setup` from
the standard ``OTEL_*`` variables (``outbox up --otel``), or by the embedding application. Off,
:func:`operation_span` yields ``None`` after one dictionary lookup: no span object is built
and OpenTelemetry is not imported.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol
from uuid import UUID

from outbox import trace_context
from outbox.models import Operation
from outbox.trace_context import TraceContext

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span


class Claimed(Protocol):
    """What a publish span names of a claimed operation (``outbox.sql.relay.ClaimedIntent``)."""

    @property
    def id(self) -> UUID: ...
    @property
    def tool(self) -> str: ...
    @property
    def target(self) -> str: ...
    @property
    def traceparent(self) -> str | None: ...
    @property
    def tracestate(self) -> str | None: ...


__all__ = ["Enqueuing", "Span", "TracingConfig", "enqueue_spans", "operation_span", "setup"]

log = logging.getLogger(__name__)

#: The instrumentation scope of every span here.
SCOPE = "agent-outbox"

#: Attribute names (docs/observability.md).
OPERATION_ID = "outbox.operation.id"
TOOL = "outbox.tool"
TARGET = "outbox.target"
STATE = "outbox.operation.state"
ATTEMPT = "outbox.attempt"
INTENT_KEY = "outbox.intent_key"
AGENT = "outbox.agent"
OUTCOME = "outbox.outcome"
DECIDED_BY = "outbox.decided_by"

#: An intent recorded in the caller's transaction (one span per operation of a batch).
ENQUEUE_SPAN = "outbox.enqueue"
#: Whether an enqueue found the same intent recorded already (its intent key's operation).
EXISTING = "outbox.intent.existing"
#: One run of the reconciler's sweep, naming how many rows it looked at and moved.
SWEEP_SPAN = "outbox.sweep"
SWEEP_EXAMINED = "outbox.sweep.examined"
SWEEP_MOVED = "outbox.sweep.moved"
#: The relay's span for one operation's dispatch message.
PUBLISH_SPAN = "outbox.publish"
#: One attempt to deliver an escalation webhook.
WEBHOOK_SPAN = "outbox.webhook.deliver"

SpanKind = Literal["internal", "client", "producer", "consumer"]


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """What the standard ``OTEL_*`` variables ask for (:func:`config_from`)."""

    #: Whether an SDK should be set up at all.
    enabled: bool
    #: ``otlp`` (OTLP over HTTP/protobuf) or ``console``.
    exporter: str = "otlp"
    #: Why not, when not enabled (for the start-up log line).
    reason: str = ""


def config_from(environ: Mapping[str, str], *, forced: bool = False) -> TracingConfig:
    """The tracing an environment asks for, by the OpenTelemetry variables.

    ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turn it off; otherwise an
    ``OTEL_TRACES_EXPORTER`` of ``otlp`` or ``console``, an ``OTEL_EXPORTER_OTLP_ENDPOINT``
    or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, or ``forced`` (``outbox up --otel``, OTLP to
    the SDK's default endpoint unless one is set) turn it on. Only the first exporter of a
    list is used; ``otlp``'s protocol is HTTP/protobuf.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return TracingConfig(False, reason="OTEL_SDK_DISABLED=true")
    exporters = [
        e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()
    ]
    if exporters:
        exporter = exporters[0]
        if exporter == "none":
            return TracingConfig(False, reason="OTEL_TRACES_EXPORTER=none")
        if exporter not in {"otlp", "console"}:
            return TracingConfig(
                False, reason=f"OTEL_TRACES_EXPORTER={exporter} (only otlp and console)"
            )
        return TracingConfig(True, exporter)
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if endpoint or forced:
        return TracingConfig(True, "otlp")
    return TracingConfig(False, reason="no OTEL_EXPORTER_OTLP_ENDPOINT nor OTEL_TRACES_EXPORTER")


#: The maintained instrumentations :func:`setup` can turn on, by name (docs/observability.md).
Instrumentation = Literal["celery", "aiohttp", "sqlalchemy"]

#: Turns SQLAlchemy's per-statement spans on (with tracing on): off by default.
SQL_VARIABLE = "OUTBOX_OTEL_SQL"


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for tracing (``OTEL_*``, ``OUTBOX_OTEL=1``): what
    :func:`setup` will act on, for what must be decided before it runs (an app's middleware)."""
    env = os.environ if environ is None else environ
    return config_from(env, forced=env.get("OUTBOX_OTEL", "") == "1").enabled


def setup(
    service_name: str,
    *,
    environ: Mapping[str, str] | None = None,
    instrument: Sequence[Instrumentation] = (),
) -> bool:
    """Set up the OpenTelemetry SDK for this process when the ``OTEL_*`` variables (or
    ``OUTBOX_OTEL=1``, which ``outbox up --otel`` sets) ask for it and the SDK is installed
    (``agent-outbox[otel]``); True if tracing is on afterwards.

    ``service_name`` is the resource's ``service.name`` unless ``OTEL_SERVICE_NAME`` or
    ``OTEL_RESOURCE_ATTRIBUTES`` name one; the sampler is ``OTEL_TRACES_SAMPLER``'s (the
    SDK's default: parent-based, always on); the exporter's endpoint, headers and timeout
    are ``OTEL_EXPORTER_OTLP_*``'s. An application that set up its own tracer provider keeps
    it. Call it in each process (a forked worker child too: the batch exporter's thread does
    not survive a fork).

    ``instrument``: the maintained ``opentelemetry-instrumentation-*`` packages this process
    turns on with tracing (:func:`instrument`; ``sqlalchemy`` only with ``OUTBOX_OTEL_SQL=1``).
    """
    env = os.environ if environ is None else environ
    config = config_from(env, forced=env.get("OUTBOX_OTEL", "") == "1")
    if not config.enabled:
        return False
    instrument_with(instrument, environ=env)
    try:
        from opentelemetry import trace  # noqa: PLC0415 -- only a traced process pays it
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import (  # noqa: PLC0415
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )
    except ImportError:
        log.warning(
            "tracing asked for by OTEL_* but the OpenTelemetry SDK is not installed: "
            "pip install 'agent-outbox[otel]'"
        )
        return False
    if active():
        return True  # the embedding application's provider
    exporter: SpanExporter
    if config.exporter == "console":
        exporter = ConsoleSpanExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )

        exporter = OTLPSpanExporter()
    # Resource.create adds OTEL_RESOURCE_ATTRIBUTES (and OTEL_SERVICE_NAME) to this default.
    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return True


#: The instrumentations turned on in this process (each once).
_instrumented: set[str] = set()


def instrument_with(
    names: Sequence[Instrumentation], *, environ: Mapping[str, str] | None = None
) -> list[str]:
    """Turn on these maintained instrumentations (once each; the names turned on now): Celery
    (a task's publish and run spans, the message's context in its headers), the aiohttp
    client (an HTTP CLIENT span per request under ``outbox.tool.call``, showing the tool's URL
    template, never the rendered URL), SQLAlchemy (a span per statement: only with
    ``OUTBOX_OTEL_SQL=1``, many spans). A package that is not installed is named in a warning
    (``pip install 'agent-outbox[otel]'``) and left out."""
    env = os.environ if environ is None else environ
    _stable_http_conventions()
    done: list[str] = []
    for name in names:
        if name in _instrumented:
            continue
        if name == "sqlalchemy" and env.get(SQL_VARIABLE, "") != "1":
            continue
        try:
            _INSTRUMENTERS[name]()
        except ImportError as exc:
            log.warning(
                "tracing: the %s instrumentation is not installed (%s): "
                "pip install 'agent-outbox[otel]'",
                name,
                exc,
            )
            continue
        _instrumented.add(name)
        done.append(name)
    return done


def _stable_http_conventions() -> None:
    """The instrumentations' HTTP attributes in the stable conventions our own spans use
    (``http.request.method``, ``url.full``...), unless ``OTEL_SEMCONV_STABILITY_OPT_IN``
    says otherwise: read once, by the first instrumentation turned on."""
    os.environ.setdefault("OTEL_SEMCONV_STABILITY_OPT_IN", "http")


def _celery() -> None:
    from opentelemetry.instrumentation.celery import CeleryInstrumentor  # noqa: PLC0415

    CeleryInstrumentor().instrument()  # type: ignore[no-untyped-call]


def _aiohttp() -> None:
    from opentelemetry.instrumentation.aiohttp_client import (  # noqa: PLC0415
        AioHttpClientInstrumentor,
    )

    AioHttpClientInstrumentor().instrument(url_filter=_shown_url)


def _sqlalchemy() -> None:
    from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor  # noqa: PLC0415

    # Its package declares SQLAlchemy < 2.1; it works on 2.1 (its hooks are the engine's
    # events and create_engine): tests/integration/test_tracing_spans.py checks it does.
    SQLAlchemyInstrumentor().instrument(skip_dep_check=True)


_INSTRUMENTERS = {"celery": _celery, "aiohttp": _aiohttp, "sqlalchemy": _sqlalchemy}


def instrument_app(app: Any) -> bool:
    """The FastAPI instrumentation on ``app``: a SERVER span per request, the request's
    ``traceparent`` its parent (not for ``/healthz``, ``/readyz``, ``/metrics``; its query
    string never shown). Before the app starts: middleware cannot be added to a started app."""
    _stable_http_conventions()
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor  # noqa: PLC0415
    except ImportError as exc:
        log.warning(
            "tracing: the fastapi instrumentation is not installed (%s): "
            "pip install 'agent-outbox[otel]'",
            exc,
        )
        return False
    FastAPIInstrumentor.instrument_app(
        app, excluded_urls="/healthz,/readyz,/metrics", server_request_hook=_query_redacted
    )
    return True


def _query_redacted(span: Span | None, scope: Mapping[str, Any]) -> None:
    """A request span's ``url.query`` (a filter may name an intent key) as ``REDACTED``."""
    if span is not None and span.is_recording() and scope.get("query_string"):
        span.set_attribute("url.query", "REDACTED")


#: The URL an instrumented HTTP client span shows for the request being sent (:func:`http_request`).
_shown: ContextVar[str | None] = ContextVar("outbox_shown_url", default=None)


def _shown_url(url: Any) -> str:
    """What the aiohttp instrumentation's span shows as the URL: the tool's URL template
    while a tool's request is sent, else the URL's origin (no path, no query)."""
    shown = _shown.get()
    return shown if shown is not None else str(url.origin())


@contextmanager
def http_request(template: str, *, propagate: bool) -> Iterator[None]:
    """An HTTP tool's request within the block: an instrumented client span shows
    ``template`` (never the rendered URL: it carries the target); ``propagate=False``
    (``propagate_trace = false``) leaves the request out of HTTP instrumentation, so that no
    ``traceparent`` is injected into it."""
    token = _shown.set(template)
    try:
        if propagate or "opentelemetry.instrumentation.utils" not in sys.modules:
            yield
        else:
            from opentelemetry.instrumentation.utils import (  # noqa: PLC0415 -- loaded already
                suppress_http_instrumentation,
            )

            with suppress_http_instrumentation():
                yield
    finally:
        _shown.reset(token)


def shutdown() -> None:
    """Export what is still buffered (a process about to exit): a no-op when tracing is off."""
    if "opentelemetry.trace" not in sys.modules:
        return
    from opentelemetry import trace  # noqa: PLC0415 -- imported already (above)

    provider = trace.get_tracer_provider()
    stop = getattr(provider, "shutdown", None)
    if callable(stop):
        stop()


def active() -> bool:
    """Whether an SDK tracer provider is set in this process (spans are recorded)."""
    if "opentelemetry.trace" not in sys.modules:
        return False
    from opentelemetry import trace  # noqa: PLC0415 -- imported already (above)

    return not isinstance(
        trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider
    )


def operation_attributes(op: Operation) -> dict[str, str | int]:
    """The attributes naming ``op`` on every span about it: never a payload value."""
    return {
        OPERATION_ID: str(op.id),
        TOOL: op.tool,
        TARGET: op.target,
        STATE: str(op.state),
        ATTEMPT: op.attempts,
    }


@contextmanager
def operation_span(
    name: str,
    op: Operation,
    *,
    kind: SpanKind = "internal",
    attributes: Mapping[str, str | int | bool] | None = None,
    child: bool = False,
) -> Iterator[Span | None]:
    """A span ``name`` about ``op``, current within the block, child of the trace context
    recorded with ``op`` (else of the current span), or of the current span when ``child``
    (a stage within another span about ``op``); ``None`` when tracing is off. An exception
    escaping the block is recorded on the span and re-raised."""
    if not active():
        yield None
        return
    with stored_span(
        name,
        None if child else op.traceparent,
        None if child else op.tracestate,
        kind=kind,
        attributes={**operation_attributes(op), **(attributes or {})},
    ) as span:
        yield span


@contextmanager
def stored_span(
    name: str,
    traceparent: str | None,
    tracestate: str | None,
    *,
    kind: SpanKind = "internal",
    attributes: Mapping[str, str | int | bool] | None = None,
) -> Iterator[Span | None]:
    """A span ``name``, current within the block, child of a stored W3C trace context (else
    of the current span); ``None`` when tracing is off."""
    if not active():
        yield None
        return
    from opentelemetry import trace  # noqa: PLC0415 -- imported already (active)

    tracer = trace.get_tracer(SCOPE)
    parent = _stored(traceparent, tracestate)
    # Parented elsewhere (the operation's trace), the span links the work it is part of
    # here (a sweep run, an instrumented Celery task): both traces lead to each other.
    here = trace.get_current_span().get_span_context() if parent is not None else None
    with tracer.start_as_current_span(
        name,
        context=parent,
        kind=trace.SpanKind[kind.upper()],
        attributes=dict(attributes or {}),
        links=[trace.Link(here)] if here is not None and here.is_valid else None,
    ) as span:
        yield span


def state_event(span: Span | None, op: Operation, *, reason: str = "") -> None:
    """A span event for ``op``'s move to its current state (docs/observability.md)."""
    if span is None:
        return
    attributes: dict[str, str | int] = {STATE: str(op.state), ATTEMPT: op.attempts}
    if reason:
        attributes["outbox.reason"] = reason
    span.add_event(f"outbox.state.{op.state}", attributes)


def outcome(span: Span | None, outcome: str, *, attempt: int | None = None) -> None:
    """The stage's outcome, as an attribute and an event of its span."""
    if span is None:
        return
    span.set_attribute(OUTCOME, outcome)
    if attempt is not None:
        span.set_attribute(ATTEMPT, attempt)
    span.add_event("outbox.outcome", {OUTCOME: outcome})


def result(span: Span | None, kind: str) -> None:
    """A tool call's result kind (``Applied``, ``Ambiguous``...): never its content."""
    if span is not None:
        span.set_attribute("outbox.result", kind)


class PublishSpans:
    """The relay's publish spans of one batch (:func:`publish_spans`)."""

    def __init__(self, spans: dict[UUID, Span]) -> None:
        self._spans = spans

    def confirmed(self, ids: set[UUID]) -> None:
        """Say which operations' messages the broker confirmed (the others were not)."""
        for operation_id, span in self._spans.items():
            span.set_attribute("outbox.published", operation_id in ids)


@contextmanager
def publish_spans(claimed: Sequence[Claimed]) -> Iterator[PublishSpans]:
    """An ``outbox.publish`` PRODUCER span for each claimed operation, child of its stored
    trace context (a root span without one), ended when the block ends; nothing when
    tracing is off. Started and ended together: a batch is one broker round trip."""
    if not active():
        yield PublishSpans({})
        return
    from opentelemetry import trace  # noqa: PLC0415 -- imported already (active)
    from opentelemetry.context import Context  # noqa: PLC0415

    tracer = trace.get_tracer(SCOPE)
    spans: dict[UUID, Span] = {}
    for c in claimed:
        parent = _stored(c.traceparent, c.tracestate) or Context()
        spans[c.id] = tracer.start_span(
            PUBLISH_SPAN,
            context=parent,
            kind=trace.SpanKind.PRODUCER,
            attributes={
                OPERATION_ID: str(c.id),
                TOOL: c.tool,
                TARGET: c.target,
                "messaging.operation.type": "send",
                "messaging.destination.name": "dispatch",
            },
        )
    with _ended_together(spans.values()):
        yield PublishSpans(spans)


class EnqueueSpans:
    """The ``outbox.enqueue`` spans of one enqueue or batch (:func:`enqueue_spans`)."""

    def __init__(self, spans: Mapping[int, Span]) -> None:
        self._spans = spans

    def __bool__(self) -> bool:
        """Whether any span was started (tracing on and a caller's trace)."""
        return bool(self._spans)

    def context(self, position: int, caller: TraceContext | None) -> TraceContext | None:
        """The trace context to record with the intent at ``position``: its enqueue span's
        (so the operation's later spans are its children), else the caller's."""
        span = self._spans.get(position)
        return caller if span is None else _context_of(span)

    def recorded(self, position: int, op: Operation, *, created: bool) -> None:
        """Name the operation the intent at ``position`` became, new or found by its key."""
        span = self._spans.get(position)
        if span is None:
            return
        span.set_attribute(OPERATION_ID, str(op.id))
        span.set_attribute(STATE, str(op.state))
        span.set_attribute(EXISTING, not created)


_NO_ENQUEUE_SPANS = EnqueueSpans({})


@dataclass(frozen=True, slots=True)
class Enqueuing:
    """An intent about to be recorded, as its ``outbox.enqueue`` span names it."""

    caller: TraceContext | None
    tool: str
    target: str


@contextmanager
def enqueue_spans(intents: Sequence[Enqueuing]) -> Iterator[EnqueueSpans]:
    """An ``outbox.enqueue`` PRODUCER span (messaging ``create``) for each intent with a
    caller's trace, child of that trace, ended when the block (the insert, in the caller's
    transaction) ends; current within the block when there is one intent. Nothing without a
    caller's trace or when tracing is off (one dictionary lookup, no import)."""
    if not active() or all(i.caller is None for i in intents):
        yield _NO_ENQUEUE_SPANS
        return
    from opentelemetry import trace  # noqa: PLC0415 -- imported already (active)

    tracer = trace.get_tracer(SCOPE)
    spans: dict[int, Span] = {}
    for position, intent in enumerate(intents):
        if intent.caller is None:
            continue
        spans[position] = tracer.start_span(
            ENQUEUE_SPAN,
            context=_stored(intent.caller.traceparent, intent.caller.tracestate),
            kind=trace.SpanKind.PRODUCER,
            attributes={
                TOOL: intent.tool,
                TARGET: intent.target,
                "messaging.operation.type": "create",
                "messaging.destination.name": "dispatch",
            },
        )
    only = next(iter(spans.values())) if len(spans) == 1 else None
    with _ended_together(spans.values()):
        if only is None:
            yield EnqueueSpans(spans)
        else:
            with trace.use_span(
                only, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                yield EnqueueSpans(spans)


@contextmanager
def _ended_together(spans: Iterable[Span]) -> Iterator[None]:
    """End every one of ``spans`` on the way out; an exception on the way is recorded on each
    (status ERROR, the exception's type) and raised again."""
    from opentelemetry import trace  # noqa: PLC0415 -- only with spans to end

    try:
        yield
    except BaseException as exc:
        for span in spans:
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR, type(exc).__name__)
        raise
    finally:
        for span in spans:
            span.end()


def _context_of(span: Span) -> TraceContext:
    """A span's own W3C trace context (what its children's remote parent is)."""
    context = span.get_span_context()
    return TraceContext(
        f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}",
        context.trace_state.to_header() or None,
    )


def _stored(traceparent: str | None, tracestate: str | None) -> Context | None:
    """The OpenTelemetry context of a stored W3C trace context (``None`` without one)."""
    if traceparent is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import (  # noqa: PLC0415
        TraceContextTextMapPropagator,
    )

    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    return TraceContextTextMapPropagator().extract(carrier)


def decision(name: str, op: Operation, *, by: str) -> None:
    """A person's decision on ``op`` (``outbox.approve``, ``outbox.reject``,
    ``outbox.resolve``) as a span in the agent's trace, naming who (``outbox.decided_by``),
    with the move as an event. Recorded when decided, before the caller commits."""
    with operation_span(name, op, attributes={DECIDED_BY: by}) as span:
        state_event(span, op)


def current_context(op: Operation) -> TraceContext | None:
    """The trace context a remote should see for a call about ``op``: the current span's
    when tracing is on (the call's span), else the one recorded with ``op``."""
    if active():
        here = trace_context.current()
        if here is not None:
            return here
    return trace_context.stored(op.traceparent, op.tracestate)
