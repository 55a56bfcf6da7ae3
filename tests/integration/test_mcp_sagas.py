"""Sagas over MCP: outbox_saga and outbox_saga_status, the server in process through the
SDK's own client, on the test database. No worker runs here, so a declared saga stays
running; a settled one is made by hand (tests/acceptance/test_saga_http.py runs one for real
with processes)."""

from __future__ import annotations

import asyncio
from typing import Any

from mcp import Client
from mcp_types import CallToolResult, TextContent
from sqlalchemy import Engine, text

from outbox import aio
from outbox.contracts import ContractTable, ToolContract
from outbox.db import create_async_engine
from outbox.mcp import McpContext, create_server
from tests.acceptance.test_cli_sagas import compensated_saga

TOOLS = ("deploy.create_release", "deploy.delete_release", "lb.point", "chat.post")
#: The saga of tests/integration/test_sagas.py's THREE, as outbox_saga takes it; tools by
#: their MCP names and by their registered names, both understood.
STEPS: list[dict[str, Any]] = [
    {
        "name": "release",
        "tool": "deploy_create_release",
        "target": "project-a",
        "payload": {"version": "1.2.3"},
        "compensate": {
            "tool": "deploy.delete_release",
            "target": "project-a",
            "payload": {"release": "{remote_ref}", "why": "undo"},
        },
    },
    {
        "name": "point-lb",
        "tool": "lb.point",
        "target": "lb-1",
        "payload": {"to": "1.2.3"},
        "compensate": {
            "tool": "lb_point",
            "target": "lb-1",
            "payload": {"to": "previous", "undo": "{remote_ref}"},
        },
    },
    {"name": "announce", "tool": "chat_post", "target": "#releases", "payload": {"text": "out"}},
]


def _text(result: CallToolResult) -> str:
    return " ".join(block.text for block in result.content if isinstance(block, TextContent))


def _body(result: CallToolResult) -> dict[str, Any]:
    assert isinstance(result.structured_content, dict), _text(result)
    return result.structured_content


def _calls(
    database_url: str, agent: str, calls: list[tuple[str, dict[str, Any]]]
) -> list[CallToolResult]:
    """Make ``calls`` in order as ``agent`` on one in-process server (0.3 s wait)."""
    table = ContractTable()
    for name in TOOLS:
        table.register(ToolContract(name=name))

    async def session() -> list[CallToolResult]:
        engine = create_async_engine(database_url)
        context = McpContext(engine=engine, contracts=table, wait_s=0.3, agent=agent)
        try:
            async with Client(create_server(context)) as client:
                return [await client.call_tool(name, args) for name, args in calls]
        finally:
            await aio.close()
            await engine.dispose()

    return asyncio.run(session())


def test_the_saga_tools_are_listed_with_the_servers_tools_to_choose_from(
    database_url: str,
) -> None:
    """outbox_saga takes a saga_key (described as a key that stays the same across
    retries) and its steps, whose tools are the server's; outbox_saga_status a saga_key."""
    table = ContractTable()
    for name in TOOLS:
        table.register(ToolContract(name=name))

    async def listed() -> dict[str, Any]:
        engine = create_async_engine(database_url)
        context = McpContext(engine=engine, contracts=table, wait_s=0.3, agent="a")
        try:
            async with Client(create_server(context)) as client:
                return {tool.name: tool for tool in (await client.list_tools()).tools}
        finally:
            await engine.dispose()

    tools = asyncio.run(listed())
    saga = tools["outbox_saga"]
    schema = saga.input_schema
    assert schema["required"] == ["saga_key", "steps"]
    assert "NEVER a fresh random value" in schema["properties"]["saga_key"]["description"]
    step = schema["properties"]["steps"]["items"]
    assert step["properties"]["tool"]["enum"] == sorted(TOOLS)
    assert step["properties"]["compensate"]["required"] == ["tool", "target", "payload"]
    assert saga.annotations is not None
    assert (saga.annotations.destructive_hint, saga.annotations.idempotent_hint) == (True, True)
    assert tools["outbox_saga_status"].input_schema["required"] == ["saga_key"]


def test_a_declared_saga_not_settled_in_time_says_so_and_the_same_call_finds_it(
    engine: Engine, database_url: str
) -> None:
    """No worker: the saga stays running. The answer is not an error, says not to declare it
    again with a new key and how to check; the same call again and outbox_saga_status name
    the same steps' operations; one saga, three operations."""
    declared = {"saga_key": "conversation-3/release", "steps": STEPS}
    first, again, status = _calls(
        database_url,
        "agent-a",
        [
            ("outbox_saga", declared),
            ("outbox_saga", declared),
            ("outbox_saga_status", {"saga_key": "conversation-3/release", "wait_s": 600}),
        ],
    )
    for result in (first, again, status):
        assert result.is_error is False, _text(result)
        body = _body(result)
        assert (body["state"], body["settled"]) == ("running", False)
    assert len({tuple(s["operation_id"] for s in _body(r)["steps"]) for r in (first, again)}) == 1
    assert [s["tool"] for s in _body(first)["steps"]] == [
        "deploy.create_release",
        "lb.point",
        "chat.post",
    ]
    words = _text(first)
    assert words.startswith("In progress: saga 'conversation-3/release' is running")
    assert "release planned" in words
    assert "point-lb planned, not started" in words
    assert "Do not declare it again with a new saga_key" in words
    assert "call outbox_saga_status with saga_key 'conversation-3/release'" in words
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.sagas")).scalar_one() == 1
        assert conn.execute(text("SELECT count(*) FROM outbox.operations")).scalar_one() == 3


def test_a_saga_declared_otherwise_or_malformed_is_refused_naming_the_field(
    engine: Engine, database_url: str
) -> None:
    """Other steps under the key, an unknown tool, a missing payload, an unknown member, a
    pivot with an undo: refused (an error) naming the field; nothing more written. Another
    agent's same key is that agent's own saga, and its answers hold nothing of the first's."""
    _calls(database_url, "agent-a", [("outbox_saga", {"saga_key": "s-1", "steps": STEPS})])
    changed = [STEPS[0], {**STEPS[1], "payload": {"to": "9"}}, STEPS[2]]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"saga_key": "s-1", "steps": changed}, "steps[1].payload"),
        ({"saga_key": "s-1", "steps": STEPS[:2]}, "steps"),
        ({"saga_key": "s-2", "steps": [{**STEPS[2], "tool": "rm_rf"}]}, "steps[0].tool"),
        (
            {"saga_key": "s-2", "steps": [{k: v for k, v in STEPS[2].items() if k != "payload"}]},
            "steps[0].payload",
        ),
        ({"saga_key": "s-2", "steps": [{**STEPS[2], "typo": 1}]}, "steps[0].typo"),
        ({"saga_key": "s-2", "steps": [{**STEPS[0], "pivot": True}]}, "steps[0].compensate"),
        ({"saga_key": "s-2", "steps": []}, "steps"),
        ({"steps": STEPS}, "saga_key"),
    ]
    results = _calls(database_url, "agent-a", [("outbox_saga", args) for args, _ in cases])
    for result, (_, field) in zip(results, cases, strict=True):
        assert result.is_error, _text(result)
        assert (_body(result)["error"], _body(result)["field"]) == ("refused", field)
        assert _text(result).startswith(f"Refused ({field}):")
    theirs, unknown = _calls(
        database_url,
        "agent-b",
        [
            ("outbox_saga", {"saga_key": "s-1", "steps": STEPS[:1]}),
            ("outbox_saga_status", {"saga_key": "s-1"}),
        ],
    )
    assert not theirs.is_error, _text(theirs)
    assert [step["name"] for step in _body(theirs)["steps"]] == ["release"]
    assert _body(unknown)["steps"] == _body(theirs)["steps"]
    for answer in (theirs, unknown):
        assert "point-lb" not in _text(answer)
        assert "agent-a" not in str(answer.structured_content)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.sagas")).scalar_one() == 2
        assert conn.execute(text("SELECT count(*) FROM outbox.operations")).scalar_one() == 4


def test_an_undone_saga_is_reported_as_an_error_saying_nothing_remains(
    engine: Engine, database_url: str
) -> None:
    """A compensated saga: outbox_saga_status says it did not complete and what was undone,
    as an error (nothing of it remains)."""
    compensated_saga(engine, "s-undone")
    (status,) = _calls(database_url, "agent-7", [("outbox_saga_status", {"saga_key": "s-undone"})])
    assert status.is_error
    body = _body(status)
    assert (body["state"], body["settled"]) == ("compensated", True)
    assert [(s["name"], s["state"], s["compensation_state"]) for s in body["steps"]] == [
        ("release", "confirmed", "confirmed"),
        ("point-lb", "confirmed", "confirmed"),
        ("announce", "failed", None),
    ]
    words = _text(status)
    assert words.startswith("Undone: saga 's-undone' did not complete")
    assert "release confirmed (remote reference rel-42), undo confirmed" in words
