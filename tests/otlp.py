"""An OTLP/HTTP trace receiver for tests: the spans real processes export, decoded with
opentelemetry-proto (tests/acceptance/test_tracing.py, the trace screenshot)."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class Span:
    """One exported span, decoded."""

    service: str
    name: str
    kind: int
    trace_id: int
    span_id: int
    parent_span_id: int | None
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[int, int]]
    raw: bytes
    #: Start and end, nanoseconds since the epoch.
    start_ns: int = 0
    end_ns: int = 0
    #: Each event's time (nanoseconds since the epoch), in the order of ``events``.
    event_times: list[int] = field(default_factory=list)
    #: The span's status: 0 unset, 1 ok, 2 error.
    status: int = 0


@dataclass
class Receiver:
    """An OTLP/HTTP trace receiver: every span exported to it."""

    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    port: int = 0

    def of(self, operation_id: str) -> list[Span]:
        """The spans naming ``operation_id``."""
        with self.lock:
            return [
                s for s in self.spans if s.attributes.get("outbox.operation.id") == operation_id
            ]

    def all(self) -> list[Span]:
        """Every span received so far."""
        with self.lock:
            return list(self.spans)


class _ReceiverServer(ThreadingHTTPServer):
    receiver: Receiver


class _ReceiverHandler(BaseHTTPRequestHandler):
    server: _ReceiverServer

    def do_POST(self) -> None:
        """An ExportTraceServiceRequest (protobuf, maybe gzipped)."""
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        decoded = list(_decode(request))
        with self.server.receiver.lock:
            self.server.receiver.spans.extend(decoded)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def _decode(request: ExportTraceServiceRequest) -> Iterator[Span]:
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield Span(
                    service=str(resource.get("service.name", "")),
                    name=span.name,
                    kind=span.kind,
                    trace_id=int.from_bytes(span.trace_id, "big"),
                    span_id=int.from_bytes(span.span_id, "big"),
                    parent_span_id=(
                        int.from_bytes(span.parent_span_id, "big") if span.parent_span_id else None
                    ),
                    attributes={a.key: _value(a.value) for a in span.attributes},
                    events=[
                        (e.name, {a.key: _value(a.value) for a in e.attributes})
                        for e in span.events
                    ],
                    links=[
                        (int.from_bytes(link.trace_id, "big"), int.from_bytes(link.span_id, "big"))
                        for link in span.links
                    ],
                    raw=span.SerializeToString(),
                    start_ns=span.start_time_unix_nano,
                    end_ns=span.end_time_unix_nano,
                    event_times=[e.time_unix_nano for e in span.events],
                    status=span.status.code,
                )


@contextmanager
def receiving() -> Iterator[Receiver]:
    """An OTLP/HTTP receiver on a free port of 127.0.0.1, stopped at the end."""
    server = _ReceiverServer(("127.0.0.1", 0), _ReceiverHandler)
    server.receiver = Receiver(port=server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.receiver
    finally:
        server.shutdown()
        server.server_close()
