"""Dot segments (issue 32, items 4 and 5): a target, intent key, saga key or step name that
is `.` or `..` in any encoding is refused where it enters, naming the field, by the Python
API (sync and async) and the MCP server, and nothing is written."""

# ruff: noqa: F811 -- test_http_tool.py's fixtures, imported, are the tests' parameters

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from mcp import Client
from mcp_types import CallToolResult, TextContent
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

import outbox
from outbox import aio, api
from outbox.contracts import ContractTable, ToolContract
from outbox.db import create_async_engine
from outbox.errors import InvalidIntent, InvalidSagaRequest
from outbox.mcp import McpContext, create_server
from outbox.sagas import StepSpec
from outbox.tools import Applied, Inconclusive, Rejected, run_dispatch, run_lookup
from outbox.tools.base import ToolCall
from outbox.tools.http.tool import render_url
from tests.factories import event_count, operation_count
from tests.integration.test_http_tool import (  # noqa: F401 -- its fixtures, used here
    Remote,
    closed_loop,
    http_tool,
    make_call,
    remote,
)

TOOL, MCP_TOOL = "deploy.create_release", "deploy_create_release"
PAYLOAD = {"version": "1.2.3"}
#: Each is a dot segment to some remote: as written, percent-encoded in any case mix, between
#: separators, or encoded twice (for a remote that decodes twice).
DOTTED = [
    ".",
    "..",
    "%2E",
    "%2e%2E",
    ".%2E",
    "%2e.",
    "%252E%252e",
    "a/../b",
    "a%2F..",
    "..%5Cwindows",
    "%2E%2E%2Fvictim",
]


def _saga_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM outbox.sagas")).scalar_one())


@pytest.mark.parametrize("field", ["target", "intent_key"])
@pytest.mark.parametrize("value", DOTTED)
def test_enqueue_refuses_a_dot_segment_naming_the_field(
    engine: Engine, field: str, value: str
) -> None:
    """enqueue refuses a target or intent key that is a dot segment in any encoding with
    InvalidIntent naming the field, and writes nothing."""
    intent: dict[str, Any] = {"tool": TOOL, "target": "project-a", "payload": PAYLOAD}
    with Session(engine) as session, pytest.raises(InvalidIntent) as caught:
        api.enqueue(session, **(intent | {field: value}))
    assert caught.value.field == field
    assert "'.' or '..' path segment" in str(caught.value)
    assert (operation_count(engine), event_count(engine)) == (0, 0)


def test_values_with_dots_that_are_not_segments_are_accepted(engine: Engine) -> None:
    """Dots inside a value (`v1.2`, `...`, `.hidden`, `a/.b`) are not dot segments: accepted."""
    for number, target in enumerate(("v1.2", "...", ".hidden", "a/.b", "%2E%2E%2E", "a..b")):
        with Session(engine) as session, session.begin():
            api.enqueue(
                session, tool=TOOL, target=target, payload=PAYLOAD, intent_key=f"{target}-{number}"
            )
    assert operation_count(engine) == 6


@pytest.mark.parametrize("field", ["target", "intent_key"])
def test_the_async_enqueue_refuses_a_dot_segment_too(
    engine: Engine, database_url: str, field: str
) -> None:
    """outbox.aio.enqueue refuses `%2E%2e` as target or intent key naming the field."""

    async def refused() -> str:
        aengine = create_async_engine(database_url)
        try:
            async with AsyncSession(aengine) as session:
                intent: dict[str, Any] = {"tool": TOOL, "target": "project-a", "payload": PAYLOAD}
                with pytest.raises(InvalidIntent) as caught:
                    await aio.enqueue(session, **(intent | {field: "%2E%2e"}))
                await session.commit()
                return caught.value.field
        finally:
            await aio.close()
            await aengine.dispose()

    assert asyncio.run(refused()) == field
    assert operation_count(engine) == 0


@pytest.mark.parametrize("key", DOTTED)
def test_a_saga_key_with_a_dot_segment_is_refused(engine: Engine, key: str) -> None:
    """outbox.saga and declare_saga refuse a saga key with a dot segment naming saga_key;
    nothing is written."""
    step = StepSpec(name="release", tool=TOOL, target="project-a", payload=PAYLOAD)
    with Session(engine) as session:
        with pytest.raises(InvalidSagaRequest) as opened:
            outbox.saga(session, key)
        with pytest.raises(InvalidSagaRequest) as declared:
            outbox.declare_saga(session, key, [step])
    assert (opened.value.field, declared.value.field) == ("saga_key", "saga_key")
    assert (_saga_count(engine), operation_count(engine)) == (0, 0)


def test_a_saga_step_named_with_a_dot_segment_is_refused(engine: Engine) -> None:
    """A step name with a dot segment (it is part of its operation's intent key) is refused
    naming `name`, and a compensation target with one naming `compensate.target`."""
    with Session(engine) as session:
        saga = outbox.saga(session, "s-dots")
        with pytest.raises(InvalidIntent) as named:
            saga.step(name="x/..", tool=TOOL, target="project-a", payload=PAYLOAD)
        with pytest.raises(InvalidIntent) as undo:
            saga.step(
                name="release",
                tool=TOOL,
                target="project-a",
                payload=PAYLOAD,
                compensate=outbox.Compensate("deploy.delete_release", "..", {}),
            )
    assert (named.value.field, undo.value.field) == ("name", "compensate.target")
    assert operation_count(engine) == 0


def _text(result: CallToolResult) -> str:
    return " ".join(block.text for block in result.content if isinstance(block, TextContent))


def _mcp_calls(database_url: str, calls: list[tuple[str, dict[str, Any]]]) -> list[CallToolResult]:
    table = ContractTable()
    table.register(ToolContract(name=TOOL))

    async def session() -> list[CallToolResult]:
        aengine = create_async_engine(database_url)
        context = McpContext(engine=aengine, contracts=table, wait_s=0.3, agent="agent-a")
        try:
            async with Client(create_server(context)) as client:
                return [await client.call_tool(name, args) for name, args in calls]
        finally:
            await aio.close()
            await aengine.dispose()

    return asyncio.run(session())


def test_the_mcp_server_refuses_dot_segments_naming_the_field(
    engine: Engine, database_url: str
) -> None:
    """Over MCP a tool call with a `..` target or a `%2E` intent key, and a saga whose key
    is `harmless/../victim`, are tool errors naming the field; nothing is written."""
    intent = {"intent_key": "k-1", "target": "project-a", "payload": PAYLOAD}
    step = {"name": "release", "tool": MCP_TOOL, "target": "project-a", "payload": PAYLOAD}
    cases: list[tuple[str, dict[str, Any], str]] = [
        (MCP_TOOL, intent | {"target": ".."}, "target"),
        (MCP_TOOL, intent | {"intent_key": "%2E"}, "intent_key"),
        ("outbox_saga", {"saga_key": "harmless/../victim", "steps": [step]}, "saga_key"),
    ]
    results = _mcp_calls(database_url, [(name, args) for name, args, _ in cases])
    for result, (_, _, field) in zip(results, cases, strict=True):
        assert result.is_error, _text(result)
        assert isinstance(result.structured_content, dict), _text(result)
        assert result.structured_content["field"] == field
        assert "'.' or '..' path segment" in _text(result)
    assert (operation_count(engine), _saga_count(engine)) == (0, 0)


#: A remote that parses the request's path as WHATWG URL parsing does (Node's `URL`, as the
#: service in issue 32 did) and answers with the path it would route.
_WHATWG_REMOTE = """
const http = require("http");
const server = http.createServer((request, response) => {
  const pathname = new URL(request.url, "http://remote.invalid").pathname;
  response.setHeader("Content-Type", "application/json");
  response.end(JSON.stringify({pathname}));
});
server.listen(0, "127.0.0.1", () => console.log(server.address().port));
"""


@pytest.fixture(scope="module")
def whatwg_remote() -> Iterator[int]:
    """The port of a Node.js HTTP server answering with the WHATWG-resolved path it got."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("needs Node.js (the machine's node) for a WHATWG URL parser")
    process = subprocess.Popen([node, "-e", _WHATWG_REMOTE], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        yield int(process.stdout.readline())
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


def _path_reached(port: int, target: str, intent_key: str) -> list[str]:
    """The path segments the remote resolves for the URL an HTTP tool renders."""
    call = ToolCall(
        operation_id=str(uuid.uuid4()),
        intent_key=intent_key,
        tool=TOOL,
        target=target,
        payload={},
        attempt=1,
        timeout_s=5,
    )
    url = render_url(f"http://127.0.0.1:{port}/accounts/{{target}}/refunds/{{intent_key}}", call)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", url.raw_path)  # sent as rendered, as the tool sends it
        pathname: str = json.loads(connection.getresponse().read())["pathname"]
    finally:
        connection.close()
    return pathname.split("/")


def _accepted(engine: Engine, target: str, intent_key: str) -> bool:
    """Whether enqueue takes this target and intent key (rolled back either way)."""
    with Session(engine) as session:
        try:
            api.enqueue(session, tool=TOOL, target=target, payload=PAYLOAD, intent_key=intent_key)
        except InvalidIntent:
            return False
        finally:
            session.rollback()
    return True


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    target=st.one_of(st.sampled_from(DOTTED), st.text(alphabet=".%2eE5/\\aF", min_size=1)),
    intent_key=st.one_of(st.sampled_from(DOTTED), st.text(alphabet=".%2eE5/aF", min_size=1)),
)
def test_a_url_built_from_accepted_values_reaches_the_templates_path(
    engine: Engine, whatwg_remote: int, target: str, intent_key: str
) -> None:
    """Whatever target and intent key enqueue accepts, the URL an HTTP tool builds from them
    reaches, at a WHATWG remote over real HTTP, the template's path: one segment each."""
    assume(target.strip() and intent_key.strip())
    if not _accepted(engine, target, intent_key):
        return
    parts = _path_reached(whatwg_remote, target, intent_key)
    assert len(parts) == 5, parts
    assert (parts[0], parts[1], parts[3]) == ("", "accounts", "refunds"), parts


@pytest.mark.parametrize("target", ["..", "%2E", "a/../b"])
def test_a_recorded_dot_segment_target_is_never_sent(
    remote: Remote, tmp_path: Path, target: str
) -> None:
    """An operation recorded before enqueue refused dot segments, its target one, is Rejected
    at dispatch and Inconclusive at lookup without a request; a dotted value of a placeholder
    the URL does not use (the intent key here) changes nothing."""
    tool_ = http_tool(tmp_path, remote.port)
    dispatched = run_dispatch(tool_, make_call(target=target))
    assert isinstance(dispatched, Rejected)
    assert dispatched.reason.startswith("target has a '.' or '..' path segment")
    assert dispatched.reason.endswith("nothing was sent")
    looked_up = run_lookup(tool_, make_call(target=target))
    assert isinstance(looked_up, Inconclusive)
    assert looked_up.reason.endswith("the lookup was not sent")
    assert remote.seen == []
    assert isinstance(run_dispatch(tool_, make_call(intent_key="..")), Applied)
    assert [seen.path for seen in remote.seen] == ["/projects/project-a/releases"]
