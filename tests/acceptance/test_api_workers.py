"""`outbox api --workers 2` as a real process tree on a real PostgreSQL: both workers serve,
`/metrics` counts every worker's requests, the sign-in throttle and console sessions are
shared, a killed worker is started again, and SIGTERM stops them all.

Which worker answered is read from the operating system: the worker process holding the
server side of the client's TCP connection (each client below keeps one connection).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import psutil
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import operators, tokens
from outbox.approval import publish_policies_committed
from outbox.contracts import ToolContract
from outbox.models import TokenScope
from tests.acceptance.conftest import run_outbox
from tests.api_server import ApiServer, api_environment, running_api
from tests.processes import wait_until

pytestmark = pytest.mark.slow

TOOL = "deploy.create_release"
PASSWORD = "correct horse battery"  # noqa: S105 -- the test account's
_CSRF = re.compile(r'name="csrf" value="([^"]+)"')
_CREATED = re.compile(
    r'^outbox_api_requests_total\{method="POST",route="/v1/operations",status="201"\} (\S+)$',
    re.MULTILINE,
)


@pytest.fixture(scope="module")
def server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """One `outbox api --workers 2` for the module, without OUTBOX_CONSOLE_SECRET (the
    parent makes the workers' one key)."""
    home = tmp_path_factory.mktemp("api-workers")
    env = api_environment(database_url, home)
    with running_api(env, home / "api.log", "--workers", "2") as running:
        yield running


def worker_pids(server: ApiServer) -> set[int]:
    """The pids of the parent's living worker processes (not multiprocessing's resource
    tracker, nor a killed worker not yet reaped)."""
    found = set()
    for child in psutil.Process(server.process.pid).children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.Error:  # a zombie, or gone meanwhile
            continue
    return found


def served_by(server: ApiServer, response: httpx.Response) -> int:
    """The pid of the worker holding the server side of the connection ``response`` came on."""
    port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
    for pid in worker_pids(server):
        for conn in psutil.Process(pid).net_connections(kind="tcp"):
            if conn.raddr and conn.raddr.port == port:
                return pid
    raise AssertionError(f"no worker holds the connection from port {port}")


@pytest.fixture
def pinned(server: ApiServer) -> Iterator[dict[int, httpx.Client]]:
    """One client per worker, each on one keep-alive connection that worker accepted."""
    found: dict[int, httpx.Client] = {}
    with ExitStack() as stack:

        def connect_once_more() -> bool:
            # Until both workers have accepted one: on a loaded machine the second may start
            # seconds after the first, which takes every connection meanwhile.
            client = stack.enter_context(
                httpx.Client(
                    base_url=server.url, timeout=30, limits=httpx.Limits(max_connections=1)
                )
            )
            found.setdefault(served_by(server, client.get("/healthz")), client)
            return len(found) == 2

        wait_until(connect_once_more, timeout=90, interval=0.05, what="both workers serving")
        yield found


def enqueue(client: httpx.Client, token: str, key: str) -> httpx.Response:
    """POST one intent."""
    return client.post(
        "/v1/operations",
        json={"tool": TOOL, "target": "project-a", "payload": {"version": key}},
        headers={"Authorization": f"Bearer {token}", "Idempotency-Key": key},
    )


def created_total(client: httpx.Client) -> float:
    """`outbox_api_requests_total` of the 201 answers to POST /v1/operations, from /metrics."""
    found = _CREATED.search(client.get("/metrics").text)
    return float(found.group(1)) if found else 0.0


def test_both_workers_serve_and_metrics_count_every_request(
    server: ApiServer, pinned: dict[int, httpx.Client], engine: Engine
) -> None:
    """Enqueues answered by each of the two workers are all counted on /metrics, whichever
    worker answers the scrape."""
    publish_policies_committed(engine, [ToolContract(name=TOOL)])
    with Session(engine) as session, session.begin():
        token = tokens.create_token(session, name="agent-w", scope=TokenScope.AGENT).token
    first, second = pinned.values()
    before = created_total(first)
    for n in range(3):
        for pid, client in pinned.items():
            answer = enqueue(client, token, f"{pid}-{n}")
            assert answer.status_code == 201, answer.text
            assert served_by(server, answer) == pid
    assert set(pinned) == worker_pids(server)
    assert created_total(first) == before + 6
    assert created_total(second) == before + 6


def _sign_in(client: httpx.Client, name: str, password: str) -> httpx.Response:
    form = client.get("/signin")
    token = _CSRF.search(form.text)
    assert token is not None
    return client.post("/signin", data={"name": name, "password": password, "csrf": token.group(1)})


def test_failed_sign_ins_on_both_workers_share_one_throttle(
    server: ApiServer, pinned: dict[int, httpx.Client], engine: Engine
) -> None:
    """Five wrong passwords spread over both workers lock the name on both."""
    with Session(engine) as session, session.begin():
        operators.add_operator(session, name="carol", password=PASSWORD)
    clients = list(pinned.items())
    for n in range(5):
        pid, client = clients[n % 2]
        failed = _sign_in(client, "carol", "not the password")
        assert failed.status_code == 401
        assert served_by(server, failed) == pid
    for pid, client in clients:
        refused = _sign_in(client, "carol", PASSWORD)
        assert refused.status_code == 429
        assert "Too many failed sign-ins" in refused.text
        assert served_by(server, refused) == pid


def test_a_session_from_one_worker_is_good_on_the_other(
    server: ApiServer, pinned: dict[int, httpx.Client], engine: Engine
) -> None:
    """A console session cookie signed by one worker is accepted by the other."""
    with Session(engine) as session, session.begin():
        operators.add_operator(session, name="alice", password=PASSWORD)
    (first_pid, first), (second_pid, second) = pinned.items()
    signed_in = _sign_in(first, "alice", PASSWORD)
    assert signed_in.status_code == 303
    assert served_by(server, signed_in) == first_pid
    second.cookies = first.cookies
    overview = second.get("/")
    assert overview.status_code == 200
    assert "Overview" in overview.text
    assert served_by(server, overview) == second_pid


def test_a_killed_worker_is_started_again_and_sigterm_stops_them_all(
    database_url: str, engine: Engine, tmp_path: Path
) -> None:
    """A SIGKILLed worker is replaced and the API still answers; SIGTERM to the parent stops
    every worker, removes the metrics directory and exits 0."""
    env = api_environment(database_url, tmp_path)
    with running_api(env, tmp_path / "api.log", "--workers", "2") as server:
        # The API answers once one worker does; the other may still be starting.
        wait_until(lambda: len(worker_pids(server)) == 2, timeout=30, what="both workers")
        first = worker_pids(server)
        metrics_dir = Path(psutil.Process(min(first)).environ()["PROMETHEUS_MULTIPROC_DIR"])
        assert metrics_dir.is_dir()
        killed = min(first)
        psutil.Process(killed).send_signal(signal.SIGKILL)
        wait_until(
            lambda: len(worker_pids(server) - {killed}) == 2,
            timeout=30,
            what="a new worker in place of the killed one",
        )
        assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
        workers = [psutil.Process(pid) for pid in worker_pids(server)]
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0
        _gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive
        assert not metrics_dir.exists()
        assert "API stopped" in server.logs()


def test_a_worker_that_cannot_start_stops_the_api(database_url: str, tmp_path: Path) -> None:
    """A worker failing at start-up ends `outbox api` with exit 1 and one line saying why,
    instead of being started again and again."""
    (tmp_path / "worker_refusing_tools.py").write_text(
        "import multiprocessing\n"
        "if multiprocessing.parent_process() is not None:\n"
        "    raise RuntimeError('these tools refuse to load in a worker')\n"
    )
    env = api_environment(
        database_url,
        tmp_path,
        PYTHONPATH=str(tmp_path),
        OUTBOX_TOOLS="worker_refusing_tools",
    )
    done = run_outbox("api", "--port", "0", "--workers", "2", env=env, timeout=60)
    assert done.code == 1, done.stderr
    assert "these tools refuse to load in a worker" in done.stderr
    assert "action=api_worker_failed" in done.stderr
    assert "error: an API worker could not start" in done.stderr
