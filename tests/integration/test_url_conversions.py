"""One outbox database URL serves the outbox and LangGraph's Postgres savers, on a server
reached through its Unix socket directory (the embedded server's ``?host=/path`` URLs)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from sqlalchemy import text
from sqlalchemy.engine import make_url

from outbox import embedded
from outbox.db import create_engine
from outbox.urls import libpq_url


@pytest.fixture(scope="module")
def socket_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A throw-away embedded PostgreSQL's URL (``postgresql+psycopg://…?host=<socket dir>``),
    its socket directory reached through a path with a space (as under "Application Support");
    the server is stopped at the end of the module."""
    home = tmp_path_factory.mktemp("socket-url")
    url = make_url(embedded.ensure_running(home))
    try:
        spaced = home / "with space"
        spaced.symlink_to(str(url.query["host"]), target_is_directory=True)
        yield url.update_query_dict({"host": str(spaced)}).render_as_string(hide_password=False)
    finally:
        embedded.stop(home)


@pytest.mark.parametrize("scheme", ["postgresql+psycopg", "postgresql", "postgres"])
def test_the_outbox_connects_with_every_spelling_of_a_socket_url(
    socket_url: str, scheme: str
) -> None:
    """create_engine connects through the socket directory whichever scheme the URL has."""
    url = socket_url.replace("postgresql+psycopg", scheme, 1)
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT current_user")).scalar() == "postgres"
    finally:
        engine.dispose()


def test_postgres_saver_connects_with_the_converted_socket_url(socket_url: str) -> None:
    """PostgresSaver sets up its tables and reads a thread through libpq_url(the socket URL)."""
    with PostgresSaver.from_conn_string(libpq_url(socket_url)) as saver:
        saver.setup()
        assert saver.get_tuple({"configurable": {"thread_id": "nobody"}}) is None


def test_async_postgres_saver_connects_with_the_converted_socket_url(socket_url: str) -> None:
    """AsyncPostgresSaver sets up its tables and reads a thread through libpq_url(the socket
    URL)."""

    async def main() -> None:
        async with AsyncPostgresSaver.from_conn_string(libpq_url(socket_url)) as saver:
            await saver.setup()
            assert await saver.aget_tuple({"configurable": {"thread_id": "nobody"}}) is None

    asyncio.run(main())
