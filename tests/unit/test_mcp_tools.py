"""What a model sees of a tool through `outbox mcp`, and how a call's arguments are checked."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from mcp import Client
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult

from outbox.contracts import ContractTable, ToolContract
from outbox.db import create_async_engine
from outbox.differences import differing_paths
from outbox.mcp import McpContext, create_server
from outbox.mcp.tools import (
    INTENT_KEY_ADVICE,
    ArgumentRefused,
    list_query,
    mcp_names,
    registered_tool,
    status_query,
    tool_intent,
)

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["amount"],
    "properties": {"amount": {"$ref": "#/$defs/cents"}},
    "$defs": {"cents": {"type": "integer", "minimum": 1}},
}


def test_the_input_is_the_intent_with_a_required_key_and_the_tools_payload_schema() -> None:
    """A registered tool's input: intent_key (required, with the advice), target, and its
    payload schema under `payload`, whose definitions and dialect move to the root."""
    tool = registered_tool(
        ToolContract(name="billing.charge", input_schema=SCHEMA), "billing_charge"
    )
    schema = tool.input_schema
    assert schema["required"] == ["intent_key", "target", "payload"]
    assert schema["additionalProperties"] is False
    assert schema["properties"]["intent_key"]["description"] == INTENT_KEY_ADVICE
    payload = schema["properties"]["payload"]
    assert payload["properties"] == SCHEMA["properties"]
    assert "$defs" not in payload
    assert schema["$defs"] == SCHEMA["$defs"]
    assert schema["$schema"] == SCHEMA["$schema"]
    assert SCHEMA["$defs"]  # the contract's own schema is left as it was


def test_annotations_say_destructive_idempotent_open_world() -> None:
    """Every registered tool is a destructive, idempotent (by its key), open-world action;
    one without a schema takes any object; one that needs approval says so."""
    tool = registered_tool(
        ToolContract(name="deploy.create_release", approval_required=True),
        "deploy_create_release",
    )
    hints = tool.annotations
    assert hints is not None
    assert (hints.destructive_hint, hints.idempotent_hint, hints.open_world_hint) == (
        True,
        True,
        True,
    )
    assert tool.input_schema["properties"]["payload"]["type"] == "object"
    assert "approval" in (tool.description or "")


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"target": "web", "payload": {}}, "intent_key"),
        ({"intent_key": " ", "target": "web", "payload": {}}, "intent_key"),
        ({"intent_key": "k", "payload": {}}, "target"),
        ({"intent_key": "k", "target": "web"}, "payload"),
        ({"intent_key": "k", "target": "web", "payload": {}, "amount": 1}, "amount"),
    ],
)
def test_a_call_without_its_intent_is_refused_naming_the_field(
    arguments: dict[str, Any], field: str
) -> None:
    """A missing or blank intent key, a missing target or payload, or an unknown argument is
    refused naming it."""
    with pytest.raises(ArgumentRefused) as refused:
        tool_intent(arguments)
    assert refused.value.field == field


def test_status_takes_one_of_id_and_key_and_list_a_known_state() -> None:
    """outbox_status needs exactly one of operation_id and intent_key; outbox_list a known
    state and a limit from 1 to 100."""
    assert status_query({"intent_key": "k"}).intent_key == "k"
    for wrong in ({}, {"intent_key": "k", "operation_id": "x"}, {"intent_key": "k", "wait_s": -1}):
        with pytest.raises(ArgumentRefused):
            status_query(wrong)
    assert list_query({"state": "needs_human"}).limit == 20
    with pytest.raises(ArgumentRefused) as refused:
        list_query({"state": "lost"})
    assert refused.value.field == "state"
    with pytest.raises(ArgumentRefused):
        list_query({"limit": 0})


def test_differing_paths_name_the_payload_fields_that_differ() -> None:
    """The paths at which two payloads differ, down to nested members and array items."""
    old = {"amount": 5, "items": [{"sku": "a"}, {"sku": "b"}], "note": "x"}
    new = {"amount": 6, "items": [{"sku": "a"}, {"sku": "c"}], "extra": True, "note": "x"}
    assert differing_paths(old, new) == [
        "payload.amount",
        "payload.extra",
        "payload.items.1.sku",
    ]
    assert differing_paths({"n": 1}, {"n": 1.0}) == ["payload.n"]
    assert differing_paths([1], [1, 2]) == ["payload"]


def _server(*contracts: ToolContract) -> Server[Any]:
    table = ContractTable()
    for contract in contracts:
        table.register(contract)
    # Never connected: listing tools and refusing arguments need no database.
    engine = create_async_engine("postgresql+psycopg://nobody@127.0.0.1:1/none")
    return create_server(McpContext(engine=engine, contracts=table, wait_s=1.0, agent="tester"))


def test_the_server_lists_the_loaded_tools_and_refuses_an_unknown_one() -> None:
    """In process, through the SDK's client: the loaded tools, the two reading tools and the
    two saga tools are listed; an unknown tool is a protocol error; a call without a key is a
    tool error."""
    server = _server(ToolContract(name="billing.charge", input_schema=SCHEMA))

    async def session() -> tuple[list[str], str, CallToolResult]:
        async with Client(server) as client:
            names = [tool.name for tool in (await client.list_tools()).tools]
            with pytest.raises(MCPError) as unknown:
                await client.call_tool("billing.refund", {})
            # The registered (dotted) name is understood too.
            keyless = await client.call_tool("billing.charge", {"target": "t", "payload": {}})
            return names, unknown.value.message, keyless

    names, unknown, keyless = asyncio.run(session())
    assert names == [
        "billing_charge",
        "outbox_status",
        "outbox_list",
        "outbox_saga",
        "outbox_saga_status",
    ]
    assert "unknown tool 'billing.refund'" in unknown
    assert keyless.is_error
    body = keyless.structured_content
    assert isinstance(body, dict)
    assert (body["error"], body["field"]) == ("refused", "intent_key")


def test_mcp_names_have_no_dots_and_stay_unique_and_short() -> None:
    """Dots become underscores (clients refuse dotted names); a name taken twice, taken by one
    of the server's own tools, or too long gets a prefix and a hash of its own name, the same
    every time."""
    long = "a" + ".b" * 40
    names = mcp_names(
        ["deploy.create_release", "a.b_c", "a_b.c", "outbox_status", "outbox.saga", long]
    )
    assert names["deploy_create_release"] == "deploy.create_release"
    assert set(names.values()) == {
        "deploy.create_release",
        "a.b_c",
        "a_b.c",
        "outbox_status",
        "outbox.saga",
        long,
    }
    assert "a_b_c" not in names
    assert "outbox_status" not in names
    assert "outbox_saga" not in names  # the server's own saga tool
    assert all(len(name) <= 64 and "." not in name for name in names)
    assert mcp_names(reversed(list(names.values()))) == names


def test_a_tools_own_description_comes_first() -> None:
    """A contract's description leads the MCP tool's description; without one, its name does."""
    described = registered_tool(
        ToolContract(name="billing.charge", description="Charge a card once."), "billing_charge"
    )
    assert (described.description or "").startswith("Charge a card once. ")
    plain = registered_tool(ToolContract(name="billing.charge"), "billing_charge")
    assert (plain.description or "").startswith("The billing.charge action. ")
