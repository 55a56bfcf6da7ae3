"""The reference service's HTTP interface: routes, answers, and the connection faults.

JSON in and out, HTTP/1.1 keep-alive, every answer has a Content-Length:

``POST /projects/{target}/releases``
    Header ``Idempotency-Key`` (the name is configurable) and a JSON body, the payload. Creates
    one release and answers 201 ``{id, kind, target, key, payload, created_at}`` (``id``
    ``rel-N``, ``kind`` ``release``); 400 without a key or when the body is not JSON. With a
    dedup window, the same key with the same target and payload (compared as canonical JSON)
    within the window of the key's latest effect answers 200 with that release and
    ``Idempotent-Replayed: true``; the same key with anything else answers 422 and commits
    nothing. Without a window every POST creates an effect, even with a
    key already seen: that is how tests detect duplicates.
``POST /projects/{target}/rollbacks``
    The undo of a release: the same header and a JSON object naming the release,
    ``{"release": "rel-N", ...}`` (400 without it). Records a ``rollback`` effect (``id``
    ``rb-N``) and answers 201, exactly as a create does: the same dedup window, the same faults
    (including the payload's ``_fault``), so without a window a rollback sent twice is two
    effects in the ledger. 422 when the target has no such release (nothing committed). A
    release may be rolled back under several keys: each is an effect, so a duplicate undo shows.
``GET /projects/{target}/releases/by-key/{key}`` (and ``.../rollbacks/by-key/{key}``)
    200 and the first release (rollback) with that key for that target, 404 if none, 501 when
    lookups are disabled.
``GET /ledger`` (every effect of both kinds, in commit order), ``GET /ledger/duplicates``
(keys with more than one effect), ``DELETE /ledger`` (forget every effect and reset the stats).
``GET /health``, ``GET /_stats`` (counts by outcome).
``GET /_faults``, ``POST /_faults``, ``DELETE /_faults``, ``POST /_faults/keys/{key}``
(see :mod:`outbox.dev.service.faults`).
"""

from __future__ import annotations

import contextlib
import json
import socket
import socketserver
import struct
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, Protocol
from urllib.parse import unquote, urlsplit

from outbox.canonical import NotCanonicalizable, canonical_json
from outbox.dev.service.errors import DeployServiceError
from outbox.dev.service.faults import FaultMode, Faults, fault_mode
from outbox.dev.service.ledger import Effect, EffectKind, Ledger, LedgerClosed, Outcome
from outbox.dev.service.stats import Stats


class ServedService(Protocol):
    """What the HTTP handlers use of :class:`outbox.dev.service.service.DeployService`
    (a protocol, so the service imports its server and not the other way round)."""

    dedup_window_s: float | None
    lookup_enabled: bool
    idempotency_header: str
    log_requests: bool
    faults: Faults
    stats: Stats
    stopping: threading.Event

    def ledger(self) -> list[Effect]:
        """Every effect, in order."""

    def handling(self, key: str, target: str = "") -> AbstractContextManager[None]:
        """Count a create request for ``key`` as in flight while the block runs."""

    def note_arrival(self, key: str) -> None:
        """Note when the first request for ``key`` arrived."""

    def clear(self) -> None:
        """Forget every effect."""

    def store(self) -> Ledger:
        """The ledger, open."""


#: Bodies above this are refused (413); a release payload is a few hundred bytes.
MAX_BODY_BYTES = 1024 * 1024


class _HttpError(Exception):
    def __init__(self, status: int, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.close = close


@dataclass(frozen=True, slots=True)
class _Reply:
    """What to do with the connection: answer, reset it, or close it without a word."""

    status: int = 200
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    close: bool = False
    kind: Literal["answer", "reset", "drop"] = "answer"


_RESET = _Reply(kind="reset")
_DROP = _Reply(kind="drop")


def _parse_json(body: bytes, what: str) -> Any:
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    try:
        return json.loads(body, parse_constant=refuse)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _HttpError(400, f"{what} is not valid JSON: {exc}") from exc


def _canonical_text(payload: Any) -> str:
    """The payload as the outbox's own canonical JSON (RFC 8785), so "the same payload" means
    here what it means to the outbox's intent hash: ``1`` and ``1.0`` alike, keys in any order."""
    try:
        return canonical_json(payload).decode()
    except NotCanonicalizable as exc:
        raise _HttpError(400, f"the body cannot be compared as canonical JSON: {exc}") from exc


def _json_object(body: bytes, what: str) -> dict[str, Any]:
    value = _parse_json(body or b"{}", what)
    if not isinstance(value, dict):
        raise _HttpError(400, f"{what} must be a JSON object")
    return value


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a benchmark must not pay a handshake per call
    server_version = "outbox-deploy-service/1"
    disable_nagle_algorithm = True
    wbufsize = 64 * 1024  # headers and body leave in one send: handle_one_request flushes
    timeout = 120  # an idle keep-alive connection is closed after this many seconds
    server: Server

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_DELETE(self) -> None:
        self._handle()

    def do_PUT(self) -> None:
        self._handle()

    def do_PATCH(self) -> None:
        self._handle()

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.service.log_requests:
            super().log_message(format, *args)

    def _handle(self) -> None:
        service = self.server.service
        service.stats.add("requests")
        try:
            reply = self._route(self._read_body())
        except _HttpError as exc:
            reply = _Reply(exc.status, {"error": exc.message}, close=exc.close)
        except LedgerClosed:
            reply = _DROP
        except Exception:  # noqa: BLE001 - a bug answers 500 and is printed, the server lives on
            traceback.print_exc(file=sys.stderr)
            reply = _Reply(500, {"error": "internal error, see the service's stderr"}, close=True)
        if reply.kind == "reset":
            self._reset()
        elif reply.kind == "drop":
            self.close_connection = True
        else:
            self._answer(reply)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            raise _HttpError(411, "send a Content-Length; chunked bodies are refused", close=True)
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        try:
            size = int(length)
        except ValueError:
            size = -1
        if size < 0:
            raise _HttpError(400, f"bad Content-Length {length!r}", close=True)
        if size > MAX_BODY_BYTES:
            raise _HttpError(413, f"body over {MAX_BODY_BYTES} bytes", close=True)
        return self.rfile.read(size)

    def _route(self, body: bytes) -> _Reply:  # noqa: PLR0911 - one return per route, a table
        service = self.server.service
        parts = tuple(unquote(part) for part in urlsplit(self.path).path.strip("/").split("/"))
        match (self.command, parts):
            case ("POST", ("projects", str(target), "releases" | "rollbacks" as kinds)) if target:
                return self._create(target, body, _KINDS[kinds])
            case (
                "GET",
                ("projects", str(target), "releases" | "rollbacks" as kinds, "by-key", str(key)),
            ) if key:
                return self._lookup(target, key, _KINDS[kinds])
            case ("GET", ("health",)):
                return _Reply(200, {"status": "ok"})
            case ("GET", ("ledger",)):
                effects = service.ledger()
                return _Reply(
                    200, {"effects": [e.to_dict() for e in effects], "count": len(effects)}
                )
            case ("GET", ("ledger", "duplicates")):
                return _Reply(200, _duplicates(service.ledger()))
            case ("DELETE", ("ledger",)):
                service.clear()
                return _Reply(200, {"cleared": True})
            case ("GET", ("_stats",)):
                return _Reply(200, service.stats.snapshot())
            case ("GET", ("_faults",)):
                return _Reply(200, service.faults.snapshot())
            case ("POST", ("_faults",)):
                return self._configure_faults(body)
            case ("DELETE", ("_faults",)):
                service.faults.clear()
                return _Reply(200, service.faults.snapshot())
            case ("POST", ("_faults", "keys", str(key))) if key:
                return self._arm_key(key, body)
            case _:
                raise _HttpError(404, f"no route {self.command} {self.path}")

    def _create(self, target: str, body: bytes, kind: EffectKind) -> _Reply:
        service = self.server.service
        key = self.headers.get(service.idempotency_header)
        if not key:
            service.stats.add("rejected.missing_key")
            raise _HttpError(400, f"missing {service.idempotency_header} header")
        service.note_arrival(key)
        with service.handling(key, target):
            return self._create_keyed(service, target, key, body, kind)

    def _create_keyed(  # noqa: PLR0911 - one return per answer (a fault's, a refusal's)
        self, service: ServedService, target: str, key: str, body: bytes, kind: EffectKind
    ) -> _Reply:
        try:
            payload = _parse_json(body, "the body")
            text = _canonical_text(payload)
            undone = _rolled_back(payload) if kind == "rollback" else None
            fault = service.faults.choose(key, self._requested_fault(payload))
        except _HttpError:
            service.stats.add("rejected.bad_body")
            raise
        if fault is not None:
            service.stats.add(f"faulted.{fault}")
        if fault == "error_503":
            return _Reply(503, {"error": "service unavailable"})
        if fault == "reject_422":
            return _Reply(422, {"error": "rejected"})
        if fault == "slow" and not self._pause():
            return _DROP
        if undone is not None and service.store().release(target, undone) is None:
            service.stats.add("rejected.unknown_release")
            return _Reply(422, {"error": f"no release {undone} in project {target}"})
        reply = _recorded(
            service, *service.store().record(target, key, text, service.dedup_window_s, kind)
        )
        if fault == "commit_then_reset":
            return _RESET
        if fault == "commit_then_timeout":
            return replace(reply, close=True) if self._pause() else _DROP
        return reply

    def _requested_fault(self, payload: Any) -> FaultMode | None:
        try:
            header = self.headers.get("X-Fault")
            if header:
                return fault_mode(header, "X-Fault")
            if isinstance(payload, dict) and "_fault" in payload:
                return fault_mode(payload["_fault"], "_fault")
        except DeployServiceError as exc:
            raise _HttpError(400, str(exc)) from exc
        return None

    def _lookup(self, target: str, key: str, kind: EffectKind) -> _Reply:
        service = self.server.service
        if not service.lookup_enabled:
            service.stats.add("lookups.disabled")
            return _Reply(501, {"error": "lookup disabled"})
        effect = service.store().first(target, key, kind)
        service.stats.add("lookups.missing" if effect is None else "lookups.found")
        if effect is None:
            return _Reply(404, {"error": f"no {kind} for key"})
        return _Reply(200, effect.to_dict())

    def _configure_faults(self, body: bytes) -> _Reply:
        faults = self.server.service.faults
        request = _json_object(body, "the body")
        unknown = set(request) - {"rates", "seed", "delay_s"}
        if unknown:
            raise _HttpError(
                400, f"unknown fields {sorted(unknown)}: expected rates, seed, delay_s"
            )
        rates, seed = request.get("rates"), request.get("seed")
        if rates is not None and not isinstance(rates, dict):
            raise _HttpError(400, "rates must be an object of mode: probability")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise _HttpError(400, f"seed must be an integer, got {seed!r}")
        try:
            faults.configure(
                rates=rates,
                seed=seed,
                delay_s=request.get("delay_s"),
                reseed="rates" in request or "seed" in request,
            )
        except DeployServiceError as exc:
            raise _HttpError(400, str(exc)) from exc
        return _Reply(200, faults.snapshot())

    def _arm_key(self, key: str, body: bytes) -> _Reply:
        request = _json_object(body, "the body")
        times = request.get("times", 1)
        if isinstance(times, bool) or not isinstance(times, int) or times < 1:
            raise _HttpError(400, f"times must be an integer >= 1, got {times!r}")
        try:
            mode = fault_mode(request.get("mode"), "mode")
        except DeployServiceError as exc:
            raise _HttpError(400, str(exc)) from exc
        self.server.service.faults.arm_key(key, mode, times)
        return _Reply(200, {"key": key, "mode": mode, "times": times})

    def _pause(self) -> bool:
        """Wait the fault delay; False when the service stopped meanwhile."""
        service = self.server.service
        return not service.stopping.wait(service.faults.delay_s)

    def _reset(self) -> None:
        # Linger 0: closing sends RST instead of FIN, and the server skips its shutdown(),
        # which would send a FIN first; the client sees "connection reset", no response.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.server.reset_on_close(self.connection)

    def _answer(self, reply: _Reply) -> None:
        body = b"" if reply.body is None else json.dumps(reply.body).encode()
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in reply.headers.items():
            self.send_header(name, value)
        if reply.close:
            self.send_header("Connection", "close")  # also sets close_connection
        self.end_headers()
        self.wfile.write(body)


#: The effect kind of each path's collection.
_KINDS: dict[str, EffectKind] = {"releases": "release", "rollbacks": "rollback"}


def _recorded(service: ServedService, outcome: Outcome, effect: Effect) -> _Reply:
    """The answer to a recorded request, counted in the stats."""
    if outcome == "key_reused":
        service.stats.add("rejected.key_reused")
        return _Reply(422, {"error": "key reused with another payload"})
    if outcome == "deduplicated":
        service.stats.add("deduplicated")
        return _Reply(200, effect.to_dict(), {"Idempotent-Replayed": "true"})
    service.stats.add("created" if effect.kind == "release" else "rolled_back")
    return _Reply(201, effect.to_dict())


def _rolled_back(payload: Any) -> str:
    """The release a rollback's body names (``{"release": "rel-N"}``), or 400."""
    release = payload.get("release") if isinstance(payload, dict) else None
    if not isinstance(release, str) or not release:
        raise _HttpError(400, 'a rollback names its release: {"release": "rel-N", ...}')
    return release


def _duplicates(effects: Sequence[Effect]) -> dict[str, Any]:
    ids: dict[str, list[str]] = {}
    for effect in effects:
        ids.setdefault(effect.key, []).append(effect.id)
    repeated = [{"key": key, "count": len(i), "ids": i} for key, i in ids.items() if len(i) > 1]
    return {"duplicates": repeated, "count": len(repeated)}


class Server(ThreadingHTTPServer):
    """The threading HTTP server of one deploy service (:class:`ServedService`); it can reset
    a connection."""

    daemon_threads = True  # a request sleeping in a fault must not hold up the process's exit
    request_queue_size = 128  # bursts of concurrent clients in benchmarks
    allow_reuse_port = False  # "port in use" must be an error, not a second listener

    def __init__(self, address: tuple[str, int], service: ServedService) -> None:
        self.service = service
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._resets: set[socket.socket] = set()
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN, which may query DNS: skip it.
        socketserver.TCPServer.server_bind(self)
        host, port = self.socket.getsockname()[:2]
        self.server_name, self.server_port = host, port

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def reset_on_close(self, request: socket.socket) -> None:
        """Close ``request`` without shutdown(), so its linger-0 close sends a reset."""
        with self._lock:
            self._resets.add(request)

    def shutdown_request(self, request: Any) -> None:
        with self._lock:
            self._open.discard(request)
            reset = request in self._resets
            self._resets.discard(request)
        if reset:
            request.close()
        else:
            super().shutdown_request(request)

    def close_connections(self) -> None:
        """Wake every handler waiting on a keep-alive connection, so it ends."""
        with self._lock:
            connections = list(self._open)
        for connection in connections:
            with contextlib.suppress(OSError):  # already closed by its handler
                connection.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError) or self.service.stopping.is_set():
            return  # the client went away (it timed out, on purpose): nothing to report
        super().handle_error(request, client_address)
