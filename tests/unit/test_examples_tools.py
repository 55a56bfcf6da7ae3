"""The tools file the examples run with is one the outbox loads."""

from __future__ import annotations

from pathlib import Path

from outbox.tools.http import load_http_tools

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_examples_tools_file_loads_with_a_payload_schema_and_an_approval() -> None:
    """examples/tools.toml declares the release tool with a payload schema, and an approved twin."""
    tools = {tool.name: tool.contract for tool in load_http_tools(EXAMPLES / "tools.toml")}
    assert tools["deploy.create_release"].input_schema is not None
    assert tools["deploy.create_release"].approval_required is False
    assert tools["deploy.approved_release"].approval_required is True
