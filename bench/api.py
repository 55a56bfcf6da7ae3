"""The HTTP API's enqueue (``POST /v1/operations`` on ``outbox api``) against a direct
``enqueue()`` + COMMIT, on the same machine and database.

For each number of concurrent clients (``--clients``, default 1 and 8), one round measures:

* **direct**: that many threads, each with its own connection, each ``enqueue()`` in a
  ``Session`` then COMMIT, one after another;
* **API**: that many threads, each with one keep-alive HTTP connection (the stdlib's
  ``http.client``: a light client, so the client's CPU, on the same cores, weighs little), each
  POSTing an intent with a fresh ``Idempotency-Key`` and an agent token, one after another, to
  ``outbox api`` (a subprocess: its own interpreter and GIL), once per ``--workers`` count
  (``outbox api --workers N``: N processes on one socket; each count its own server, all
  started before the rounds, so the cases alternate within each round).

Rates (operations per second), p50 and p99 latency of one call, and the ratio API / direct
per round (target: at least 0.5x). Everything shares this machine's cores: PostgreSQL, the
server and the clients.

``--mode signin`` (or ``both``) measures instead what a burst of console sign-ins does to an
agent: one agent client enqueues one after another for ``--signin-seconds``, once with the
server quiet and once while ``--signin-burst`` threads (default 40) each POST /signin again
and again, every attempt with a cookie and CSRF token of its own (GET /signin), an unknown
name, a 1 KiB password and a fresh client address (127.x.y.z: the per-address throttle never
stops them, as it would not stop a burst from many hosts); after a refusal (429, 503) a
client waits its Retry-After, unless ``--signin-flood``. Rows: the agent's enqueue p50/p99
quiet and during the burst, their ratio (target: p99 within 2x of quiet), the sign-ins
answered and the passwords checked (401) per second, how many were refused as busy (503)
and how many got another 5xx or no answer.

Usage: python bench/api.py [--url postgresql://...] [--rounds 3] [--ops 2000]
[--clients 1,8] [--workers 1,2] [--mode enqueue|signin|both] [--signin-burst 40]
[--signin-seconds 10] [--quick] [--smoke]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# The bench directory is not a package: `python bench/api.py` puts it on sys.path.
from arguments import add_common_arguments
from cpu import CpuMeter, pids_named
from report import Results, print_table, say, write_json
from rounds import Case, percentile, run_rounds
from sqlalchemy import Engine
from sqlalchemy.orm import Session
from throwaway import server_settings, throwaway_database

from outbox import api, tokens
from outbox.approval import publish_policies_committed
from outbox.contracts import ToolContract
from outbox.db import create_engine
from outbox.models import TokenScope

Rate = Mapping[str, tuple[float, str]]
TOOL = "deploy.create_release"
_SERVING = re.compile(r"serving the API on http://([^:/]+):(\d+)")


@dataclass(frozen=True)
class Server:
    """A running ``outbox api``: where it listens, and its (parent) process."""

    address: tuple[str, int]
    pid: int


@contextlib.contextmanager
def api_server(db_url: str, home: Path, workers: int = 1) -> Iterator[Server]:
    """``outbox api --workers N`` on an ephemeral port of 127.0.0.1 (logs at WARNING)."""
    # The API's own settings may be tried from the bench's environment
    # (OUTBOX_CONSOLE_HASH_RATE=0.5 python bench/api.py --mode signin); nothing else of OUTBOX_*.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OUTBOX_") or k.startswith(("OUTBOX_CONSOLE_", "OUTBOX_API_"))
    }
    env |= {"OUTBOX_DATABASE_URL": db_url, "OUTBOX_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "outbox", "api", "--port", "0", "--log-level", "warning"]
    process = subprocess.Popen(  # noqa: S603 -- our own CLI, every argument from this script
        [*command, "--workers", str(workers)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None  # noqa: S101 -- Popen(stdout=PIPE)
        found = _SERVING.search(process.stdout.readline())
        if found is None:
            raise RuntimeError("outbox api did not start")
        address = found.group(1), int(found.group(2))
        _wait_healthy(*address)
        yield Server(address=address, pid=process.pid)
    finally:
        process.terminate()
        process.wait(timeout=15)


def _wait_healthy(host: str, port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            conn = http.client.HTTPConnection(host, port, timeout=2)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                conn.close()
                return
        time.sleep(0.1)
    raise RuntimeError("outbox api did not answer /healthz")


#: The one operation every bench enqueue sends (each under a fresh key).
_ENQUEUE_BODY = json.dumps({"tool": TOOL, "target": "project-a", "payload": {"version": "1.2.3"}})


def _enqueue_over_http(conn: http.client.HTTPConnection, body: str, token: str) -> None:
    """One ``POST /v1/operations`` with a fresh key on ``conn``; a non-201 ends the bench."""
    conn.request(
        "POST",
        "/v1/operations",
        body=body,
        headers={
            "Authorization": f"Bearer {token}",
            "Idempotency-Key": str(uuid.uuid4()),
            "Content-Type": "application/json",
        },
    )
    answer = conn.getresponse()
    answer.read()
    if answer.status != 201:
        raise RuntimeError(f"POST /v1/operations answered {answer.status}")


def _in_threads(clients: int, ops: int, make_worker: Callable[[], Callable[[], None]]) -> Rate:
    """Run ``ops`` calls split over ``clients`` threads (each its own ``make_worker()``):
    the rate over the whole run, and p50/p99 of one call."""
    per_thread = max(1, ops // clients)
    latencies: list[list[float]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients + 1)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            call = make_worker()
            start.wait()
            mine = latencies[index]
            for _ in range(per_thread):
                began = time.perf_counter()
                call()
                mine.append(time.perf_counter() - began)
        except BaseException as exc:  # noqa: BLE001 -- reported after the join
            errors.append(exc)
            with contextlib.suppress(threading.BrokenBarrierError):
                start.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise RuntimeError(f"a client failed: {errors[0]!r}") from errors[0]
    every = [value for one in latencies for value in one]
    return {
        "rate": (len(every) / elapsed, "ops/s"),
        "p50": (percentile(every, 50) * 1000, "ms"),
        "p99": (percentile(every, 99) * 1000, "ms"),
    }


class ApiBench:
    """The two ways to enqueue, on one throw-away database."""

    def __init__(self, engine: Engine, servers: Mapping[int, Server], token: str, ops: int) -> None:
        self.engine = engine
        #: ``outbox api`` by its number of worker processes.
        self.servers = servers
        self.token = token
        self.ops = ops

    def direct(self, clients: int) -> Rate:
        """``enqueue()`` in a Session + COMMIT, one after another, per thread."""

        def worker() -> Callable[[], None]:
            def call() -> None:
                with Session(self.engine) as session, session.begin():
                    api.enqueue(
                        session,
                        tool=TOOL,
                        target="project-a",
                        payload={"version": "1.2.3"},
                        intent_key=str(uuid.uuid4()),
                        requested_by="bench",
                    )

            return call

        return _in_threads(clients, self.ops, worker)

    def http(self, clients: int, workers: int) -> Rate:
        """POST /v1/operations on one keep-alive connection per thread, to the server with
        ``workers`` processes."""
        address = self.servers[workers].address
        body = _ENQUEUE_BODY

        def worker() -> Callable[[], None]:
            conn = http.client.HTTPConnection(*address, timeout=30)

            def call() -> None:
                _enqueue_over_http(conn, body, self.token)

            return call

        return _in_threads(clients, self.ops, worker)


_CSRF = re.compile(r'name="csrf" value="([^"]+)"')
#: The red team's sign-in: an unknown name and a 1 KiB password.
BURST_PASSWORD = "x" * 1024


class SigninBurst:
    """``threads`` clients signing in again and again with unknown names, each attempt from a
    fresh 127.x.y.z address, until stopped (after a refusal, each waits what its Retry-After
    says, unless ``flood``); what the server answered, by status."""

    def __init__(self, address: tuple[str, int], threads: int, *, flood: bool = False) -> None:
        self.address = address
        self.threads = threads
        #: Retry at once after a refusal (429, 503) instead of waiting its Retry-After.
        self.flood = flood
        self.answers: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._next = 0
        self._running: list[threading.Thread] = []

    def _source(self) -> str:
        with self._lock:
            self._next += 1
            n = self._next
        return f"127.{1 + (n >> 16) % 254}.{(n >> 8) & 255}.{n & 255 or 1}"

    def _attempt(self) -> tuple[str, float]:
        conn = http.client.HTTPConnection(
            *self.address, timeout=120, source_address=(self._source(), 0)
        )
        try:
            conn.request("GET", "/signin")
            form = conn.getresponse()
            page = form.read().decode()
            cookie = (form.getheader("set-cookie") or "").split(";", 1)[0]
            token = _CSRF.search(page)
            if form.status != 200 or token is None:
                return f"GET {form.status}", 0.0
            body = urllib.parse.urlencode(
                {"name": f"nobody-{uuid.uuid4().hex}", "password": BURST_PASSWORD, "csrf": token[1]}
            )
            conn.request(
                "POST",
                "/signin",
                body=body,
                headers={"Cookie": cookie, "Content-Type": "application/x-www-form-urlencoded"},
            )
            answer = conn.getresponse()
            answer.read()
            wait = answer.getheader("retry-after") if answer.status in (429, 503) else None
            return str(answer.status), float(wait or 0)
        except (OSError, http.client.HTTPException) as exc:
            return type(exc).__name__, 0.0
        finally:
            conn.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            found, wait = self._attempt()
            with self._lock:
                self.answers[found] += 1
            if wait and not self.flood:
                self._stop.wait(wait)  # a refusal's Retry-After, as a client honours it

    def __enter__(self) -> SigninBurst:
        self._running = [threading.Thread(target=self._run) for _ in range(self.threads)]
        for thread in self._running:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._running:
            thread.join()


def _enqueue_for(address: tuple[str, int], token: str, seconds: float) -> list[float]:
    """One agent enqueueing one after another for ``seconds``: each call's latency."""
    body = _ENQUEUE_BODY
    conn = http.client.HTTPConnection(*address, timeout=120)
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            began = time.perf_counter()
            _enqueue_over_http(conn, body, token)
            latencies.append(time.perf_counter() - began)
    finally:
        conn.close()
    return latencies


def _signin_cases(
    server: Server, token: str, burst: int, seconds: float, *, flood: bool
) -> list[Case]:
    """The agent's enqueue quiet, then during a sign-in burst of ``burst`` threads."""

    def latencies(kind: str, found: list[float]) -> dict[str, tuple[float, str]]:
        return {
            f"enqueue p50, {kind}": (percentile(found, 50) * 1000, "ms"),
            f"enqueue p99, {kind}": (percentile(found, 99) * 1000, "ms"),
            f"enqueues, {kind}": (float(len(found)), "ops"),
        }

    def quiet() -> Rate:
        return latencies("quiet", _enqueue_for(server.address, token, seconds))

    def during() -> Rate:
        with SigninBurst(server.address, burst, flood=flood) as running:
            time.sleep(min(2.0, seconds / 5))  # the burst under way before the agent starts
            began = time.perf_counter()
            found = _enqueue_for(server.address, token, seconds)
            elapsed = time.perf_counter() - began
        answered = running.answers
        say(f"sign-in answers during the burst: {dict(sorted(answered.items()))}")
        failed = sum(
            n
            for status, n in answered.items()
            if not status.isdigit() or (int(status) >= 500 and status != "503")
        )
        return latencies("burst", found) | {
            "sign-ins answered/s, burst": (sum(answered.values()) / elapsed, "/s"),
            "passwords checked (401)/s, burst": (answered["401"] / elapsed, "/s"),
            "sign-ins refused busy (503), burst": (float(answered["503"]), "n"),
            "sign-ins 500 or unanswered, burst": (float(failed), "n"),
        }

    section = f"sign-in burst of {burst}"
    return [
        Case("enqueue, quiet", quiet, section=section),
        Case(f"enqueue, {burst} signing in", during, section=section),
    ]


def _cases(bench: ApiBench, clients: Sequence[int], cpu_of: str | None) -> list[Case]:
    """Per client count: direct, then the API per server; with ``cpu_of`` (the database's
    name) each case also measures who spent the CPU."""
    cases = []
    for n in clients:
        section = f"{n} client{'s' if n > 1 else ''}"
        meter = _meter(cpu_of, None)
        run = _named("direct", bench.direct, n, meter)
        cases.append(Case(f"direct x{n}", run, section=section))
        for workers, server in bench.servers.items():
            kind = _api_kind(workers, bench.servers)
            serve = functools.partial(bench.http, workers=workers)
            meter = _meter(cpu_of, server.pid)
            cases.append(Case(f"{kind} x{n}", _named(kind, serve, n, meter), section=section))
    return cases


def _meter(database: str | None, api_pid: int | None) -> CpuMeter | None:
    """CPU of the API's processes, of the database's backends serving ``database`` and of
    this process (the clients), or None without ``--cpu``."""
    if database is None:
        return None
    groups: dict[str, Callable[[], Iterable[int]]] = {
        "postgres": lambda: _backends(database),
        "clients": lambda: [os.getpid()],
    }
    if api_pid is not None:
        groups["api"] = lambda: _descendants(api_pid)
    return CpuMeter(groups)


def _backends(database: str) -> list[int]:
    """PostgreSQL backends connected to ``database`` (their process title names it)."""
    found = []
    for pid in pids_named("postgres"):
        with contextlib.suppress(OSError):
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if f" {database} " in title:
                found.append(pid)
    return found


def _descendants(root: int) -> list[int]:
    """``root`` and every process under it (the API's parent, workers and helpers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _api_kind(workers: int, every: Iterable[int]) -> str:
    """``API`` with one server (the names earlier runs used), else ``API wN`` per server."""
    return "API" if list(every) == [1] else f"API w{workers}"


def _named(
    kind: str, run: Callable[[int], Rate], clients: int, meter: CpuMeter | None
) -> Callable[[], Rate]:
    def measured() -> Rate:
        if meter is not None:
            meter.start()
        rate = run(clients)
        named = {f"{kind} {name}, {clients}": value for name, value in rate.items()}
        if meter is not None:
            per_s = rate["rate"][0]
            for group, percent in meter.stop().items():
                if group.startswith("machine busy"):
                    named[f"{kind} {group}, {clients}"] = (percent, "% core")
                else:  # CPU per enqueue: % of a core / enqueues per second
                    named[f"{kind} CPU {group}, {clients}"] = (10 * percent / per_s, "ms/op")
        return named

    return measured


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--ops", type=int, default=2000, help="enqueues per case and round")
    parser.add_argument("--clients", default="1,8", help="comma-separated client counts")
    parser.add_argument(
        "--workers", default="1", help="comma-separated `outbox api --workers` counts"
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="also the CPU per enqueue of the API, PostgreSQL's backends and the clients",
    )
    parser.add_argument(
        "--mode",
        choices=("enqueue", "signin", "both"),
        default="enqueue",
        help="enqueue: API against direct; signin: an agent's enqueue quiet and during a "
        "burst of console sign-ins; both",
    )
    parser.add_argument(
        "--signin-burst", type=int, default=40, help="concurrent sign-in clients (--mode signin)"
    )
    parser.add_argument(
        "--signin-seconds",
        type=float,
        default=10.0,
        help="how long the agent enqueues, quiet and during the burst (--mode signin)",
    )
    parser.add_argument(
        "--signin-flood",
        action="store_true",
        help="the sign-in clients retry at once after a refusal (a request flood) instead of "
        "waiting its Retry-After",
    )
    parser.add_argument("--quick", action="store_true", help="one round of 500 per case")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.ops = 1, 500
    if args.smoke:
        args.rounds, args.ops, args.signin_seconds, args.signin_burst = 1, 40, 1.0, 4
    clients = [int(n) for n in args.clients.split(",") if n.strip()]
    workers = [int(n) for n in args.workers.split(",") if n.strip()]
    results = Results(
        f"api: {args.rounds} rounds, {args.ops} enqueues per case, clients {args.clients}, "
        f"workers {args.workers}"
    )
    with contextlib.ExitStack() as stack:
        db_url = stack.enter_context(throwaway_database(args.url))
        engine = create_engine(db_url, pool_size=max(clients) + 2)
        stack.callback(engine.dispose)
        publish_policies_committed(engine, [ToolContract(name=TOOL)])
        with Session(engine) as session, session.begin():
            token = tokens.create_token(session, name="bench", scope=TokenScope.AGENT).token
        home = Path(stack.enter_context(_temporary_home()))
        servers = {}
        for count in workers:
            server = stack.enter_context(api_server(db_url, home, count))
            say(f"outbox api --workers {count} on {server.address[0]}:{server.address[1]}")
            servers[count] = server
        bench = ApiBench(engine, servers, token, args.ops)
        database = engine.url.database if args.cpu else None
        cases = _cases(bench, clients, database) if args.mode != "signin" else []
        if args.mode != "enqueue":
            first = servers[workers[0]]
            cases += _signin_cases(
                first, token, args.signin_burst, args.signin_seconds, flood=args.signin_flood
            )
        run_rounds(args.rounds, cases, results)
    kinds = [_api_kind(count, workers) for count in workers] if args.mode != "signin" else []
    for kind in kinds:
        for n in clients:
            results.ratio(f"{kind} / direct, {n}", f"{kind} rate, {n}", f"direct rate, {n}")
    for kind in kinds:
        for n in clients:
            results.target(
                f"{kind} >= 0.5x direct enqueue ({n})", f"{kind} / direct, {n}", at_least=0.5
            )
    if args.mode != "enqueue":
        results.ratio("enqueue p99 burst / quiet", "enqueue p99, burst", "enqueue p99, quiet")
        results.target(
            f"enqueue p99 during {args.signin_burst} sign-ins <= 2x quiet",
            "enqueue p99 burst / quiet",
            at_most=2.0,
        )
    results.note(
        "Medians over rounds; ratios are computed within each round, then their median. "
        "PostgreSQL, the API's processes and the clients share this machine's cores."
    )
    results.note(server_settings(args.url))
    print_table(results)
    write_json(args.json, [results], vars(args))
    return 0


@contextlib.contextmanager
def _temporary_home() -> Iterator[str]:
    import tempfile  # noqa: PLC0415 -- only here

    with tempfile.TemporaryDirectory(prefix="bench-api-") as home:
        yield home


if __name__ == "__main__":
    sys.exit(main())
