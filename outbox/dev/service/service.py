"""The reference service as one object: :class:`DeployService`, and :func:`serve`."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Self

from outbox.dev.service.errors import DeployServiceError
from outbox.dev.service.faults import Faults
from outbox.dev.service.http import Server
from outbox.dev.service.ledger import Effect, Ledger
from outbox.dev.service.stats import Stats

DEFAULT_PORT = 8900


@dataclass(frozen=True)
class RequestSpan:
    """One create request as the service saw it: key, target, wall-clock start and end."""

    key: str
    target: str
    started: float
    ended: float


DEFAULT_FAULT_DELAY_S = 30.0


class DeployService:
    """The reference remote service, run in a background thread of this process.

    ``with DeployService(dedup_window_s=60) as service: httpx.post(service.url + ...)``.
    ``fault_rates`` maps fault modes to probabilities; ``seed`` makes their draws reproducible;
    ``fault_delay_s`` is how long ``commit_then_timeout`` and ``slow`` wait. ``ledger_path``
    keeps the ledger in an SQLite file that a later service (or process) reopens.
    ``record_arrivals`` keeps the wall-clock time (``time.time()``) at which the first create
    request of each key arrived, for :meth:`arrivals` (benchmarks measure latency with it).
    ``record_requests`` keeps every create request's key, target and wall-clock span, for
    :meth:`requests` (tests measure concurrency and rate per target with it).
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
        record_requests: bool = False,
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
        self.record_requests = record_requests
        self._requests: list[RequestSpan] = []
        self._arrivals: dict[str, float] = {}
        self.faults = Faults(fault_rates or {}, seed, fault_delay_s)
        self.stats = Stats()
        self.stopping = threading.Event()
        self._in_flight: Counter[str] = Counter()
        self._in_flight_lock = threading.Lock()
        self._ledger: Ledger | None = None
        self._server: Server | None = None
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
            server = Server((self.host, self.requested_port), self)
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
        return self.store().effects()

    def in_flight(self) -> list[str]:
        """Keys of the create requests being handled right now (a fault may be holding them)."""
        with self._in_flight_lock:
            return [key for key, count in self._in_flight.items() if count > 0]

    @contextmanager
    def handling(self, key: str, target: str = "") -> Iterator[None]:
        """Count a create request for ``key`` as in flight while the block runs (and log its
        span, with ``record_requests``)."""
        started = time.time()
        with self._in_flight_lock:
            self._in_flight[key] += 1
        try:
            yield
        finally:
            with self._in_flight_lock:
                self._in_flight[key] -= 1
                if self._in_flight[key] <= 0:
                    del self._in_flight[key]
                if self.record_requests:
                    self._requests.append(RequestSpan(key, target, started, time.time()))

    def requests(self) -> list[RequestSpan]:
        """Every create request handled so far (with ``record_requests``), in end order."""
        with self._in_flight_lock:
            return list(self._requests)

    def effects_by_key(self) -> dict[str, int]:
        """How many effects each idempotency key produced."""
        return self.store().counts_by_key()

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
        self.store().clear()
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

    def store(self) -> Ledger:
        """The open ledger (while the service runs); the HTTP handlers record into it."""
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
    # SIGINT too, explicitly: a process started with SIGINT ignored (a shell's background job,
    # a parent that ignored it when it forked) keeps it ignored, and Ctrl-C would never stop it.
    previous = {
        signum: signal.signal(signum, _interrupt) for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        service.start()
        announce(service.describe())
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        service.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
