"""`outbox up`: every process on one host, supervised, a status panel, a clean Ctrl-C."""

from __future__ import annotations

import asyncio
import os
import pty
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api, tokens
from outbox.dev.service import DeployService
from outbox.models import TokenScope
from tests.acceptance.conftest import REPO
from tests.processes import wait_until
from tests.tool_configs import TOOL

pytestmark = pytest.mark.slow


class Up:
    """``outbox up`` as a child process whose output is collected as it comes."""

    def __init__(self, env: dict[str, str], *args: str, tty: bool = False) -> None:
        self.chunks: list[str] = []
        self._master: int | None = None
        argv = [sys.executable, "-m", "outbox", "up", *args]
        if tty:
            master, replica = pty.openpty()
            self.process = subprocess.Popen(
                argv,
                env={**env, "COLUMNS": "140"},
                cwd=REPO,
                stdin=replica,
                stdout=replica,
                stderr=replica,
            )
            os.close(replica)
            self._master = master
            self._reader = threading.Thread(target=self._read_pty, args=(master,), daemon=True)
        else:
            self.process = subprocess.Popen(
                argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            self._reader = threading.Thread(target=self._read_pipe, daemon=True)
        self._reader.start()

    def _read_pty(self, master: int) -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                return
            if not data:
                return
            self.chunks.append(data.decode(errors="replace"))

    def _read_pipe(self) -> None:
        assert self.process.stdout is not None
        for line in iter(self.process.stdout.readline, b""):
            self.chunks.append(line.decode(errors="replace"))

    @property
    def output(self) -> str:
        return "".join(self.chunks)

    def interrupt(self, timeout: float = 60) -> int:
        """Ctrl-C, as a person at the terminal would; the exit code."""
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self._reader.join(10)
        if self._master is not None:
            os.close(self._master)
            self._master = None
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture
def up_env(stack_env: dict[str, str]) -> dict[str, str]:
    """The stack's environment; `outbox up` starts every process itself."""
    return {**stack_env, "OUTBOX_SWEEP_INTERVAL": "1"}


def _free_port() -> int:
    """A port nothing listens on now (the API binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def running_up(up_env: dict[str, str]) -> Iterator[Up]:
    up = Up(
        up_env,
        "--no-panel",
        "--metrics-port",
        "0",
        "--workers",
        "1",
        "--api",
        "--api-port",
        str(_free_port()),
    )
    yield up
    up.kill()


def _enqueue(engine: Engine, prefix: str, count: int) -> None:
    with Session(engine) as session, session.begin():
        for i in range(count):
            api.enqueue(
                session, tool=TOOL, target="web", payload={"n": i}, intent_key=f"{prefix}-{i}"
            )


def _confirmed(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM outbox.operations WHERE state = 'confirmed'")
            ).scalar_one()
        )


def _pid(output: str, name: str) -> int:
    found = re.findall(rf"{name} (?:\(pid |restarted \(pid )(\d+)\)", output)
    assert found, output
    return int(found[-1])


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_up_runs_supervises_and_stops_cleanly(
    engine: Engine, service: DeployService, running_up: Up
) -> None:
    """Operations go through; a SIGKILLed worker is restarted; metrics, the API and the
    console's sign-in page answer; Ctrl-C stops all."""
    up = running_up
    wait_until(lambda: "started api" in up.output, timeout=60, what="every process started")
    [api_url] = re.findall(r"api:\s+(\S+)", up.output)
    wait_until(lambda: _ready(api_url), timeout=60, what="the API's /readyz")
    console = httpx.get(f"{api_url}/", timeout=10)
    assert (console.status_code, console.headers["location"]) == (303, "/signin")
    signin = httpx.get(f"{api_url}/signin", timeout=10)
    assert signin.status_code == 200, signin.text
    assert '<form method="post" action="/signin"' in signin.text
    assert "outbox_console=" in signin.headers["set-cookie"]
    _enqueue(engine, "first", 10)
    wait_until(lambda: _confirmed(engine) == 10, timeout=90, what="10 confirmed")

    worker = _pid(up.output, "worker-1")
    os.killpg(worker, signal.SIGKILL)
    wait_until(lambda: "worker-1 restarted" in up.output, timeout=30, what="a restart")
    assert _pid(up.output, "worker-1") != worker
    _enqueue(engine, "second", 5)
    wait_until(lambda: _confirmed(engine) == 15, timeout=90, what="15 confirmed")
    assert set(service.effects_by_key().values()) == {1}

    [url] = re.findall(r"metrics:\s+(\S+)", up.output)
    body = httpx.get(url, timeout=10).text
    assert f'outbox_operations{{state="confirmed",tool="{TOOL}"}} 15.0' in body

    children = [_pid(up.output, name) for name in ("relay-1", "worker-1", "beat", "api")]
    assert up.interrupt() == 0
    assert "stopped" in up.output
    assert all(_gone(pid) for pid in children)


@pytest.mark.parametrize("broker", ["database"], indirect=True)
def test_up_shows_a_live_panel_on_a_terminal(
    engine: Engine, service: DeployService, up_env: dict[str, str]
) -> None:
    """On a terminal: processes, operations by state with ages, needs_human, the rate."""
    up = Up(up_env, "--metrics-port", "0", "--no-api", tty=True)
    try:
        _enqueue(engine, "panel", 3)
        wait_until(
            lambda: all(
                word in up.output for word in ("processes", "worker-1", "needs_human", "decided")
            ),
            timeout=60,
            what="the panel",
        )
        wait_until(lambda: _confirmed(engine) == 3, timeout=90, what="3 confirmed")
        time.sleep(2)  # one more refresh of the panel
        assert up.interrupt() == 0
        assert "stopped" in up.output
    finally:
        up.kill()


@pytest.mark.parametrize("broker", ["database"], indirect=True)
def test_up_with_mcp_serves_the_tools_over_http_to_an_agent_token(
    engine: Engine, service: DeployService, up_env: dict[str, str]
) -> None:
    """`outbox up --mcp` supervises `outbox mcp --http`: it refuses a request without a token,
    and an agent's token calls a tool through the SDK's streamable HTTP client to one
    confirmed effect; Ctrl-C stops it with the rest."""
    token = _agent_token(engine, "agent-up")
    up = Up(
        up_env,
        "--no-panel",
        "--metrics-port",
        "0",
        "--workers",
        "1",
        "--no-api",
        "--mcp",
        "--mcp-port",
        str(_free_port()),
    )
    try:
        wait_until(lambda: "started mcp" in up.output, timeout=60, what="every process started")
        [url] = re.findall(r"mcp:\s+(\S+)", up.output)
        wait_until(lambda: _healthy(url), timeout=60, what="the MCP server's /healthz")
        refused = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, timeout=10)
        assert refused.status_code == 401

        result = asyncio.run(_call_over_mcp(url, token))

        report = result.structured_content
        assert isinstance(report, dict), result
        assert report["outcome"] == "confirmed", report
        assert service.effects_by_key() == {report["operation_id"]: 1}
        mcp_pid = _pid(up.output, "mcp")
        assert up.interrupt() == 0
        assert _gone(mcp_pid)
    finally:
        up.kill()


def _agent_token(engine: Engine, name: str) -> str:
    with Session(engine) as session, session.begin():
        return tokens.create_token(session, name=name, scope=TokenScope.AGENT).token


def _healthy(mcp_url: str) -> bool:
    try:
        return httpx.get(mcp_url.removesuffix("/mcp") + "/healthz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


async def _call_over_mcp(url: str, token: str) -> CallToolResult:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        intent = {"intent_key": "up-mcp/step-1", "target": "web", "payload": {"n": 1}}
        return await client.call_tool(TOOL.replace(".", "_"), intent)
