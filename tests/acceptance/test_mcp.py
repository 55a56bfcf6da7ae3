"""`outbox mcp` driven by the MCP SDK's own clients (stdio and streamable HTTP) against a real
stack (relay, worker, beat) and the reference service: a server SIGKILLed after the `sent`
commit, a new one, the same intent key again, one effect at the remote."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, TextContent, TextResourceContents
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

import outbox
from outbox import migrate, tokens
from outbox.db import create_engine
from outbox.dev.service import DeployService
from outbox.dev.tool_config import http_tool_toml
from outbox.models import TokenScope
from tests import docs_blocks
from tests.acceptance.conftest import REPO, clean_environment, run_outbox
from tests.conftest import Databases
from tests.processes import Service, Services, wait_until

pytestmark = pytest.mark.slow

#: The registered tools, and their MCP names (no dots: clients refuse them).
TOOL, MCP_TOOL = "deploy.create_release", "deploy_create_release"
#: No lookup and no dedup contract: an ambiguous outcome can only go to a person.
BLIND, MCP_BLIND = "deploy.blind", "deploy_blind"
#: Every call waits for a person's approval before anything is sent.
APPROVED, MCP_APPROVED = "deploy.approved", "deploy_approved"
_SERVING = re.compile(r"serving MCP on (\S+)")
#: The release tool's payload schema (`_fault`: the reference service's fault for a payload).
SCHEMA = """[tools."deploy.create_release".input_schema]
type = "object"
required = ["version"]
additionalProperties = false
properties = { version = { type = "string" }, _fault = { type = "string" } }
"""


@dataclass(frozen=True)
class Stack:
    """The module's database, reference service, environment and running processes."""

    url: str
    engine: Engine
    service: DeployService
    env: dict[str, str]
    services: Services


@pytest.fixture(scope="module")
def stack(databases: Databases, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A database of the module's own, the reference service (its `slow` fault takes 3 s),
    and a relay, a worker and beat on the database broker, shared by the module's tests."""
    url = databases.create()
    engine = create_engine(url)
    migrate.upgrade(engine)
    home = tmp_path_factory.mktemp("mcp")
    with DeployService(port=0, fault_delay_s=3.0) as service:
        tools = home / "tools.toml"
        tools.write_text(
            http_tool_toml(service.url, timeout_s=6.0, inflight_horizon_s=30)
            + SCHEMA
            + http_tool_toml(service.url, BLIND, lookup=False, timeout_s=1.0, inflight_horizon_s=30)
            + http_tool_toml(service.url, APPROVED, approval="required"),
            encoding="utf-8",
        )
        env = clean_environment(
            OUTBOX_DATABASE_URL=url,
            OUTBOX_CONFIG=str(tools),
            OUTBOX_HOME=str(home),
            OUTBOX_SWEEP_INTERVAL="1",
            OUTBOX_MCP_WAIT_S="30",
        )
        services = Services(env, home)
        try:
            services.start("relay", "relay")
            services.start("worker", "worker", "-P", "threads", "-c", "4")
            services.start("beat", "beat")
            yield Stack(url, engine, service, env, services)
        finally:
            for process in services.started:
                process.kill()  # the database is thrown away: no need for a clean stop
            services.stop_all()  # closes their logs
            engine.dispose()


def _state(engine: Engine, intent_key: str) -> str | None:
    with engine.connect() as conn:
        found = conn.execute(
            text("SELECT state FROM outbox.operations WHERE intent_key = :key"), {"key": intent_key}
        ).scalar_one_or_none()
    return None if found is None else str(found)


async def _until_state(engine: Engine, intent_key: str, state: str) -> None:
    deadline = time.monotonic() + 30
    while _state(engine, intent_key) != state:
        assert time.monotonic() < deadline, f"{intent_key} never reached {state}"
        await asyncio.sleep(0.05)


def _text(result: CallToolResult) -> str:
    return " ".join(block.text for block in result.content if isinstance(block, TextContent))


def _report(result: CallToolResult) -> dict[str, Any]:
    body = result.structured_content
    assert isinstance(body, dict), result
    return body


def _intent(key: str, version: str, fault: str | None = None) -> dict[str, Any]:
    payload: dict[str, Any] = {"version": version}
    if fault is not None:
        payload["_fault"] = fault  # the reference service's fault for this payload
    return {"intent_key": key, "target": "web", "payload": payload}


# --- stdio ------------------------------------------------------------------------------------


def _stdio(env: dict[str, str]) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "outbox", "mcp", "--log-level", "warning"],
        env=env,
        cwd=str(REPO),
    )


def _stdio_servers() -> list[int]:
    """Pids of this process's children running `outbox mcp` on stdio."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"mcp" in argv and b"--http" not in argv:
            found.append(int(entry.name))
    return found


def test_a_stdio_server_killed_after_sent_then_the_same_key_is_one_effect(stack: Stack) -> None:
    """SIGKILL `outbox mcp` after the `sent` commit; a new server, the same key: one effect,
    both answers name the operation and remote_ref; the key with other input names the field."""
    key = "conversation-7/step-1"
    asked = _intent(key, "1.0.0", fault="slow")

    async def scenario() -> tuple[CallToolResult, ...]:
        killed: list[int] = []
        with contextlib.suppress(Exception):  # the client sees its server vanish: any error
            async with Client(_stdio(stack.env)) as client:
                call = asyncio.ensure_future(client.call_tool(MCP_TOOL, asked))
                await _until_state(stack.engine, key, "sent")
                (pid,) = _stdio_servers()
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                await call
        assert killed, "the server was not killed"
        async with Client(_stdio(stack.env)) as client:
            first = await client.call_tool(MCP_TOOL, asked)
            again = await client.call_tool(MCP_TOOL, asked)
            other = await client.call_tool(MCP_TOOL, _intent(key, "2.0.0", fault="slow"))
            malformed = await client.call_tool(
                MCP_TOOL, {"intent_key": "conversation-7/step-2", "target": "web", "payload": {}}
            )
        return first, again, other, malformed

    first, again, other, malformed = asyncio.run(scenario())
    one, two = _report(first), _report(again)
    assert (one["outcome"], first.is_error) == ("confirmed", False), _text(first)
    assert (two["operation_id"], two["remote_ref"]) == (one["operation_id"], one["remote_ref"])
    assert stack.service.effects_by_key() == {one["operation_id"]: 1}
    (effect,) = [e for e in stack.service.ledger() if e.key == one["operation_id"]]
    assert effect.id == one["remote_ref"]
    assert other.is_error
    assert _report(other)["field"] == "payload.version"
    assert "payload.version" in _text(other)
    assert malformed.is_error
    assert _report(malformed)["field"] == "payload.version"
    assert _state(stack.engine, "conversation-7/step-2") is None


def test_a_blind_tool_under_faults_ends_needing_a_person_and_says_so(stack: Stack) -> None:
    """A tool with neither lookup nor dedup whose call times out after the remote committed
    ends in needs_human; the answer says so, is not an error, and says not to use a new key."""

    async def call() -> CallToolResult:
        async with Client(_stdio(stack.env)) as client:
            return await client.call_tool(
                MCP_BLIND, _intent("conversation-8/step-1", "1.0.0", fault="commit_then_timeout")
            )

    result = asyncio.run(call())
    report = _report(result)
    assert (report["outcome"], report["state"], report["settled"]) == (
        "needs_human",
        "needs_human",
        True,
    )
    assert result.is_error is False
    words = _text(result)
    assert "Needs a person" in words
    assert "Do not call this tool again with a new intent_key" in words
    assert "call outbox_status with operation_id" in words


def test_an_approval_tool_answers_at_once_and_status_waits_through_the_approval(
    stack: Stack,
) -> None:
    """A call of a tool that requires approval answers at once that it waits for a person
    (not an error); once approved, outbox_status with wait_s answers its confirmation."""
    key = "conversation-10/step-1"

    async def session() -> tuple[CallToolResult, CallToolResult]:
        async with Client(_stdio(stack.env)) as client:
            asked = await client.call_tool(MCP_APPROVED, _intent(key, "4.0.0"))
            with Session(stack.engine) as db, db.begin():
                # The stdio server's agent (OUTBOX_MCP_AGENT, "mcp" by default) owns the key.
                op = outbox.find(db, key, agent=stack.env.get("OUTBOX_MCP_AGENT", "mcp"))
                assert op is not None
                outbox.approve(db, op.id, by="alice", payload_hash=op.payload_hash)
            checked = await client.call_tool("outbox_status", {"intent_key": key, "wait_s": 20})
            return asked, checked

    asked, checked = asyncio.run(session())
    assert (_report(asked)["outcome"], asked.is_error) == ("awaiting_approval", False)
    assert "Waiting for approval" in _text(asked)
    assert _report(checked)["outcome"] == "confirmed", _text(checked)
    assert _report(checked)["operation_id"] == _report(asked)["operation_id"]


def test_status_by_id_or_key_the_list_and_the_resource_show_the_callers_own(
    stack: Stack,
) -> None:
    """Over stdio: the tool is listed with its annotations and a required, described
    intent_key; outbox_status finds an operation by operation_id and by intent_key alike,
    outbox_list filters by state (a wrong one named), `outbox://operations/{id}` reads it;
    another agent sees none of it."""
    key = "conversation-11/step-1"

    async def own() -> dict[str, Any]:
        async with Client(_stdio(stack.env)) as client:
            tools = {tool.name: tool for tool in (await client.list_tools()).tools}
            done = await client.call_tool(MCP_TOOL, _intent(key, "5.0.0"))
            op_id = _report(done)["operation_id"]
            return {
                "tools": tools,
                "done": done,
                "by_id": await client.call_tool("outbox_status", {"operation_id": op_id}),
                "by_key": await client.call_tool("outbox_status", {"intent_key": key}),
                "confirmed": await client.call_tool(
                    "outbox_list", {"state": "confirmed", "limit": 100}
                ),
                "needing": await client.call_tool("outbox_list", {"state": "needs_human"}),
                "wrong": await client.call_tool("outbox_list", {"state": "lost"}),
                "templates": await client.list_resource_templates(),
                "resource": await client.read_resource(f"outbox://operations/{op_id}"),
            }

    async def another(op_id: str) -> tuple[CallToolResult, CallToolResult, CallToolResult, str]:
        env = {**stack.env, "OUTBOX_MCP_AGENT": "another-agent"}
        async with Client(_stdio(env)) as client:
            by_id = await client.call_tool("outbox_status", {"operation_id": op_id})
            by_key = await client.call_tool("outbox_status", {"intent_key": key})
            listed = await client.call_tool("outbox_list", {})
            with pytest.raises(MCPError) as unreadable:
                await client.read_resource(f"outbox://operations/{op_id}")
            return by_id, by_key, listed, unreadable.value.message

    seen = asyncio.run(own())
    tool = seen["tools"][MCP_TOOL]
    hints = tool.annotations
    assert hints is not None
    assert (hints.destructive_hint, hints.idempotent_hint, hints.open_world_hint) == (
        True,
        True,
        True,
    )
    assert "intent_key" in tool.input_schema["required"]
    assert "stays the same" in tool.input_schema["properties"]["intent_key"]["description"]
    assert tool.input_schema["properties"]["payload"]["required"] == ["version"]
    assert {"outbox_status", "outbox_list"} <= set(seen["tools"])
    done = _report(seen["done"])
    assert done["outcome"] == "confirmed", _text(seen["done"])
    for name in ("by_id", "by_key"):
        found = _report(seen[name])
        assert (found["operation_id"], found["intent_key"], found["remote_ref"]) == (
            done["operation_id"],
            key,
            done["remote_ref"],
        ), name
        assert found["outcome"] == "confirmed"
    listed = _report(seen["confirmed"])["operations"]
    assert done["operation_id"] in [op["operation_id"] for op in listed]
    assert {op["state"] for op in listed} == {"confirmed"}
    assert done["operation_id"] not in _text(seen["needing"])
    assert (seen["wrong"].is_error, _report(seen["wrong"])["field"]) == (True, "state")
    [template] = seen["templates"].resource_templates
    assert template.uri_template == "outbox://operations/{id}"
    [content] = seen["resource"].contents
    assert isinstance(content, TextResourceContents)
    assert content.mime_type == "application/json"
    assert json.loads(content.text)["remote_ref"] == done["remote_ref"]

    by_id, by_key, listed_by_another, unreadable = asyncio.run(another(done["operation_id"]))
    assert (by_id.is_error, _report(by_id)["field"]) == (True, "operation_id")
    assert (by_key.is_error, _report(by_key)["field"]) == (True, "intent_key")
    assert done["operation_id"] not in _text(listed_by_another)
    assert "no operation of yours" in unreadable


# --- streamable HTTP --------------------------------------------------------------------------


def _token(engine: Engine, name: str, scope: TokenScope) -> str:
    with Session(engine) as session, session.begin():
        return tokens.create_token(session, name=name, scope=scope).token


def _start_http(stack: Stack, name: str) -> tuple[Service, str]:
    """`outbox mcp --http --port 0` and the URL of its endpoint once it answers."""
    server = stack.services.start(name, "mcp", "--http", "--port", "0")
    found: list[str] = []

    def serving() -> bool:
        match = _SERVING.search(server.output())
        if match:
            found.append(match.group(1))
        assert server.alive(), server.output()
        return bool(match)

    wait_until(serving, timeout=30, what="outbox mcp --http to start")
    url = found[0]
    wait_until(
        lambda: httpx.get(url.removesuffix("/mcp") + "/healthz").status_code == 200,
        timeout=10,
        what="/healthz",
    )
    return server, url


@asynccontextmanager
async def _http_client(url: str, token: str) -> AsyncIterator[Client]:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        yield client


def test_over_http_a_killed_server_then_the_same_key_is_one_effect(stack: Stack) -> None:
    """Over streamable HTTP with an agent token: SIGKILL the server after `sent`, start a new
    one, the same key answers the same operation and remote_ref, once at the remote, recorded
    as requested by the token's name; other input names the field; a blind tool under faults
    ends in needs_human and says so."""
    token = _token(stack.engine, "agent-http", TokenScope.AGENT)
    key = "conversation-9/step-1"
    asked = _intent(key, "3.0.0", fault="slow")
    server, url = _start_http(stack, "mcp-http-1")

    async def killed_mid_call() -> None:
        with contextlib.suppress(Exception):
            async with _http_client(url, token) as client:
                call = asyncio.ensure_future(client.call_tool(MCP_TOOL, asked))
                await _until_state(stack.engine, key, "sent")
                server.kill()
                await call

    asyncio.run(killed_mid_call())
    assert not server.alive()
    _, url = _start_http(stack, "mcp-http-2")

    async def again() -> tuple[CallToolResult, ...]:
        async with _http_client(url, token) as client:
            first, blind = await asyncio.gather(
                client.call_tool(MCP_TOOL, asked),
                client.call_tool(
                    MCP_BLIND,
                    _intent("conversation-9/step-2", "3.0.0", fault="commit_then_timeout"),
                ),
            )
            status = await client.call_tool("outbox_status", {"intent_key": key})
            other = await client.call_tool(MCP_TOOL, _intent(key, "3.0.1", fault="slow"))
            return first, status, blind, other

    first, status, blind, other = asyncio.run(again())
    one, two = _report(first), _report(status)
    assert one["outcome"] == "confirmed", _text(first)
    assert (two["operation_id"], two["remote_ref"]) == (one["operation_id"], one["remote_ref"])
    assert stack.service.effects_by_key()[one["operation_id"]] == 1
    with stack.engine.connect() as conn:
        by = conn.execute(
            text("SELECT requested_by FROM outbox.operations WHERE intent_key = :k"), {"k": key}
        ).scalar_one()
    assert by == "agent-http"
    assert (other.is_error, _report(other)["field"]) == (True, "payload.version")
    assert (_report(blind)["outcome"], blind.is_error) == ("needs_human", False)
    assert "Needs a person" in _text(blind)


def test_over_http_two_agents_racing_one_key_each_get_their_own_effect(stack: Stack) -> None:
    """Over streamable HTTP, two agents' tokens racing one intent_key (six calls each, at
    once): one operation per agent, each confirmed once at the remote, every answer its own
    agent's; a third token made for the first agent (a rotation) finds that agent's."""
    first = _token(stack.engine, "agent-race-a", TokenScope.AGENT)
    second = _token(stack.engine, "agent-race-b", TokenScope.AGENT)
    with Session(stack.engine) as session, session.begin():
        rotated = tokens.create_token(
            session, name="agent-race-a-2", scope=TokenScope.AGENT, agent="agent-race-a"
        ).token
    _, url = _start_http(stack, "mcp-http-race")
    key = "conversation-1/step-1"

    async def calls(token: str) -> list[CallToolResult]:
        async with _http_client(url, token) as client:
            return list(
                await asyncio.gather(
                    *(client.call_tool(MCP_TOOL, _intent(key, "7.0.0")) for _ in range(6))
                )
            )

    async def race() -> tuple[list[CallToolResult], list[CallToolResult], CallToolResult]:
        mine, theirs = await asyncio.gather(calls(first), calls(second))
        async with _http_client(url, rotated) as client:
            again = await client.call_tool("outbox_status", {"intent_key": key})
        return mine, theirs, again

    mine, theirs, again = asyncio.run(race())
    ids = [{_report(r)["operation_id"] for r in answers} for answers in (mine, theirs)]
    assert [len(found) for found in ids] == [1, 1], [_text(r) for r in mine + theirs]
    (a_id,), (b_id,) = ids
    assert a_id != b_id
    assert all(_report(r)["outcome"] == "confirmed" for r in mine + theirs)
    assert not any(a_id in str(r.structured_content) or a_id in _text(r) for r in theirs)
    assert _report(again)["operation_id"] == a_id
    effects = stack.service.effects_by_key()
    assert (effects[a_id], effects[b_id]) == (1, 1)
    with stack.engine.connect() as conn:
        agents = conn.execute(
            text("SELECT agent FROM outbox.operations WHERE intent_key = :k ORDER BY agent"),
            {"k": key},
        ).scalars()
        assert list(agents) == ["agent-race-a", "agent-race-b"]


def _saga_step(name: str, target: str, version: Any) -> dict[str, Any]:
    return {"name": name, "tool": MCP_TOOL, "target": target, "payload": {"version": version}}


def test_over_http_a_saga_is_declared_and_read_as_the_tokens_own(stack: Stack) -> None:
    """Over streamable HTTP with an agent token: outbox_saga declares two releases and answers
    once the saga completed, each step confirmed once at the remote; outbox_saga_status reads
    the same saga; both the saga and its operations are requested by the token's name. A step
    whose payload fails the tool's input_schema is refused naming ``steps[1].payload.version``
    with nothing written; another agent's token does not see the saga."""
    token = _token(stack.engine, "agent-saga-http", TokenScope.AGENT)
    another = _token(stack.engine, "agent-saga-other", TokenScope.AGENT)
    _, url = _start_http(stack, "mcp-http-saga")
    key, bad_key = "conversation-12/release-6.0.0", "conversation-12/release-bad"
    steps = [
        _saga_step("release-a", "saga-web-a", "6.0.0"),
        _saga_step("release-b", "saga-web-b", "6.0.0"),
    ]

    async def calls() -> tuple[
        set[str], CallToolResult, CallToolResult, CallToolResult, CallToolResult
    ]:
        async with _http_client(url, token) as client:
            tools = {tool.name for tool in (await client.list_tools()).tools}
            declared = await client.call_tool("outbox_saga", {"saga_key": key, "steps": steps})
            status = await client.call_tool("outbox_saga_status", {"saga_key": key})
            bad = [steps[0], _saga_step("release-b", "saga-web-b", 6)]
            malformed = await client.call_tool("outbox_saga", {"saga_key": bad_key, "steps": bad})
        async with _http_client(url, another) as client:
            theirs = await client.call_tool("outbox_saga_status", {"saga_key": key})
        return tools, declared, status, malformed, theirs

    tools, declared, status, malformed, theirs = asyncio.run(calls())
    assert {"outbox_saga", "outbox_saga_status"} <= tools
    body, words = _report(declared), _text(declared)
    assert (declared.is_error, body["state"], body["settled"]) == (False, "completed", True), words
    assert words.startswith(f"Done: saga {key!r} completed")
    assert [(s["name"], s["state"]) for s in body["steps"]] == [
        ("release-a", "confirmed"),
        ("release-b", "confirmed"),
    ]
    read = _report(status)
    assert (status.is_error, read["state"]) == (False, "completed")
    assert [(s["operation_id"], s["remote_ref"]) for s in read["steps"]] == [
        (s["operation_id"], s["remote_ref"]) for s in body["steps"]
    ]
    by_key = stack.service.effects_by_key()
    assert [by_key.get(s["operation_id"]) for s in body["steps"]] == [1, 1]
    with stack.engine.connect() as conn:
        saga_by = conn.execute(
            text("SELECT requested_by FROM outbox.sagas WHERE key = :k"), {"k": key}
        ).scalar_one()
        ops_by = conn.execute(
            text("SELECT requested_by FROM outbox.operations WHERE intent_key LIKE :k"),
            {"k": f"saga:{len(key)}:{key}:%"},
        ).scalars()
        assert (saga_by, sorted(ops_by)) == ("agent-saga-http", ["agent-saga-http"] * 2)
        left = conn.execute(
            text(
                "SELECT (SELECT count(*) FROM outbox.sagas WHERE key = :k) + (SELECT count(*) "
                "FROM outbox.operations WHERE intent_key LIKE :steps)"
            ),
            {"k": bad_key, "steps": f"saga:{len(bad_key)}:{bad_key}:%"},
        ).scalar_one()
    assert (malformed.is_error, _report(malformed)["field"]) == (True, "steps[1].payload.version")
    assert "steps[1].payload.version" in _text(malformed)
    assert left == 0
    assert (theirs.is_error, _report(theirs)["field"]) == (True, "saga_key")
    assert "release-a" not in _text(theirs)


# --- docs/mcp.md's client code, run as written ------------------------------------------------

DOCS = REPO / "docs" / "mcp.md"


def _doc_block(marker: str) -> str:
    """The fenced block marked ``<!-- example: MARKER -->`` in docs/mcp.md."""
    return docs_blocks.example(DOCS, marker).code


def _run_doc_block(marker: str, env: dict[str, str]) -> str:
    """Run docs/mcp.md's block ``marker`` as a Python script (the virtualenv's ``outbox`` on
    ``PATH``, as in an activated virtualenv) and return what it printed."""
    path = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _doc_block(marker)],
        env={**env, "PATH": path},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_docs_stdio_client_runs_as_written_and_twice_is_one_effect(stack: Stack) -> None:
    """docs/mcp.md's stdio client lists the tools and gets its release confirmed; run again, it
    gets the same operation and the service has one effect."""
    first = _run_doc_block("mcp-stdio", stack.env)
    again = _run_doc_block("mcp-stdio", stack.env)
    assert MCP_TOOL in first.splitlines()[0].removeprefix("tools: ").split(", ")
    outcome, remote_ref = first.splitlines()[1].split()
    assert outcome == "confirmed"
    assert again.splitlines()[1] == first.splitlines()[1]
    assert [effect.id for effect in stack.service.ledger()].count(remote_ref) == 1
    assert _state(stack.engine, "conversation-42/release-web") == "confirmed"


def test_the_docs_http_client_runs_as_written_with_a_token(stack: Stack) -> None:
    """docs/mcp.md's streamable HTTP client, given an agent's token, gets its release
    confirmed, recorded as requested by the token's name."""
    token = _token(stack.engine, "release-bot", TokenScope.AGENT)
    _, url = _start_http(stack, "mcp-http-docs")
    printed = _run_doc_block(
        "mcp-http", {**stack.env, "OUTBOX_MCP_URL": url, "OUTBOX_MCP_TOKEN": token}
    )
    assert printed.split()[0] == "confirmed", printed
    with stack.engine.connect() as conn:
        requested_by = conn.execute(
            text("SELECT requested_by FROM outbox.operations WHERE intent_key = :key"),
            {"key": "conversation-42/release-api"},
        ).scalar_one()
    assert requested_by == "release-bot"


def test_the_docs_refused_client_prints_what_the_docs_say(stack: Stack) -> None:
    """docs/mcp.md's client without a token and with a wrong one catches the SDK's MCPError
    and prints exactly the lines the docs show: the 401 and where a token comes from."""
    _, url = _start_http(stack, "mcp-http-refused")
    printed = _run_doc_block("mcp-http-refused", {**stack.env, "OUTBOX_MCP_URL": url})
    assert printed.strip() == _doc_block("mcp-http-refused-output").strip()


def test_over_http_no_token_is_401_and_an_operator_token_403(stack: Stack) -> None:
    """The MCP endpoint refuses a request without a live token (401, with a Bearer challenge)
    and an operator's token (403): it is for agents; each body is a JSON-RPC error saying why."""
    operator = _token(stack.engine, "ops-mcp", TokenScope.OPERATOR)
    _, url = _start_http(stack, "mcp-http-3")
    hello = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    bare = httpx.post(url, json=hello)
    assert bare.status_code == 401
    assert bare.headers["www-authenticate"].startswith("Bearer")
    assert bare.json()["error"]["code"] == -32001
    assert "no bearer token" in bare.json()["error"]["message"]
    wrong = httpx.post(url, json=hello, headers={"Authorization": "Bearer obx_nope"})
    assert wrong.status_code == 401
    assert "unknown or revoked" in wrong.json()["error"]["message"]
    as_operator = httpx.post(url, json=hello, headers={"Authorization": f"Bearer {operator}"})
    assert as_operator.status_code == 403
    assert "--scope agent" in as_operator.json()["error"]["message"]


def test_a_public_address_without_tls_or_a_config_without_tools_is_one_line(
    stack: Stack,
) -> None:
    """`outbox mcp --http --host 0.0.0.0` without TLS exits 2, `outbox mcp` with no tools
    named exits 1, and `outbox up --mcp` without tools exits 2, each with one line."""
    public = run_outbox("mcp", "--http", "--host", "0.0.0.0", env=stack.env)  # noqa: S104
    assert public.code == 2
    assert "refusing to serve MCP on 0.0.0.0 without TLS" in public.stderr
    bare = {k: v for k, v in stack.env.items() if k != "OUTBOX_CONFIG"}
    no_tools = run_outbox("mcp", env=bare)
    assert no_tools.code == 1
    assert "set OUTBOX_CONFIG" in no_tools.stderr
    assert len(no_tools.stderr.strip().splitlines()) == 1
    up = run_outbox("up", "--mcp", "--no-panel", env=bare)
    assert up.code == 2
    assert "OUTBOX_CONFIG or OUTBOX_TOOLS" in up.stderr
