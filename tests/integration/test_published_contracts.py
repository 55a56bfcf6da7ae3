"""enqueue in a process that loads no tools checks the tools the deployment has published."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

import outbox
from outbox import aio, api
from outbox.approval import publish_policies_committed
from outbox.contracts import CONTRACTS, ToolContract
from outbox.db import create_async_engine
from outbox.errors import IntentConflict, InvalidIntent, PayloadInvalid
from outbox.published import PUBLISHED
from tests.factories import operation_count

TOOL = "billing.charge"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"amount": {"type": "integer", "minimum": 1}, "currency": {"type": "string"}},
    "required": ["amount"],
}


@pytest.fixture(autouse=True)
def agent_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process loads no tools, as an agent's does: the published ones decide."""
    monkeypatch.setattr(CONTRACTS, "_contracts", {})
    monkeypatch.setattr(CONTRACTS, "loaded", False)
    PUBLISHED.clear()


def _publish(engine: Engine, *contracts: ToolContract) -> None:
    publish_policies_committed(engine, contracts)


def test_a_typo_in_the_tool_is_refused_naming_the_field_and_writes_nothing(engine: Engine) -> None:
    """With a worker's tools published, enqueue refuses a tool name not among them (field
    "tool", the near name suggested), and enqueue_many names the intent's position."""
    _publish(engine, ToolContract(name=TOOL, input_schema=SCHEMA))
    with Session(engine) as session, session.begin():
        with pytest.raises(InvalidIntent, match=r"unknown tool 'billing\.chrage'") as caught:
            outbox.enqueue(session, tool="billing.chrage", target="acct-1", payload={"amount": 5})
        assert caught.value.field == "tool"
        assert "did you mean 'billing.charge'?" in str(caught.value)
        good = api.Intent(TOOL, "acct-1", {"amount": 5}, "good")
        bad = api.Intent("billing.chrage", "acct-1", {"amount": 5}, "bad")
        with pytest.raises(InvalidIntent, match=r"intent #1: unknown tool") as batch:
            outbox.enqueue_many(session, [good, bad])
        assert batch.value.field == "tool"
    assert operation_count(engine) == 0


def test_a_payload_the_published_schema_refuses_is_refused_naming_the_path(
    engine: Engine,
) -> None:
    """enqueue and enqueue_many check the payload against the tool's published input_schema
    and name the offending path; nothing is written."""
    _publish(engine, ToolContract(name=TOOL, input_schema=SCHEMA))
    with Session(engine) as session, session.begin():
        with pytest.raises(PayloadInvalid, match=r"payload\.amount fails type") as caught:
            outbox.enqueue(session, tool=TOOL, target="acct-1", payload={"amount": "5"})
        assert (caught.value.field, caught.value.keyword) == ("payload.amount", "type")
        with pytest.raises(PayloadInvalid, match=r"intent #0: .*payload\.amount is required"):
            outbox.enqueue_many(session, [api.Intent(TOOL, "acct-1", {"currency": "EUR"})])
    assert operation_count(engine) == 0


def test_the_async_api_refuses_the_same_way(engine: Engine, database_url: str) -> None:
    """outbox.aio.enqueue refuses the unknown tool and the refused payload alike, writing
    nothing."""
    _publish(engine, ToolContract(name=TOOL, input_schema=SCHEMA))

    async def body() -> tuple[InvalidIntent, InvalidIntent]:
        aengine = create_async_engine(database_url, pool_size=1, max_overflow=0)
        try:
            async with aengine.begin() as conn:
                with pytest.raises(InvalidIntent) as tool:
                    await aio.enqueue(conn, tool="billing.chrage", target="a", payload={})
            async with aengine.begin() as conn:
                with pytest.raises(PayloadInvalid) as payload:
                    await aio.enqueue(conn, tool=TOOL, target="a", payload={"amount": 0})
            return tool.value, payload.value
        finally:
            await aengine.dispose()

    tool, payload = asyncio.run(body())
    assert (tool.field, payload.field) == ("tool", "payload.amount")
    assert operation_count(engine) == 0


def test_a_saga_step_for_an_unpublished_tool_is_refused(engine: Engine) -> None:
    """A saga's step goes through the same check: an unknown tool is refused, nothing written."""
    _publish(engine, ToolContract(name=TOOL))
    with Session(engine) as session, session.begin():
        saga = outbox.saga(session, "order-1")
        with pytest.raises(InvalidIntent) as caught:
            saga.step("charge", tool="billing.chrage", target="acct-1", payload={"amount": 5})
        assert caught.value.field == "tool"
    assert operation_count(engine) == 0


def test_nothing_published_accepts_any_tool(engine: Engine) -> None:
    """A deployment that has published nothing (no worker started) accepts any tool as before."""
    with Session(engine) as session, session.begin():
        op = outbox.enqueue(session, tool="billing.chrage", target="acct-1", payload={"x": 1})
    assert op.tool == "billing.chrage"
    assert operation_count(engine) == 1


def test_a_tool_published_after_the_cache_was_filled_is_accepted_at_once(engine: Engine) -> None:
    """A tool missing from the kept snapshot is looked up again, so a worker that just started
    has its tools accepted at their first enqueue."""
    _publish(engine, ToolContract(name=TOOL))
    with Session(engine) as session, session.begin():
        outbox.enqueue(session, tool=TOOL, target="acct-1", payload={"amount": 1})
    _publish(engine, ToolContract(name="mail.send"))
    with Session(engine) as session, session.begin():
        op = outbox.enqueue(session, tool="mail.send", target="a@example.com", payload={})
    assert op.tool == "mail.send"


def test_a_refusal_is_never_decided_on_a_kept_snapshot(engine: Engine) -> None:
    """A payload the kept (older, stricter) schema refuses is accepted when the schema
    published now accepts it: refusals are checked against a fresh read."""
    _publish(engine, ToolContract(name=TOOL, input_schema=SCHEMA))
    with Session(engine) as session, session.begin():
        outbox.enqueue(session, tool=TOOL, target="acct-1", payload={"amount": 1})
    _publish(engine, ToolContract(name=TOOL, input_schema={"type": "object"}))
    with Session(engine) as session, session.begin():
        op = outbox.enqueue(session, tool=TOOL, target="acct-1", payload={"amount": "any"})
    assert op.payload == {"amount": "any"}


def test_known_tool_reads_the_published_tools(engine: Engine) -> None:
    """The HTTP API's check (known_tool) and enqueue read the same published contracts."""
    with engine.connect() as conn:
        assert not api.known_tool(conn, TOOL)
    _publish(engine, ToolContract(name=TOOL))
    with engine.connect() as conn:
        assert api.known_tool(conn, TOOL)
        assert not api.known_tool(conn, "billing.chrage")


def test_a_conflict_names_the_payload_field_that_differs(engine: Engine) -> None:
    """An intent key reused with another payload is refused naming the payload's own field
    (payload.amount), as the MCP server words it."""
    with Session(engine) as session, session.begin():
        outbox.enqueue(
            session,
            tool=TOOL,
            target="acct-1",
            payload={"amount": 5, "currency": "EUR"},
            intent_key="charge-1",
        )
    with (
        Session(engine) as session,
        session.begin(),
        pytest.raises(IntentConflict, match=r"different payload\.amount;") as caught,
    ):
        outbox.enqueue(
            session,
            tool=TOOL,
            target="acct-1",
            payload={"amount": 6, "currency": "EUR"},
            intent_key="charge-1",
        )
    assert caught.value.differences == ("payload",)
    assert caught.value.fields == ("payload.amount",)
    assert operation_count(engine) == 1
