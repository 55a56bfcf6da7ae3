"""The reference remote service: releases keyed by an idempotency key, with injectable faults.

A real HTTP server, standard library only, that tests, the demo and the benchmarks use as the
remote whose behaviour the outbox must survive. It keeps a ledger of every effect it ever
committed, so a test asks the remote itself whether an action happened twice or not at all.
Times (``created_at``, the dedup window) are the service's own clock, as for any remote.

HTTP interface (JSON in and out, HTTP/1.1 keep-alive, every answer has a Content-Length):

``POST /projects/{target}/releases``
    Header ``Idempotency-Key`` (the name is configurable) and a JSON body, the payload. Creates
    one effect and answers 201 ``{id, target, key, payload, created_at}``; 400 without a key or
    when the body is not JSON. With a dedup window, the same key with the same target and
    payload (compared as canonical JSON) within the window of the key's latest effect answers
    200 with that release and ``Idempotent-Replayed: true``; the same key with anything else
    answers 422 and commits nothing. Without a window every POST creates an effect, even with a
    key already seen: that is how tests detect duplicates.
``GET /projects/{target}/releases/by-key/{key}``
    200 and the first release with that key for that target, 404 if none, 501 when lookups
    are disabled.
``GET /ledger`` (every effect, in commit order), ``GET /ledger/duplicates`` (keys with more
than one effect), ``DELETE /ledger`` (forget every effect and reset the stats).
``GET /health``, ``GET /_stats`` (counts by outcome).
``GET /_faults``, ``POST /_faults``, ``DELETE /_faults``, ``POST /_faults/keys/{key}``.

Faults, applied to ``POST .../releases`` only (see :data:`FAULT_MODES`):

* ``commit_then_timeout``: commit, then wait ``delay_s`` before answering, so the caller's
  timeout fires first; ``commit_then_reset``: commit, then reset the connection (SO_LINGER 0)
  without an answer; ``error_503`` and ``reject_422``: answer so and commit nothing; ``slow``:
  wait ``delay_s``, then behave normally. With a dedup window, "commit" means "decide as a
  normal request would": a repeated key is deduplicated, not committed again.
* The first source that names a fault wins: the request's ``X-Fault`` header, the payload's
  ``"_fault"`` field (so a replay of that payload faults again), the key's armed fault
  (``POST /_faults/keys/{key}`` ``{"mode": ..., "times": N}``: the next N requests with that key
  that no header or payload already faulted), then the rates (``POST /_faults``
  ``{"rates": {mode: probability}, "seed": 42, "delay_s": 5}``). Every create request draws one
  number from the seeded generator while rates are set, so one seed and one sequence of
  requests give one sequence of faults. ``DELETE /_faults`` removes every fault and restores the
  start-up delay.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import socket
import socketserver
import sqlite3
import struct
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType, TracebackType
from typing import Any, Literal, Self
from urllib.parse import unquote, urlsplit

FaultMode = Literal["commit_then_timeout", "commit_then_reset", "error_503", "reject_422", "slow"]

#: Every fault mode, in the order the rates are laid out on [0, 1) when one is drawn.
FAULT_MODES: tuple[FaultMode, ...] = (
    "commit_then_timeout",
    "commit_then_reset",
    "error_503",
    "reject_422",
    "slow",
)
_MODE_BY_NAME: dict[str, FaultMode] = {mode: mode for mode in FAULT_MODES}

DEFAULT_PORT = 8900
DEFAULT_FAULT_DELAY_S = 30.0
#: Bodies above this are refused (413); a release payload is a few hundred bytes.
MAX_BODY_BYTES = 1024 * 1024

Outcome = Literal["created", "deduplicated", "key_reused"]


class DeployServiceError(ValueError):
    """The deploy service cannot run with this configuration."""


def canonical(payload: Any) -> str:
    """``payload`` as canonical JSON text: sorted keys, no whitespace."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Effect:
    """One release the service committed: the remote's side of an action."""

    id: str
    target: str
    key: str
    payload: Any
    created_at: str

    def to_dict(self) -> dict[str, Any]:
        """The release as the service answers it."""
        return {
            "id": self.id,
            "target": self.target,
            "key": self.key,
            "payload": self.payload,
            "created_at": self.created_at,
        }


class LedgerClosed(RuntimeError):
    """The service was stopped; its ledger is closed."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS effects (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused, even after a clear
    target TEXT NOT NULL,
    key TEXT NOT NULL,
    payload TEXT NOT NULL,                  -- canonical JSON
    created_at REAL NOT NULL                -- seconds since the epoch, the service's clock
);
CREATE INDEX IF NOT EXISTS effects_by_key ON effects (key, seq);
"""
_COLUMNS = "seq, target, key, payload, created_at"
_Row = tuple[int, str, str, str, float]


class Ledger:
    """Every effect the service committed, in SQLite: in memory, or a file that outlives it.

    One connection behind one lock: the lock also makes check-then-insert atomic, so
    concurrent requests with one key cannot both create an effect when dedup is on.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._db = sqlite3.connect(
                ":memory:" if path is None else os.fspath(path),
                check_same_thread=False,
                isolation_level=None,  # autocommit: each statement is its own transaction
            )
            if path is not None:
                # WAL with synchronous=NORMAL survives a killed process, which is what a
                # restart test needs, at a fraction of the cost of an fsync per effect.
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise DeployServiceError(f"cannot open the ledger {path}: {exc}") from exc

    def record(
        self, target: str, key: str, payload: str, window_s: float | None
    ) -> tuple[Outcome, Effect]:
        """Commit a new effect, or with a window return the key's effect still inside it."""
        with self._lock:
            self._check_open()
            now = time.time()
            if window_s is not None:
                row: _Row | None = self._db.execute(
                    f"SELECT {_COLUMNS} FROM effects WHERE key = ? ORDER BY seq DESC LIMIT 1",  # noqa: S608 - constant columns
                    (key,),
                ).fetchone()
                if row is not None and now - row[4] < window_s:
                    same = row[1] == target and row[3] == payload
                    return ("deduplicated" if same else "key_reused"), _effect(row)
            cursor = self._db.execute(
                "INSERT INTO effects (target, key, payload, created_at) VALUES (?, ?, ?, ?)",
                (target, key, payload, now),
            )
            seq = cursor.lastrowid
        assert seq is not None  # noqa: S101 - sqlite sets it after an INSERT
        return "created", _effect((seq, target, key, payload, now))

    def first(self, target: str, key: str) -> Effect | None:
        """The first effect with this key for this target, if any."""
        with self._lock:
            self._check_open()
            row: _Row | None = self._db.execute(
                f"SELECT {_COLUMNS} FROM effects WHERE key = ? AND target = ? ORDER BY seq LIMIT 1",  # noqa: S608 - constant columns
                (key, target),
            ).fetchone()
        return None if row is None else _effect(row)

    def effects(self) -> list[Effect]:
        """Every effect, in commit order."""
        with self._lock:
            self._check_open()
            rows: list[_Row] = self._db.execute(
                f"SELECT {_COLUMNS} FROM effects ORDER BY seq"  # noqa: S608 - constant columns
            ).fetchall()
        return [_effect(row) for row in rows]

    def counts_by_key(self) -> dict[str, int]:
        """How many effects each key has, keys in order of their first effect."""
        with self._lock:
            self._check_open()
            rows: list[tuple[str, int]] = self._db.execute(
                "SELECT key, count(*) FROM effects GROUP BY key ORDER BY min(seq)"
            ).fetchall()
        return dict(rows)

    def clear(self) -> None:
        """Forget every effect (ids keep counting up)."""
        with self._lock:
            self._check_open()
            self._db.execute("DELETE FROM effects")

    def close(self) -> None:
        """Close the connection; later calls raise :class:`LedgerClosed`."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()

    def _check_open(self) -> None:
        if self._closed:
            raise LedgerClosed


def _effect(row: _Row) -> Effect:
    seq, target, key, payload, created_at = row
    stamp = datetime.fromtimestamp(created_at, UTC).isoformat(timespec="microseconds")
    return Effect(f"rel-{seq}", target, key, json.loads(payload), stamp)


def fault_mode(value: object, source: str) -> FaultMode:
    """``value`` as a fault mode, or :class:`DeployServiceError` naming ``source``."""
    mode = _MODE_BY_NAME.get(value) if isinstance(value, str) else None
    if mode is None:
        raise DeployServiceError(
            f"{source}: unknown fault mode {value!r} (one of: {', '.join(FAULT_MODES)})"
        )
    return mode


def check_rates(rates: Mapping[str, object]) -> dict[str, float]:
    """Validated fault rates: known modes, each in 0..1, adding up to at most 1."""
    checked: dict[str, float] = {}
    for name, rate in rates.items():
        mode = fault_mode(name, "fault rate")
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
            raise DeployServiceError(f"fault rate of {name}: {rate!r} is not a number in 0..1")
        checked[mode] = float(rate)
    total = sum(checked.values())
    if total > 1 + 1e-9:
        raise DeployServiceError(f"fault rates add up to {total:g}, more than 1")
    return checked


def parse_fault_rates(items: Iterable[str]) -> dict[str, float]:
    """Parse ``MODE=RATE`` strings (the command line's ``--fault-rate``) into checked rates."""
    rates: dict[str, object] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise DeployServiceError(f"--fault-rate {item!r}: expected MODE=RATE")
        mode = fault_mode(name.strip(), f"--fault-rate {item!r}")
        if mode in rates:
            raise DeployServiceError(f"--fault-rate: {mode} given twice")
        try:
            rate = float(text)
        except ValueError:
            rate = math.nan
        if not 0 <= rate <= 1:
            raise DeployServiceError(f"--fault-rate {item!r}: the rate must be a number in 0..1")
        rates[mode] = rate
    return check_rates(rates)


def _check_delay(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise DeployServiceError(f"{name} must be a number of seconds >= 0, got {value!r}")
    if not math.isfinite(value):
        raise DeployServiceError(f"{name} must be finite, got {value!r}")
    return float(value)


class Faults:
    """Which fault, if any, each create request gets: per request, per key, or by rate."""

    def __init__(self, rates: Mapping[str, object], seed: int | None, delay_s: float) -> None:
        self._lock = threading.Lock()
        self._start_delay_s = _check_delay(delay_s, "fault delay")
        self._rates = check_rates(rates)
        self._seed = seed
        self._rng = random.Random(seed)  # noqa: S311 - reproducible fault draws, not secrets
        self._delay_s = self._start_delay_s
        self._by_key: dict[str, tuple[FaultMode, int]] = {}

    @property
    def delay_s(self) -> float:
        """How long ``commit_then_timeout`` and ``slow`` wait."""
        return self._delay_s

    def configure(
        self,
        *,
        rates: Mapping[str, object] | None = None,
        seed: int | None = None,
        delay_s: float | None = None,
        reseed: bool = True,
    ) -> None:
        """Replace the rates (if given) and the delay (if given); reseed with ``seed``."""
        checked = None if rates is None else check_rates(rates)
        delay = None if delay_s is None else _check_delay(delay_s, "delay_s")
        with self._lock:
            if checked is not None:
                self._rates = checked
            if delay is not None:
                self._delay_s = delay
            if reseed:
                self._seed = seed
                self._rng = random.Random(seed)  # noqa: S311 - see __init__

    def arm_key(self, key: str, mode: FaultMode, times: int = 1) -> None:
        """Fault the next ``times`` requests with ``key`` (those no header or payload faults)."""
        if times < 1:
            raise DeployServiceError(f"times must be at least 1, got {times}")
        with self._lock:
            self._by_key[key] = (mode, times)

    def clear(self) -> None:
        """No faults at all; the delay returns to its start-up value."""
        with self._lock:
            self._rates = {}
            self._by_key.clear()
            self._delay_s = self._start_delay_s

    def choose(self, key: str, requested: FaultMode | None) -> FaultMode | None:
        """The fault for one create request (``requested``: named by its header or payload)."""
        with self._lock:
            drawn = self._draw()
            if requested is not None:
                return requested
            armed = self._by_key.get(key)
            if armed is not None:
                mode, left = armed
                if left > 1:
                    self._by_key[key] = (mode, left - 1)
                else:
                    del self._by_key[key]
                return mode
            return drawn

    def snapshot(self) -> dict[str, Any]:
        """The current configuration, as ``GET /_faults`` answers it."""
        with self._lock:
            return {
                "rates": dict(self._rates),
                "seed": self._seed,
                "delay_s": self._delay_s,
                "keys": {
                    key: {"mode": mode, "times": left} for key, (mode, left) in self._by_key.items()
                },
            }

    def _draw(self) -> FaultMode | None:
        if not self._rates:
            return None
        point, edge = self._rng.random(), 0.0
        for mode in FAULT_MODES:
            edge += self._rates.get(mode, 0.0)
            if point < edge:
                return mode
        return None


class Stats:
    """Request counts by outcome, for ``GET /_stats`` and benchmarks."""

    _REJECTED = ("missing_key", "bad_body", "key_reused")
    _LOOKUPS = ("found", "missing", "disabled")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str) -> None:
        """Count one ``name`` (``created``, ``rejected.bad_body``, ``faulted.slow``, ...)."""
        with self._lock:
            self._counts[name] += 1

    def clear(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self._counts.clear()

    def snapshot(self) -> dict[str, Any]:
        """Every count, zeros included."""
        with self._lock:
            counts = self._counts.copy()
        return {
            "requests": counts["requests"],
            "created": counts["created"],
            "deduplicated": counts["deduplicated"],
            "rejected": {name: counts[f"rejected.{name}"] for name in self._REJECTED},
            "faulted": {mode: counts[f"faulted.{mode}"] for mode in FAULT_MODES},
            "lookups": {name: counts[f"lookups.{name}"] for name in self._LOOKUPS},
        }


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
    server: _Server

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
            case ("POST", ("projects", str(target), "releases")) if target:
                return self._create(target, body)
            case ("GET", ("projects", str(target), "releases", "by-key", str(key))) if key:
                return self._lookup(target, key)
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

    def _create(self, target: str, body: bytes) -> _Reply:
        service = self.server.service
        key = self.headers.get(service.idempotency_header)
        if not key:
            service.stats.add("rejected.missing_key")
            raise _HttpError(400, f"missing {service.idempotency_header} header")
        service.note_arrival(key)
        with service.handling(key):
            return self._create_keyed(service, target, key, body)

    def _create_keyed(self, service: DeployService, target: str, key: str, body: bytes) -> _Reply:
        try:
            payload = _parse_json(body, "the body")
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
        outcome, effect = service._store().record(
            target, key, canonical(payload), service.dedup_window_s
        )
        service.stats.add("rejected.key_reused" if outcome == "key_reused" else outcome)
        if outcome == "key_reused":
            reply = _Reply(422, {"error": "key reused with another payload"})
        elif outcome == "deduplicated":
            reply = _Reply(200, effect.to_dict(), {"Idempotent-Replayed": "true"})
        else:
            reply = _Reply(201, effect.to_dict())
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

    def _lookup(self, target: str, key: str) -> _Reply:
        service = self.server.service
        if not service.lookup_enabled:
            service.stats.add("lookups.disabled")
            return _Reply(501, {"error": "lookup disabled"})
        effect = service._store().first(target, key)
        service.stats.add("lookups.missing" if effect is None else "lookups.found")
        if effect is None:
            return _Reply(404, {"error": "no release for key"})
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


def _duplicates(effects: Sequence[Effect]) -> dict[str, Any]:
    ids: dict[str, list[str]] = {}
    for effect in effects:
        ids.setdefault(effect.key, []).append(effect.id)
    repeated = [{"key": key, "count": len(i), "ids": i} for key, i in ids.items() if len(i) > 1]
    return {"duplicates": repeated, "count": len(repeated)}


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a request sleeping in a fault must not hold up the process's exit
    request_queue_size = 128  # bursts of concurrent clients in benchmarks
    allow_reuse_port = False  # "port in use" must be an error, not a second listener

    def __init__(self, address: tuple[str, int], service: DeployService) -> None:
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


class DeployService:
    """The reference remote service, run in a background thread of this process.

    ``with DeployService(dedup_window_s=60) as service: httpx.post(service.url + ...)``.
    ``fault_rates`` maps fault modes to probabilities; ``seed`` makes their draws reproducible;
    ``fault_delay_s`` is how long ``commit_then_timeout`` and ``slow`` wait. ``ledger_path``
    keeps the ledger in an SQLite file that a later service (or process) reopens.
    ``record_arrivals`` keeps the wall-clock time (``time.time()``) at which the first create
    request of each key arrived, for :meth:`arrivals` (benchmarks measure latency with it).
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        dedup_window_s: float | None = None,
        lookup_enabled: bool = True,
        ledger_path: str | os.PathLike[str] | None = None,
        idempotency_header: str = "Idempotency-Key",
        fault_rates: Mapping[str, float] | None = None,
        seed: int | None = None,
        fault_delay_s: float = DEFAULT_FAULT_DELAY_S,
        log_requests: bool = False,
        record_arrivals: bool = False,
    ) -> None:
        if not 0 <= port <= 65535:
            raise DeployServiceError(f"port must be in 0..65535, got {port}")
        if dedup_window_s is not None and not (0 < dedup_window_s < math.inf):
            raise DeployServiceError(
                f"dedup window must be a positive number of seconds, got {dedup_window_s}"
            )
        if not idempotency_header.strip() or any(c in idempotency_header for c in ":\r\n "):
            raise DeployServiceError(f"invalid idempotency header name {idempotency_header!r}")
        self.host = host
        self.requested_port = port
        self.dedup_window_s = dedup_window_s
        self.lookup_enabled = lookup_enabled
        self.ledger_path = ledger_path
        self.idempotency_header = idempotency_header
        self.log_requests = log_requests
        self.record_arrivals = record_arrivals
        self._arrivals: dict[str, float] = {}
        self.faults = Faults(fault_rates or {}, seed, fault_delay_s)
        self.stats = Stats()
        self.stopping = threading.Event()
        self._in_flight: Counter[str] = Counter()
        self._in_flight_lock = threading.Lock()
        self._ledger: Ledger | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port it listens on (the one the system chose when started with port 0)."""
        if self._server is None:
            raise RuntimeError("the deploy service is not running")
        return self._server.server_port

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://127.0.0.1:54321``."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> Self:
        """Open the ledger, listen, and serve from a background thread; returns self."""
        if self._server is not None or self.stopping.is_set():
            raise RuntimeError("a DeployService starts once; create another to restart")
        ledger = Ledger(self.ledger_path)
        try:
            server = _Server((self.host, self.requested_port), self)
        except OSError as exc:
            ledger.close()
            reason = exc.strerror or str(exc)
            raise DeployServiceError(
                f"cannot listen on {self.host}:{self.requested_port}: {reason}"
            ) from exc
        self._ledger, self._server = ledger, server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},  # stop() waits at most this long for the loop
            name=f"deploy-service-{server.server_port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, end open connections and waiting faults, close the ledger."""
        server = self._server
        if server is None:
            return
        self.stopping.set()
        server.shutdown()
        server.close_connections()
        server.server_close()
        if self._thread is not None:
            self._thread.join()
        if self._ledger is not None:
            self._ledger.close()
        self._server = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def ledger(self) -> list[Effect]:
        """Every effect committed so far, in order (while the service runs)."""
        return self._store().effects()

    def in_flight(self) -> list[str]:
        """Keys of the create requests being handled right now (a fault may be holding them)."""
        with self._in_flight_lock:
            return [key for key, count in self._in_flight.items() if count > 0]

    @contextmanager
    def handling(self, key: str) -> Iterator[None]:
        """Count a create request for ``key`` as in flight while the block runs."""
        with self._in_flight_lock:
            self._in_flight[key] += 1
        try:
            yield
        finally:
            with self._in_flight_lock:
                self._in_flight[key] -= 1
                if self._in_flight[key] <= 0:
                    del self._in_flight[key]

    def effects_by_key(self) -> dict[str, int]:
        """How many effects each idempotency key produced."""
        return self._store().counts_by_key()

    def contradicted(self, verdicts: Iterable[tuple[str, str, str | None]]) -> int:
        """How many of the outbox's verdicts ``(operation id, state, remote_ref)`` the ledger
        contradicts: `confirmed` naming an effect the ledger does not hold for that key, or
        `failed` for a key the ledger has an effect for."""
        by_key = self.effects_by_key()
        refs = {effect.key: effect.id for effect in self.ledger()}
        return sum(
            1
            for op_id, state, remote_ref in verdicts
            if (state == "confirmed" and refs.get(op_id) != remote_ref)
            or (state == "failed" and by_key.get(op_id, 0) > 0)
        )

    def note_arrival(self, key: str) -> None:
        """Remember when the first create request with ``key`` arrived (if recording)."""
        if self.record_arrivals:
            now = time.time()
            with self._in_flight_lock:
                self._arrivals.setdefault(key, now)

    def arrivals(self) -> dict[str, float]:
        """Key -> wall-clock time of its first create request (with ``record_arrivals``)."""
        with self._in_flight_lock:
            return dict(self._arrivals)

    def clear(self) -> None:
        """Forget every effect, arrival and the stats (fault settings stay)."""
        self._store().clear()
        self.stats.clear()
        with self._in_flight_lock:
            self._arrivals.clear()

    def describe(self) -> str:
        """One line: where it listens and how it behaves."""
        window = "off" if self.dedup_window_s is None else f"{self.dedup_window_s:g}s"
        faults = self.faults.snapshot()
        rates = ",".join(f"{mode}={rate:g}" for mode, rate in faults["rates"].items()) or "none"
        return (
            f"deploy service listening on {self.url} (dedup window: {window}, "
            f"lookup: {'on' if self.lookup_enabled else 'off'}, "
            f"ledger: {self.ledger_path or 'memory'}, fault rates: {rates})"
        )

    def _store(self) -> Ledger:
        if self._ledger is None:
            raise RuntimeError("the deploy service is not running")
        return self._ledger


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def serve(service: DeployService, announce: Callable[[str], None]) -> None:
    """Run ``service`` in the foreground until SIGTERM or SIGINT, then stop it cleanly.

    ``announce`` receives the one-line description once the service listens. Raises
    :class:`DeployServiceError` when it cannot start.
    """
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        service.start()
        announce(service.describe())
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()
        signal.signal(signal.SIGTERM, previous)


def _announce(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m outbox.testing.deploy_service",
        description="Run the reference remote service (releases keyed by an idempotency key).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    parser.add_argument("--dedup-window", type=float, metavar="SECONDS", help="default: no dedup")
    parser.add_argument("--no-lookup", action="store_true", help="answer 501 to lookups")
    parser.add_argument("--ledger", metavar="FILE", help="SQLite file (default: in memory)")
    parser.add_argument("--idempotency-header", default="Idempotency-Key", metavar="NAME")
    parser.add_argument(
        "--fault-rate", action="append", default=[], metavar="MODE=RATE", help="repeatable"
    )
    parser.add_argument("--seed", type=int, help="seed of the fault draws")
    parser.add_argument(
        "--fault-delay", type=float, default=DEFAULT_FAULT_DELAY_S, metavar="SECONDS"
    )
    parser.add_argument("--log-requests", action="store_true", help="one line per request")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m outbox.testing.deploy_service``: run it in the foreground; the exit code."""
    args = _parser().parse_args(argv)
    try:
        service = DeployService(
            host=args.host,
            port=args.port,
            dedup_window_s=args.dedup_window,
            lookup_enabled=not args.no_lookup,
            ledger_path=args.ledger,
            idempotency_header=args.idempotency_header,
            fault_rates=parse_fault_rates(args.fault_rate),
            seed=args.seed,
            fault_delay_s=args.fault_delay,
            log_requests=args.log_requests,
        )
        serve(service, _announce)
    except DeployServiceError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
