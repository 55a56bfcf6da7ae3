"""The real `outbox mcp` process on stdio (issue 32, items 4, 5 and 7): a dot segment or
unencodable text in a target, intent key or saga key is a refusal naming the field, never an
internal error, and nothing is written. No worker runs: nothing is dispatched."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, TextContent
from sqlalchemy import Engine, text

from outbox.dev.tool_config import http_tool_toml
from tests.acceptance.conftest import REPO, clean_environment
from tests.factories import operation_count

pytestmark = pytest.mark.slow

MCP_TOOL = "deploy_create_release"
STEP = {"name": "release", "tool": MCP_TOOL, "target": "web", "payload": {}}
#: Each call, and the field its refusal names.
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (MCP_TOOL, {"intent_key": "k-1", "target": "..", "payload": {}}, "target"),
    (MCP_TOOL, {"intent_key": "k-2", "target": "%2e%2E", "payload": {}}, "target"),
    (MCP_TOOL, {"intent_key": ".%2E", "target": "web", "payload": {}}, "intent_key"),
    ("outbox_saga", {"saga_key": "harmless/../victim", "steps": [STEP]}, "saga_key"),
    # NUL: the SDK's client cannot send a lone surrogate (tests/integration/
    # test_unencodable_keys.py sends one to the server in process).
    (MCP_TOOL, {"intent_key": "k-3", "target": "a\x00", "payload": {}}, "target"),
    ("outbox_status", {"intent_key": "\x00"}, "intent_key"),
    ("outbox_saga_status", {"saga_key": "a\x00b"}, "saga_key"),
]


def _text(result: CallToolResult) -> str:
    return " ".join(block.text for block in result.content if isinstance(block, TextContent))


def test_the_mcp_process_refuses_dot_segments_and_unencodable_text(
    engine: Engine, database_url: str, tmp_path: Path
) -> None:
    """`outbox mcp` answers each dotted or unencodable target, intent key or saga key with a
    tool error `Refused (<field>): …`, not an internal error, and writes nothing."""
    tools = tmp_path / "tools.toml"
    tools.write_text(http_tool_toml("http://127.0.0.1:9"), encoding="utf-8")
    env = clean_environment(
        OUTBOX_DATABASE_URL=database_url, OUTBOX_CONFIG=str(tools), OUTBOX_HOME=str(tmp_path)
    )
    server = StdioServerParameters(
        command=sys.executable,
        args=["-m", "outbox", "mcp", "--log-level", "warning"],
        env=env,
        cwd=str(REPO),
    )

    async def calls() -> list[CallToolResult | MCPError]:
        answers: list[CallToolResult | MCPError] = []
        async with Client(server) as client:
            for name, args, _ in REFUSED:
                try:
                    answers.append(await client.call_tool(name, args))
                except MCPError as exc:  # the server failed: what this test refuses
                    answers.append(exc)
        return answers

    for answer, (name, args, field) in zip(asyncio.run(calls()), REFUSED, strict=True):
        assert isinstance(answer, CallToolResult), (name, args, answer)
        assert answer.is_error, _text(answer)
        assert _text(answer).startswith(f"Refused ({field}):"), _text(answer)
    assert operation_count(engine) == 0
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM outbox.sagas")).scalar_one() == 0
