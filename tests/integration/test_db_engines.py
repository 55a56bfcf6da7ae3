"""The outbox's engines: libpq's TCP liveness settings reach every connection, unless told."""

from __future__ import annotations

import asyncio

from sqlalchemy import Connection
from sqlalchemy.engine import make_url

from outbox.db import TCP_LIVENESS, create_async_engine, create_engine


def _libpq_options(conn: Connection) -> dict[str, str]:
    """The connection's libpq options as libpq holds them (its conninfo)."""
    pgconn = conn.connection.driver_connection.pgconn  # type: ignore[union-attr]
    return {
        o.keyword.decode(): (o.val or b"").decode()
        for o in pgconn.info
        if o.keyword.decode() in TCP_LIVENESS
    }


def test_an_engine_bounds_how_long_a_silent_server_is_waited_for(database_url: str) -> None:
    """Keepalives after 30 s idle, every 10 s, 3 unanswered and the connection fails; sent
    data unacknowledged for 60 s too: about a minute, where the kernel waits two hours."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            assert _libpq_options(conn) == {k: str(v) for k, v in TCP_LIVENESS.items()}
    finally:
        engine.dispose()


def test_the_url_and_connect_args_keep_their_own_values(database_url: str) -> None:
    """A setting the URL names, or the caller's connect_args, wins over the default."""
    url = make_url(database_url).update_query_dict({"keepalives_idle": "7"})
    engine = create_engine(
        url.render_as_string(hide_password=False), connect_args={"tcp_user_timeout": 5_000}
    )
    try:
        with engine.connect() as conn:
            options = _libpq_options(conn)
    finally:
        engine.dispose()
    assert options["keepalives_idle"] == "7"
    assert options["tcp_user_timeout"] == "5000"
    assert options["keepalives_count"] == str(TCP_LIVENESS["keepalives_count"])


def test_an_async_engine_has_the_same_settings(database_url: str) -> None:
    """create_async_engine's connections carry them too (outbox.aio, the API, the MCP server)."""

    async def options() -> dict[str, str]:
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as conn:
                raw = await conn.get_raw_connection()
                pgconn = raw.driver_connection.pgconn  # type: ignore[union-attr]
                return {
                    o.keyword.decode(): (o.val or b"").decode()
                    for o in pgconn.info
                    if o.keyword.decode() in TCP_LIVENESS
                }
        finally:
            await engine.dispose()

    assert asyncio.run(options()) == {k: str(v) for k, v in TCP_LIVENESS.items()}
