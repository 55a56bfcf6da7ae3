"""An MCP call whose operation does not settle within the server's wait: the answer says so
plainly (not as an error), says not to call again with a new key and how to check; the same
call again is the same operation. The server in process, through the SDK's own client, on
the test database; no worker runs, so nothing settles."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from mcp import Client
from mcp_types import CallToolResult, TextContent
from sqlalchemy import Engine, text

from outbox import aio
from outbox.contracts import ContractTable, ToolContract
from outbox.db import create_async_engine
from outbox.mcp import McpContext, create_server
from outbox.reports import DO_NOT_RETRY_NEW_KEY

TOOL, MCP_TOOL = "deploy.create_release", "deploy_create_release"
INTENT = {"intent_key": "conversation-1/step-1", "target": "web", "payload": {"version": "1"}}


def _text(result: CallToolResult) -> str:
    return " ".join(block.text for block in result.content if isinstance(block, TextContent))


def test_a_call_not_settled_in_time_answers_in_progress_and_how_to_check(
    engine: Engine, database_url: str
) -> None:
    """OUTBOX_MCP_WAIT_S elapses with the operation planned: the answer is `in_progress`, not
    an error, tells the model not to use a new intent_key and to call outbox_status; the same
    call again names the same operation, and outbox_status's wait is capped by the server's."""
    table = ContractTable()
    table.register(ToolContract(name=TOOL))

    async def session() -> tuple[list[CallToolResult], float]:
        async_engine = create_async_engine(database_url)
        context = McpContext(engine=async_engine, contracts=table, wait_s=0.5, agent="tester")
        try:
            async with Client(create_server(context)) as client:
                started = time.monotonic()
                first = await client.call_tool(MCP_TOOL, INTENT)
                waited = time.monotonic() - started
                again = await client.call_tool(MCP_TOOL, INTENT)
                status = await client.call_tool(
                    "outbox_status", {"intent_key": INTENT["intent_key"], "wait_s": 600}
                )
                return [first, again, status], waited
        finally:
            await aio.close()
            await async_engine.dispose()

    started = time.monotonic()
    (first, again, status), waited = asyncio.run(session())
    elapsed = time.monotonic() - started

    reports: list[dict[str, Any]] = []
    for result in (first, again, status):
        assert result.is_error is False, _text(result)
        body = result.structured_content
        assert isinstance(body, dict)
        reports.append(body)
    assert {(r["outcome"], r["state"], r["settled"]) for r in reports} == {
        ("in_progress", "planned", False)
    }
    assert len({r["operation_id"] for r in reports}) == 1
    words = _text(first)
    assert words.startswith("In progress:")
    assert DO_NOT_RETRY_NEW_KEY in words
    assert f"call outbox_status with operation_id {reports[0]['operation_id']}" in words
    assert waited >= 0.5  # it did wait for the outcome
    assert elapsed < 15  # and outbox_status's 600 s were capped at the server's 0.5 s
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT state FROM outbox.operations")).scalars().all()
    assert rows == ["planned"]
