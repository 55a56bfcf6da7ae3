"""An OTLP/HTTP receiver for benchmarks with tracing on: it decodes every export and counts
the spans by name, in a process of its own (like a collector beside the stack, it shares only
the machine), driven over a pipe like :class:`services.ServiceProcess`."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _serve(conn: multiprocessing.connection.Connection) -> None:
    """The child: receive OTLP/HTTP protobuf exports on /v1/traces; answer "spans", "clear"
    and "stop" from the pipe."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: PLC0415
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    counts: Counter[str] = Counter()
    lock = threading.Lock()
    empty = ExportTraceServiceResponse().SerializeToString()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            names = [
                span.name
                for resource in request.resource_spans
                for scope in resource.scope_spans
                for span in scope.spans
            ]
            with lock:
                counts.update(names)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(empty)))
            self.end_headers()
            self.wfile.write(empty)

        def log_message(self, format: str, *args: object) -> None:
            """Quiet: one line per export would drown the benchmark's progress."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    conn.send(f"http://127.0.0.1:{server.server_address[1]}")
    while True:
        try:
            method = conn.recv()
        except EOFError:
            break
        if method == "spans":
            with lock:
                conn.send(dict(counts))
        elif method == "clear":
            with lock:
                counts.clear()
            conn.send(None)
        else:
            conn.send(None)
            break
    server.shutdown()


class OtlpSink:
    """The receiver in a child process; :attr:`url` is the OTLP endpoint (no path)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), name="otlp-sink", daemon=True)
        self.process.start()
        child.close()
        if not self._conn.poll(30):
            self.process.kill()
            raise RuntimeError("the OTLP receiver did not start within 30 s")
        self.url: str = self._conn.recv()

    def spans(self) -> dict[str, int]:
        """Span name -> how many were received so far."""
        counts = self._call("spans")
        assert isinstance(counts, dict)  # noqa: S101 -- what the child sends for "spans"
        return counts

    def clear(self) -> None:
        """Forget every span received."""
        self._call("clear")

    def _call(self, method: str) -> object:
        self._conn.send(method)
        return self._conn.recv()

    def stop(self) -> None:
        """Stop the receiver and its process."""
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError):
                self._call("stop")
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()

    def __enter__(self) -> OtlpSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
