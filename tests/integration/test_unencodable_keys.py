"""Text PostgreSQL cannot store (a NUL, a lone surrogate: JSON's "\\ud800" over MCP) as a
target, intent key or saga key (issue 32, item 7): enqueue and saga creation refuse it naming
the field, lookups find nothing, and the MCP server answers a refusal, not an internal
error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, TextContent
from sqlalchemy import Engine
from sqlalchemy.orm import Session

import outbox
from outbox import aio, api, sagas
from outbox.contracts import ContractTable, ToolContract
from outbox.db import create_async_engine
from outbox.errors import InvalidIntent, InvalidSagaRequest, SagaNotFound
from outbox.mcp import McpContext, create_server
from tests.factories import operation_count

TOOL, MCP_TOOL = "deploy.create_release", "deploy_create_release"
UNENCODABLE = ["\ud800", "a\udfffb", "a\x00b"]


@pytest.mark.parametrize("field", ["target", "intent_key"])
@pytest.mark.parametrize("value", UNENCODABLE)
def test_enqueue_refuses_unencodable_text_naming_the_field(
    engine: Engine, field: str, value: str
) -> None:
    """enqueue refuses a target or intent key holding a NUL or a lone surrogate with
    InvalidIntent naming the field (a UnicodeEncodeError before), writing nothing."""
    intent: dict[str, Any] = {"tool": TOOL, "target": "project-a", "payload": {}}
    with Session(engine) as session, pytest.raises(InvalidIntent) as caught:
        api.enqueue(session, **(intent | {field: value}))
    assert caught.value.field == field
    assert operation_count(engine) == 0


@pytest.mark.parametrize("value", UNENCODABLE)
def test_sagas_refuse_or_do_not_find_unencodable_keys(engine: Engine, value: str) -> None:
    """saga() refuses such a key naming saga_key; get_saga and find find nothing under it,
    and cancel_saga says there is no such saga."""
    with Session(engine) as session:
        with pytest.raises(InvalidSagaRequest) as opened:
            outbox.saga(session, value)
        assert opened.value.field == "saga_key"
        assert sagas.get_saga(session, value) is None
        assert sagas.get_saga(session, "s", agent=value) is None
        assert sagas.agents_of_saga_key(session, value) == []
        assert api.find(session, value) is None
        assert api.find_every_agents(session, value) == []
        with pytest.raises(SagaNotFound):
            sagas.cancel_saga(session, value, by="ops", reason="why")


def _text(result: CallToolResult) -> str:
    return " ".join(block.text for block in result.content if isinstance(block, TextContent))


def test_the_mcp_server_refuses_unencodable_keys_and_targets(
    engine: Engine, database_url: str
) -> None:
    """Over MCP a surrogate or NUL as target, intent key or saga key is a refusal naming the
    field, never an internal error; nothing is written."""
    table = ContractTable()
    table.register(ToolContract(name=TOOL))
    calls: list[tuple[str, dict[str, Any], str]] = [
        (MCP_TOOL, {"intent_key": "k", "target": "\ud800", "payload": {}}, "target"),
        (MCP_TOOL, {"intent_key": "k\x00", "target": "a", "payload": {}}, "intent_key"),
        ("outbox_status", {"intent_key": "\ud800"}, "intent_key"),
        ("outbox_saga_status", {"saga_key": "a\x00"}, "saga_key"),
        (
            "outbox_saga",
            {
                "saga_key": "\udfff",
                "steps": [{"name": "s", "tool": MCP_TOOL, "target": "a", "payload": {}}],
            },
            "saga_key",
        ),
    ]

    async def session() -> list[CallToolResult | MCPError]:
        aengine = create_async_engine(database_url)
        context = McpContext(engine=aengine, contracts=table, wait_s=0.3, agent="agent-a")
        answers: list[CallToolResult | MCPError] = []
        try:
            async with Client(create_server(context)) as client:
                for name, args, _ in calls:
                    try:
                        answers.append(await client.call_tool(name, args))
                    except MCPError as exc:  # the server failed: what this test refuses
                        answers.append(exc)
        finally:
            await aio.close()
            await aengine.dispose()
        return answers

    for answer, (name, _, field) in zip(asyncio.run(session()), calls, strict=True):
        assert isinstance(answer, CallToolResult), (name, answer)
        assert answer.is_error, _text(answer)
        assert _text(answer).startswith(f"Refused ({field}):"), _text(answer)
    assert operation_count(engine) == 0
