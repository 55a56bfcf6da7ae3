"""Tools under ``run_dispatch``/``run_lookup``: HTTP tools against a real local HTTP server,
Python tools that hang, raise or answer junk."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from outbox import tracing
from outbox.contracts import ContractTable
from outbox.tools import (
    Ambiguous,
    Applied,
    DispatchResult,
    HttpTool,
    Inconclusive,
    LookupResult,
    NotApplied,
    NotDelivered,
    Rejected,
    ToolCall,
    ToolRegistry,
    close_thread_loop,
    invoke,
    load_http_tools,
    run_dispatch,
    run_lookup,
    tool,
)
from outbox.tools.http.transport import _env_proxy
from outbox.tools.results import NotSent
from outbox.trace_context import TraceContext
from tests.otel import collecting

NAME = "deploy.create_release"
OPERATION_ID = "5d0c3f8e-0000-4000-8000-000000000001"
#: Slack allowed on top of a deadline before a test calls the call slow.
SLACK_S = 0.6

Behaviour = Callable[["Handler"], None]


@dataclass(frozen=True)
class Seen:
    """One request as the server received it."""

    method: str
    path: str
    client_port: int
    headers: dict[str, str]
    body: bytes


@dataclass
class Remote:
    """What the local server does for each method, and what it saw."""

    post: Behaviour
    get: Behaviour
    port: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    seen: list[Seen] = field(default_factory=list)


class Server(ThreadingHTTPServer):
    """A ThreadingHTTPServer that carries its Remote and stays quiet about broken pipes."""

    remote: Remote

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Ignore handler errors: a client that gave up is what several tests arrange."""


class Handler(BaseHTTPRequestHandler):
    """Records the request, then lets the test's behaviour answer."""

    protocol_version = "HTTP/1.1"  # keep-alive, so connection reuse is visible
    server: Server

    def do_POST(self) -> None:
        """Dispatch requests."""
        self._serve(self.server.remote.post)

    def do_GET(self) -> None:
        """Lookup requests."""
        self._serve(self.server.remote.get)

    def do_PUT(self) -> None:
        """Dispatch requests of a tool declared with method = "PUT"."""
        self._serve(self.server.remote.post)

    def _serve(self, behaviour: Behaviour) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.server.remote.seen.append(
            Seen(self.command, self.path, self.client_address[1], dict(self.headers.items()), body)
        )
        behaviour(self)

    def log_message(self, format: str, *args: Any) -> None:
        """Keep the test output clean."""


def respond(status: int, body: Any = None, *, delay_s: float = 0.0) -> Behaviour:
    """Answer ``status`` with ``body`` (bytes as is, anything else as JSON) after a delay."""
    raw = body if isinstance(body, bytes) else json.dumps(body if body is not None else {}).encode()

    def behave(handler: Handler) -> None:
        if delay_s and handler.server.remote.stop.wait(delay_s):
            return
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(raw)))
        handler.end_headers()
        handler.wfile.write(raw)

    return behave


def hang_up(handler: Handler) -> None:
    """Close the connection without answering."""
    handler.close_connection = True


def trickle(handler: Handler) -> None:
    """Send the headers, then one body byte every 50 ms: no read ever waits long."""
    handler.send_response(201)
    handler.send_header("Content-Length", "1000")
    handler.end_headers()
    try:
        for _ in range(1000):
            handler.wfile.write(b" ")
            handler.wfile.flush()
            if handler.server.remote.stop.wait(0.05):
                return
    except OSError:
        return  # the client gave up, as it should


@pytest.fixture(autouse=True)
def closed_loop() -> Iterator[None]:
    """Each test's event loop and HTTP client are closed after it, as a worker does at exit."""
    yield
    close_thread_loop()


@pytest.fixture
def remote() -> Iterator[Remote]:
    """A real HTTP server on 127.0.0.1 whose answers each test sets."""
    state = Remote(post=respond(201, {"id": "rel-1"}), get=respond(404))
    server = Server(("127.0.0.1", 0), Handler)
    server.remote = state
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    state.port = server.server_address[1]
    yield state
    state.stop.set()
    close_thread_loop()  # closes the kept-alive connections, ending their handler threads
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A port with a bound socket that does not listen: connecting is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def http_tool(
    tmp_path: Path,
    port: int,
    *,
    timeout_s: float = 2.0,
    remote_ref: str = "id",
    method: str = "POST",
    extra: tuple[str, ...] = (),
) -> HttpTool:
    """The DESIGN.md tool pointed at ``port``, with short deadlines (and ``extra`` lines)."""
    lines = [
        f'[tools."{NAME}"]',
        'kind = "http"',
        f'method = "{method}"',
        f'url = "http://127.0.0.1:{port}/projects/{{target}}/releases"',
        'idempotency_header = "Idempotency-Key"',
        f"timeout_s = {timeout_s}",
        "send_deadline_s = 1",
        f'remote_ref = "{remote_ref}"',
        "rejected_statuses = [400, 403, 404, 422]",
        f'lookup_url = "http://127.0.0.1:{port}/projects/{{target}}/releases/by-key/'
        '{operation_id}"',
        'lookup_remote_ref = "id"',
        "lookup_not_applied_statuses = [404]",
        "inflight_horizon_s = 60",
        'headers = { X-Client = "outbox-tests" }',
        'env_headers = { Authorization = "TEST_DEPLOY_TOKEN" }',
        *extra,
    ]
    path = tmp_path / "tools.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    (loaded,) = load_http_tools(path, environ={"TEST_DEPLOY_TOKEN": "Bearer t0ken"})
    return loaded


def make_call(**overrides: Any) -> ToolCall:
    """A ToolCall for the HTTP tool with a two-second budget."""
    values: dict[str, Any] = {
        "operation_id": OPERATION_ID,
        "intent_key": "release-1.2.3",
        "tool": NAME,
        "target": "project-a",
        "payload": {"version": "1.2.3"},
        "attempt": 1,
        "timeout_s": 2.0,
    }
    return ToolCall(**(values | overrides))


def timed(function: Callable[[], Any]) -> tuple[Any, float]:
    """The function's result and how long it took."""
    started = time.monotonic()
    result = function()
    return result, time.monotonic() - started


# --- HTTP dispatch ---------------------------------------------------------------------------


def test_created_with_an_id_is_applied(remote: Remote, tmp_path: Path) -> None:
    """201 with the remote_ref is Applied; the request carries the key, headers and payload."""
    remote.post = respond(201, {"id": "rel-7", "version": "1.2.3"})
    result = run_dispatch(http_tool(tmp_path, remote.port), make_call(target="team a/b?c"))
    assert result == Applied("rel-7", result={"id": "rel-7", "version": "1.2.3"})
    (seen,) = remote.seen
    assert seen.method == "POST"
    assert seen.path == "/projects/team%20a%2Fb%3Fc/releases"
    assert seen.headers["Idempotency-Key"] == OPERATION_ID
    assert seen.headers["Authorization"] == "Bearer t0ken"
    assert seen.headers["X-Client"] == "outbox-tests"
    assert seen.headers["Content-Type"] == "application/json"
    assert json.loads(seen.body) == {"version": "1.2.3"}


TRACE = TraceContext("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "k=v")


def test_the_operations_trace_context_goes_to_the_remote(remote: Remote, tmp_path: Path) -> None:
    """The stored W3C context is sent as traceparent/tracestate, on dispatch and lookup, so
    the remote's spans join the agent's trace; an operation without one sends neither."""
    remote.post = respond(201, {"id": "rel-7"})
    remote.get = respond(200, {"id": "rel-7"})
    tool = http_tool(tmp_path, remote.port)
    run_dispatch(tool, make_call(trace=TRACE))
    run_lookup(tool, make_call(trace=TRACE))
    run_dispatch(tool, make_call())
    traced_post, traced_get, plain = remote.seen
    for seen in (traced_post, traced_get):
        assert (seen.headers["traceparent"], seen.headers["tracestate"]) == (
            TRACE.traceparent,
            TRACE.tracestate,
        )
    assert "traceparent" not in plain.headers
    assert "tracestate" not in plain.headers


def test_propagate_trace_false_keeps_the_trace_from_the_remote(
    remote: Remote, tmp_path: Path
) -> None:
    """A tool declared with propagate_trace = false sends no trace context."""
    remote.post = respond(201, {"id": "rel-7"})
    remote.get = respond(200, {"id": "rel-7"})
    tool = http_tool(tmp_path, remote.port, extra=("propagate_trace = false",))
    run_dispatch(tool, make_call(trace=TRACE))
    run_lookup(tool, make_call(trace=TRACE))
    for seen in remote.seen:
        assert "traceparent" not in seen.headers
        assert "tracestate" not in seen.headers


def test_a_nested_remote_ref_is_followed(remote: Remote, tmp_path: Path) -> None:
    """remote_ref follows objects and list indexes into the answer."""
    remote.post = respond(200, {"data": {"items": [{"id": 31}]}})
    tool_ = http_tool(tmp_path, remote.port, remote_ref="data.items.0.id")
    assert run_dispatch(tool_, make_call()) == Applied(
        "31", result={"data": {"items": [{"id": 31}]}}
    )


@pytest.mark.parametrize(
    ("behaviour", "reason"),
    [
        (respond(200, {"status": "ok"}), "HTTP 200 without a value at 'id'"),
        (respond(201, b"{not json"), "HTTP 201 with a malformed JSON answer"),
        (respond(201, {"id": ""}), "HTTP 201 without a value at 'id'"),
        (respond(409, {"error": "key in use"}), "409: key in use"),
        (respond(500, {"error": "boom"}), "HTTP 500"),
        (respond(503, b""), "HTTP 503: (empty body)"),
        (respond(302, {}), "HTTP 302"),
        (hang_up, "ServerDisconnectedError"),
    ],
)
def test_uncertain_answers_are_ambiguous(
    remote: Remote, tmp_path: Path, behaviour: Behaviour, reason: str
) -> None:
    """A 2xx without a reference, malformed JSON, 409, 5xx, 3xx or a hang-up is Ambiguous."""
    remote.post = behaviour
    result = run_dispatch(http_tool(tmp_path, remote.port), make_call())
    assert isinstance(result, Ambiguous)
    assert reason in result.reason
    assert len(remote.seen) == 1  # one request, never a retry


def test_a_declared_refusal_is_rejected(remote: Remote, tmp_path: Path) -> None:
    """A status in rejected_statuses is Rejected with the status and a short body."""
    remote.post = respond(422, {"error": "version " + "x" * 400})
    result = run_dispatch(http_tool(tmp_path, remote.port), make_call())
    assert isinstance(result, Rejected)
    assert result.reason.startswith('HTTP 422: {"error": "version xxx')
    assert len(result.reason) < 230
    assert result.result == {"error": "version " + "x" * 400}


def test_an_answer_later_than_the_timeout_is_ambiguous(remote: Remote, tmp_path: Path) -> None:
    """A server answering after the deadline makes the call Ambiguous, on time."""
    remote.post = respond(201, {"id": "rel-late"}, delay_s=3)
    result, elapsed = timed(
        lambda: run_dispatch(
            http_tool(tmp_path, remote.port, timeout_s=0.5), make_call(timeout_s=0.5)
        )
    )
    assert isinstance(result, Ambiguous)
    assert elapsed < 0.5 + SLACK_S


def test_the_total_deadline_bounds_a_trickling_answer(remote: Remote, tmp_path: Path) -> None:
    """A body trickling in faster than any read timeout still ends at the total deadline."""
    remote.post = trickle
    result, elapsed = timed(
        lambda: run_dispatch(http_tool(tmp_path, remote.port), make_call(timeout_s=0.6))
    )
    assert result == Ambiguous("exceeded the total deadline of 0.6s")
    assert 0.5 < elapsed < 0.6 + SLACK_S


def test_a_refused_connection_is_not_delivered(refused_port: int, tmp_path: Path) -> None:
    """Connection refused means no byte left: NotDelivered, for dispatch; Inconclusive, lookup."""
    http = http_tool(tmp_path, refused_port)
    result = run_dispatch(http, make_call())
    assert isinstance(result, NotDelivered)
    assert "ClientConnectorError" in result.reason
    assert result.reason.endswith("nothing was sent")
    assert isinstance(run_lookup(http, make_call()), Inconclusive)


def test_a_connection_ready_after_the_send_deadline_is_not_written_to(
    remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process paused after connecting, past the call's send deadline, writes nothing:
    NotSent, the remote sees no request; the same call in time is sent once."""
    create_connection = aiohttp.TCPConnector._create_connection

    async def paused_connect(self: aiohttp.TCPConnector, *args: Any, **kwargs: Any) -> Any:
        connected = await create_connection(self, *args, **kwargs)
        time.sleep(0.6)  # the whole process stalls after the handshake
        return connected

    monkeypatch.setattr(aiohttp.TCPConnector, "_create_connection", paused_connect)
    http = http_tool(tmp_path, remote.port)
    result = run_dispatch(http, make_call(send_by=time.monotonic() + 0.3))
    assert isinstance(result, NotSent)
    assert result.reason.startswith("not sent")
    assert remote.seen == []
    assert isinstance(run_dispatch(http, make_call(send_by=time.monotonic() + 5)), Applied)
    assert len(remote.seen) == 1


def test_a_sync_call_given_a_thread_after_its_send_deadline_is_not_made(
    registry: ToolRegistry,
) -> None:
    """A synchronous tool whose thread comes after the call's send deadline is not run."""
    ran: list[str] = []

    def remote(call: ToolCall) -> DispatchResult:
        ran.append(call.operation_id)
        return Applied("r")

    sync_tool = tool(NAME, timeout=2, send_deadline=1, inflight_horizon=60, registry=registry)(
        remote
    )
    result = run_dispatch(sync_tool, make_call(send_by=time.monotonic() - 0.1))
    assert isinstance(result, NotSent)
    assert ran == []


@pytest.mark.parametrize("method", ["POST", "PUT"])
def test_a_dropped_kept_alive_connection_is_not_sent_again(
    remote: Remote, tmp_path: Path, method: str
) -> None:
    """The remote reads the request on a reused connection and hangs up: one request, Ambiguous.

    HTTP clients resend an idempotent method (PUT) when a kept-alive connection turns out
    closed; the remote may have applied the first, so for a tool that is a second call.
    """
    http = http_tool(tmp_path, remote.port, method=method)
    assert run_dispatch(http, make_call()) == Applied("rel-1", result={"id": "rel-1"})
    remote.post = hang_up
    result = run_dispatch(http, make_call())
    assert isinstance(result, Ambiguous)
    assert [seen.method for seen in remote.seen] == [method, method]
    assert remote.seen[0].client_port == remote.seen[1].client_port  # the kept-alive one


def test_requests_go_through_the_proxy_the_environment_names(
    remote: Remote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HTTP_PROXY is honoured (read once per host), and NO_PROXY exempts a host from it."""
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{remote.port}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    _env_proxy.cache_clear()
    try:
        nothing_listens = 9  # the discard port: only the proxy can answer
        assert run_dispatch(http_tool(tmp_path, nothing_listens), make_call()) == Applied(
            "rel-1", result={"id": "rel-1"}
        )
        (seen,) = remote.seen
        assert seen.path == "http://127.0.0.1:9/projects/project-a/releases"  # proxy form
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        _env_proxy.cache_clear()
        assert isinstance(run_dispatch(http_tool(tmp_path, remote.port), make_call()), Applied)
        assert remote.seen[1].path == "/projects/project-a/releases"  # straight to the remote
    finally:
        _env_proxy.cache_clear()


def test_dots_in_a_target_stay_in_place(remote: Remote, tmp_path: Path) -> None:
    """A target of '...' or 'a/..b' (dots, no dot segment) is one encoded segment; a '..'
    target is never sent (tests/integration/test_dot_segments.py)."""
    for target in ("...", "a/..b"):
        run_dispatch(http_tool(tmp_path, remote.port), make_call(target=target))
    assert [seen.path for seen in remote.seen] == [
        "/projects/.../releases",
        "/projects/a%2F..b/releases",
    ]


# --- HTTP lookup -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("behaviour", "expected"),
    [
        (respond(200, {"id": "rel-9"}), Applied("rel-9", result={"id": "rel-9"})),
        (respond(404, {"error": "no such key"}), NotApplied("HTTP 404")),
        (respond(500, {"error": "boom"}), Inconclusive('HTTP 500: {"error": "boom"}')),
        (respond(200, {"state": "pending"}), Inconclusive('HTTP 200: {"state": "pending"}')),
        (respond(200, b"<html>"), Inconclusive("HTTP 200: <html>")),
        # NUL and bytes that are not UTF-8 come out escaped, so the reason can be stored.
        (respond(200, b"a\x00b\xff"), Inconclusive("HTTP 200: a\\x00b\\xff")),
        (respond(410, {}), Inconclusive("HTTP 410: {}")),
    ],
)
def test_lookup_answers(
    remote: Remote, tmp_path: Path, behaviour: Behaviour, expected: LookupResult
) -> None:
    """Only a resolved lookup_remote_ref is Applied and only a declared status NotApplied."""
    remote.get = behaviour
    assert run_lookup(http_tool(tmp_path, remote.port), make_call()) == expected
    (seen,) = remote.seen
    assert (seen.method, seen.path) == (
        "GET",
        f"/projects/project-a/releases/by-key/{OPERATION_ID}",
    )
    assert seen.headers["Authorization"] == "Bearer t0ken"


def test_a_slow_lookup_is_inconclusive(remote: Remote, tmp_path: Path) -> None:
    """A lookup answering after the deadline is Inconclusive, on time."""
    remote.get = respond(200, {"id": "rel-9"}, delay_s=3)
    result, elapsed = timed(
        lambda: run_lookup(http_tool(tmp_path, remote.port), make_call(timeout_s=0.4))
    )
    assert isinstance(result, Inconclusive)
    assert elapsed < 0.4 + SLACK_S


def test_connections_are_reused_across_calls(remote: Remote, tmp_path: Path) -> None:
    """Consecutive calls on one thread share the event loop, its client and the connection."""
    http = http_tool(tmp_path, remote.port)
    assert run_dispatch(http, make_call()) == Applied("rel-1", result={"id": "rel-1"})
    assert run_lookup(http, make_call()) == NotApplied("HTTP 404")
    first, second = remote.seen
    assert first.client_port == second.client_port


def test_a_direct_call_on_a_foreign_loop_leaves_nothing_open(
    remote: Remote, tmp_path: Path
) -> None:
    """Awaiting dispatch on a caller's own loop uses a one-call client, closed with the call."""
    http = http_tool(tmp_path, remote.port)
    result = asyncio.run(http.dispatch(make_call()))
    assert result == Applied("rel-1", result={"id": "rel-1"})
    assert asyncio.run(http.lookup(make_call())) == NotApplied("HTTP 404")
    first, second = remote.seen
    assert first.client_port != second.client_port


# --- Python tools under run_dispatch ---------------------------------------------------------


@pytest.fixture
def registry() -> ToolRegistry:
    """A private registry, so these tools never reach the process-wide tables."""
    return ToolRegistry(ContractTable())


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at teardown to free the threads of abandoned synchronous calls."""
    event = threading.Event()
    yield event
    event.set()


def test_a_sync_tool_past_its_deadline_is_ambiguous(
    registry: ToolRegistry, release: threading.Event
) -> None:
    """A synchronous tool still running at the deadline is abandoned and reported Ambiguous."""

    @tool("slow.sync", registry=registry)
    def slow(call: ToolCall) -> DispatchResult:
        release.wait(10)
        return Applied("too-late")

    result, elapsed = timed(lambda: run_dispatch(slow, make_call(timeout_s=0.3)))
    assert result == Ambiguous("exceeded the total deadline of 0.3s")
    assert elapsed < 0.3 + SLACK_S


def test_an_async_tool_past_its_deadline_is_ambiguous(registry: ToolRegistry) -> None:
    """An async tool is cancelled at the deadline and reported Ambiguous."""
    cancelled = threading.Event()

    @tool("slow.async", registry=registry)
    async def slow(call: ToolCall) -> DispatchResult:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Applied("too-late")

    result, elapsed = timed(lambda: run_dispatch(slow, make_call(timeout_s=0.3)))
    assert result == Ambiguous("exceeded the total deadline of 0.3s")
    assert elapsed < 0.3 + SLACK_S
    assert cancelled.is_set()


@pytest.mark.parametrize("is_async", [False, True])
def test_raising_tools_are_ambiguous_or_inconclusive(
    registry: ToolRegistry, is_async: bool
) -> None:
    """An exception from dispatch is Ambiguous and from lookup Inconclusive, naming its type."""

    def fail(call: ToolCall) -> Any:
        raise ValueError("boom")

    async def fail_async(call: ToolCall) -> Any:
        raise ValueError("boom")

    broken = tool("broken.tool", registry=registry)(fail_async if is_async else fail)
    broken.lookup(fail_async if is_async else fail)
    assert run_dispatch(broken, make_call()) == Ambiguous("ValueError: boom")
    assert run_lookup(broken, make_call()) == Inconclusive("ValueError: boom")


@pytest.mark.parametrize("is_async", [False, True])
def test_junk_answers_are_ambiguous_or_inconclusive(registry: ToolRegistry, is_async: bool) -> None:
    """A tool answering something that is not a result type is Ambiguous or Inconclusive."""

    def junk(call: ToolCall) -> Any:
        return {"ok": True}

    async def junk_async(call: ToolCall) -> Any:
        return NotApplied()  # a lookup result is junk for a dispatch

    odd = tool("odd.tool", registry=registry)(junk_async if is_async else junk)
    odd.lookup(junk)
    result = run_dispatch(odd, make_call())
    assert isinstance(result, Ambiguous)
    assert "not a DispatchResult" in result.reason
    assert run_lookup(odd, make_call()) == Inconclusive(
        "lookup returned {'ok': True}, not a LookupResult"
    )


def test_a_sync_tool_returning_a_coroutine_is_ambiguous(registry: ToolRegistry) -> None:
    """A coroutine from a function not declared async is never run and reported Ambiguous."""

    async def answer() -> DispatchResult:
        return Applied("never")

    @tool("sneaky.tool", registry=registry)
    def sneaky(call: ToolCall) -> Any:
        return answer()

    result = run_dispatch(sneaky, make_call())
    assert isinstance(result, Ambiguous)
    assert "coroutine" in result.reason


def test_good_answers_pass_through(registry: ToolRegistry) -> None:
    """A sync or async tool's result comes back unchanged; a tool without lookup is
    Inconclusive."""

    @tool("fine.sync", registry=registry)
    def fine(call: ToolCall) -> DispatchResult:
        return Applied(f"ok-{call.attempt}")

    @tool("fine.async", registry=registry)
    async def fine_async(call: ToolCall) -> DispatchResult:
        return Rejected("no")

    assert run_dispatch(fine, make_call(attempt=3)) == Applied("ok-3")
    assert run_dispatch(fine_async, make_call()) == Rejected("no")
    assert run_lookup(fine, make_call()) == Inconclusive("tool 'fine.sync' has no lookup")


def test_a_call_that_never_got_a_thread_is_not_delivered(
    registry: ToolRegistry, release: threading.Event
) -> None:
    """With every tool thread busy past the deadline the call never ran: NotDelivered."""
    ran = threading.Event()

    @tool("queued.tool", registry=registry)
    def queued(call: ToolCall) -> DispatchResult:
        ran.set()
        return Applied("ran")

    pool = invoke._shared_pool()
    blockers = [pool.submit(release.wait, 10) for _ in range(invoke.POOL_THREADS)]
    result = run_dispatch(queued, make_call(timeout_s=0.2))
    release.set()
    for blocker in blockers:
        blocker.result(timeout=5)
    assert isinstance(result, NotDelivered)
    assert "never started" in result.reason
    assert not ran.is_set()


def test_run_dispatch_refuses_to_block_a_running_event_loop(registry: ToolRegistry) -> None:
    """Called from inside an event loop, run_dispatch raises before calling the tool."""
    called = threading.Event()

    @tool("loop.tool", registry=registry)
    def loop_tool(call: ToolCall) -> DispatchResult:
        called.set()
        return Applied("x")

    async def inside() -> DispatchResult:
        return run_dispatch(loop_tool, make_call())

    with pytest.raises(RuntimeError, match="not from inside a running event loop"):
        asyncio.run(inside())
    assert not called.is_set()


# --- hosts chosen by the agent's values ------------------------------------------------------


def host_placeholder_tool(tmp_path: Path, port: int) -> HttpTool:
    """A tool whose host is the target, on the local server's port, allowed for localhost."""
    path = tmp_path / "hosts.toml"
    path.write_text(
        f'[tools."{NAME}"]\n'
        'kind = "http"\n'
        f'url = "http://{{target}}:{port}/releases"\n'
        'idempotency_header = "Idempotency-Key"\n'
        'remote_ref = "id"\n'
        f'lookup_url = "http://{{target}}:{port}/by-key/{{operation_id}}"\n'
        'lookup_remote_ref = "id"\n'
        "lookup_not_applied_statuses = [404]\n"
        'allowed_hosts = ["localhost", "*.localhost"]\n',
        encoding="utf-8",
    )
    (loaded,) = load_http_tools(path)
    return loaded


@pytest.mark.parametrize("target", ["127.0.0.1", "169.254.169.254", "localhost.evil.example"])
def test_a_host_outside_allowed_hosts_is_refused_before_any_request(
    remote: Remote, tmp_path: Path, target: str
) -> None:
    """A target rendering the host to an address outside allowed_hosts is Rejected (dispatch)
    or Inconclusive (lookup), without a connection: the local server, where 127.0.0.1 would
    have gone, receives nothing; an allowed host gets through."""
    tool_ = host_placeholder_tool(tmp_path, remote.port)
    dispatched = run_dispatch(tool_, make_call(target=target))
    assert isinstance(dispatched, Rejected)
    assert f"host {target!r} is not in tool {NAME!r}'s allowed_hosts" in dispatched.reason
    assert "nothing was sent" in dispatched.reason
    looked_up = run_lookup(tool_, make_call(target=target))
    assert isinstance(looked_up, Inconclusive)
    assert "the lookup was not sent" in looked_up.reason
    assert remote.seen == []
    assert run_dispatch(tool_, make_call(target="localhost")) == Applied(
        "rel-1", result={"id": "rel-1"}
    )
    assert [seen.path for seen in remote.seen] == ["/releases"]


@pytest.fixture
def instrumented_aiohttp() -> Iterator[InMemorySpanExporter]:
    """Tracing on with the aiohttp client instrumentation (as a traced worker has it), on a
    fresh thread loop and client; taken off again afterwards."""
    exporter = collecting()
    close_thread_loop()  # the next client is made instrumented
    assert tracing.instrument_with(["aiohttp"]) == ["aiohttp"]
    try:
        yield exporter
    finally:
        AioHttpClientInstrumentor().uninstrument()
        tracing._instrumented.discard("aiohttp")
        close_thread_loop()
        exporter.clear()


def test_with_aiohttp_instrumented_the_span_shows_the_template_and_propagate_false_holds(
    remote: Remote, tmp_path: Path, instrumented_aiohttp: InMemorySpanExporter
) -> None:
    """The aiohttp instrumentation's span of a tool request shows the URL template, never the
    rendered URL (it carries the target); a propagate_trace = false tool's request is left out
    of it: no span, and no traceparent injected."""
    remote.post = respond(201, {"id": "rel-7"})
    traced = http_tool(tmp_path, remote.port)
    run_dispatch(traced, make_call(trace=TRACE, target="secret-target"))
    (span,) = [s for s in instrumented_aiohttp.get_finished_spans() if s.name == "POST"]
    attributes = dict(span.attributes or {})
    assert "{target}" in str(attributes["url.full"]), attributes
    assert not any("secret-target" in str(v) for v in attributes.values())
    instrumented_aiohttp.clear()
    private = http_tool(tmp_path, remote.port, extra=("propagate_trace = false",))
    run_dispatch(private, make_call(trace=TRACE, target="secret-target"))
    assert instrumented_aiohttp.get_finished_spans() == ()
    assert "traceparent" not in remote.seen[-1].headers
