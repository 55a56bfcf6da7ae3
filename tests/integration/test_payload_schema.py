"""enqueue checks a payload against its tool's input_schema where the tool is known."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import aio, api
from outbox.contracts import CONTRACTS, ToolContract
from outbox.db import create_async_engine
from outbox.errors import PayloadInvalid
from tests.factories import operation_count

TOOL = "billing.charge"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"amount": {"type": "integer", "minimum": 1}},
    "required": ["amount"],
}


@pytest.fixture(autouse=True)
def contract(monkeypatch: pytest.MonkeyPatch) -> ToolContract:
    """TOOL's contract, with its schema, known to this process for this test only."""
    declared = ToolContract(name=TOOL, input_schema=SCHEMA)
    monkeypatch.setitem(CONTRACTS._contracts, TOOL, declared)
    return declared


def test_a_matching_payload_is_enqueued(engine: Engine) -> None:
    """A payload that matches the schema is written as usual."""
    with Session(engine) as session, session.begin():
        op = api.enqueue(session, tool=TOOL, target="acct-1", payload={"amount": 5})
    assert op.payload == {"amount": 5}
    assert operation_count(engine) == 1


def test_a_mismatch_is_refused_naming_the_field_and_writes_nothing(engine: Engine) -> None:
    """enqueue and enqueue_many refuse a payload that fails the schema with the path; no row."""
    with Session(engine) as session, session.begin():
        with pytest.raises(PayloadInvalid, match=r"payload\.amount fails minimum: 1") as caught:
            api.enqueue(session, tool=TOOL, target="acct-1", payload={"amount": 0})
        assert (caught.value.field, caught.value.keyword) == ("payload.amount", "minimum")
        good = api.Intent(TOOL, "acct-1", {"amount": 1}, "good")
        bad = api.Intent(TOOL, "acct-1", {}, "bad")
        with pytest.raises(PayloadInvalid, match=r"payload\.amount is required"):
            api.enqueue_many(session, [good, bad])
    assert operation_count(engine) == 0


def test_the_async_api_refuses_the_same_way(engine: Engine, database_url: str) -> None:
    """outbox.aio shares the check: the same refusal, nothing written."""

    async def body() -> None:
        aengine = create_async_engine(database_url, pool_size=1, max_overflow=0)
        try:
            async with aengine.connect() as conn, conn.begin():
                with pytest.raises(PayloadInvalid) as caught:
                    await aio.enqueue(conn, tool=TOOL, target="acct-1", payload={"amount": "5"})
            assert caught.value.field == "payload.amount"
        finally:
            await aio.close()
            await aengine.dispose()

    asyncio.run(body())
    assert operation_count(engine) == 0


def test_a_tool_without_a_schema_takes_any_object(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without input_schema, any JSON object is accepted."""
    monkeypatch.setitem(CONTRACTS._contracts, TOOL, ToolContract(name=TOOL))
    with Session(engine) as session, session.begin():
        api.enqueue(session, tool=TOOL, target="acct-1", payload={"anything": ["goes"]})
    assert operation_count(engine) == 1
