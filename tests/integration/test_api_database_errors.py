"""Every public function of outbox and outbox.aio raises SchemaNotReady on a database without
the schema and DatabaseUnavailable on one it cannot reach, never a driver's error."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

import outbox
from outbox import aio
from outbox.contracts import CONTRACTS
from outbox.db import create_async_engine, create_engine
from outbox.errors import DatabaseUnavailable, SchemaNotReady
from outbox.models import Executor
from outbox.published import PUBLISHED
from tests.conftest import Databases

OP = uuid.UUID("01900000-0000-7000-8000-000000000001")
#: Nothing listens on the discard port: the connection is refused at once.
UNREACHABLE = "postgresql://postgres@127.0.0.1:9/outbox"

CALLS: dict[str, Callable[[Executor], Any]] = {
    "enqueue": lambda c: outbox.enqueue(c, tool="billing.charge", target="a", payload={}),
    "enqueue_many": lambda c: outbox.enqueue_many(
        c, [outbox.Intent("billing.charge", "a", {}, "k")]
    ),
    "get": lambda c: outbox.get(c, OP),
    "find": lambda c: outbox.find(c, "k"),
    "cancel": lambda c: outbox.cancel(c, OP),
    "resolve": lambda c: outbox.resolve(c, OP, applied=False, by="ops", note="checked"),
    "approve": lambda c: outbox.approve(c, OP, by="ops", payload_hash="ab" * 32),
    "reject": lambda c: outbox.reject(c, OP, by="ops", reason="no"),
    "saga": lambda c: outbox.saga(c, "order-1"),
    "declare_saga": lambda c: outbox.declare_saga(
        c, "order-1", [outbox.StepSpec("charge", "billing.charge", "a", {})]
    ),
    "get_saga": lambda c: outbox.get_saga(c, "order-1"),
    "list_sagas": outbox.list_sagas,
    "cancel_saga": lambda c: outbox.cancel_saga(c, "order-1", by="ops", reason="no"),
}

ASYNC_CALLS: dict[str, Callable[[AsyncConnection], Any]] = {
    "aio.enqueue": lambda c: aio.enqueue(c, tool="billing.charge", target="a", payload={}),
    "aio.enqueue_many": lambda c: aio.enqueue_many(
        c, [outbox.Intent("billing.charge", "a", {}, "k")]
    ),
    "aio.get": lambda c: aio.get(c, OP),
    "aio.find": lambda c: aio.find(c, "k"),
    "aio.cancel": lambda c: aio.cancel(c, OP),
    "aio.approve": lambda c: aio.approve(c, OP, by="ops", payload_hash="ab" * 32),
    "aio.saga": lambda c: aio.saga(c, "order-1"),
    "aio.list_sagas": aio.list_sagas,
}


@pytest.fixture(autouse=True)
def agent_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process loads no tools, as an agent's does (enqueue then reads the database)."""
    monkeypatch.setattr(CONTRACTS, "loaded", False)
    PUBLISHED.clear()


@pytest.fixture(scope="module")
def empty_url(databases: Databases) -> str:
    """A database with no outbox schema at all (never migrated)."""
    return databases.create()


@pytest.fixture(scope="module")
def empty_engine(empty_url: str) -> Iterator[Engine]:
    engine = create_engine(empty_url, pool_size=2)
    yield engine
    engine.dispose()


@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_function_raises_schema_not_ready_on_an_empty_database(
    empty_engine: Engine, name: str
) -> None:
    """The function raises SchemaNotReady (from the driver's error) naming `outbox db upgrade`."""
    with empty_engine.connect() as conn, pytest.raises(SchemaNotReady) as caught:
        CALLS[name](conn)
    assert "outbox db upgrade" in str(caught.value)
    assert caught.value.__cause__ is not None


def test_wait_raises_schema_not_ready_on_an_empty_database(empty_engine: Engine) -> None:
    """outbox.wait raises SchemaNotReady on a database without the schema."""
    with pytest.raises(SchemaNotReady):
        outbox.wait(OP, timeout=1, engine=empty_engine)


@pytest.mark.parametrize("name", sorted(ASYNC_CALLS))
def test_each_async_function_raises_schema_not_ready_on_an_empty_database(
    empty_url: str, name: str
) -> None:
    """The asyncio twin raises SchemaNotReady too."""

    async def body() -> None:
        engine = create_async_engine(empty_url, pool_size=1, max_overflow=0)
        try:
            async with engine.connect() as conn:
                await ASYNC_CALLS[name](conn)
        finally:
            await engine.dispose()

    with pytest.raises(SchemaNotReady):
        asyncio.run(body())


def test_async_wait_raises_schema_not_ready_on_an_empty_database(empty_url: str) -> None:
    """outbox.aio.wait raises SchemaNotReady on a database without the schema."""

    async def body() -> None:
        try:
            await aio.wait(OP, timeout=1, engine=empty_url)
        finally:
            await aio.close()

    with pytest.raises(SchemaNotReady):
        asyncio.run(body())


@pytest.mark.parametrize("name", ["enqueue", "get", "find", "cancel", "saga"])
def test_an_unreachable_database_raises_database_unavailable(name: str) -> None:
    """A database that cannot be reached (the session connects inside the call) raises
    DatabaseUnavailable, not a driver's error."""
    engine = create_engine(UNREACHABLE)
    try:
        with Session(engine) as session, pytest.raises(DatabaseUnavailable, match="cannot reach"):
            CALLS[name](session)
    finally:
        engine.dispose()


def test_wait_on_an_unreachable_database_raises_database_unavailable() -> None:
    """outbox.wait and outbox.aio's enqueue and wait raise DatabaseUnavailable when the
    database cannot be reached."""
    engine = create_engine(UNREACHABLE)
    try:
        with pytest.raises(DatabaseUnavailable):
            outbox.wait(OP, timeout=1, engine=engine)
    finally:
        engine.dispose()

    async def body() -> None:
        aengine = create_async_engine(UNREACHABLE)
        try:
            async with AsyncSession(aengine) as session:
                await aio.enqueue(session, tool="billing.charge", target="a", payload={})
        finally:
            await aengine.dispose()

    with pytest.raises(DatabaseUnavailable):
        asyncio.run(body())
