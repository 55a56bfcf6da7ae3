"""``outbox.db.wait_for_database`` against a server that says "the database system is starting
up": it tries again with one line per try, then says it is ready.

The first connections reach a listener that answers as PostgreSQL does while it replays its
WAL (an ``ErrorResponse``, FATAL, SQLSTATE 57P03), later ones are forwarded to the real
server: a cluster's start-up window, made as long as the test needs.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from collections.abc import Iterator

import pytest
from sqlalchemy.engine import make_url

from outbox.db import wait_for_database
from outbox.errors import DatabaseUnavailable
from outbox.logs import Action

_SSL_REQUEST = 80877103
_STARTING_UP = b"".join(
    code + text + b"\0"
    for code, text in (
        (b"S", b"FATAL"),
        (b"V", b"FATAL"),
        (b"C", b"57P03"),
        (b"M", b"the database system is starting up"),
    )
)


class StartingUp:
    """127.0.0.1:<port> answering "starting up" to its first ``refusals`` connections, then
    forwarding each connection to ``upstream``."""

    def __init__(self, upstream: tuple[str, int] | str, refusals: int) -> None:
        self.upstream = upstream
        self.refusals = refusals
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.forwarded: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        """Stop listening; close every forwarded connection."""
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for conn in self.forwarded:
            conn.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            if self.refusals > 0:
                self.refusals -= 1
                threading.Thread(target=self._refuse, args=(conn,), daemon=True).start()
            else:
                threading.Thread(target=self._forward, args=(conn,), daemon=True).start()

    @staticmethod
    def _refuse(conn: socket.socket) -> None:
        with conn:
            while True:  # an SSLRequest (answered "no") or a GSSENCRequest, then the startup
                (length,) = struct.unpack("!I", _read(conn, 4))
                body = _read(conn, length - 4)
                if struct.unpack("!I", body[:4])[0] in {_SSL_REQUEST, 80877104}:
                    conn.sendall(b"N")
                    continue
                break
            conn.sendall(b"E" + struct.pack("!I", len(_STARTING_UP) + 5) + _STARTING_UP + b"\0")

    def _forward(self, conn: socket.socket) -> None:
        if isinstance(self.upstream, str):  # the embedded server's Unix socket
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(self.upstream)
        else:
            upstream = socket.create_connection(self.upstream)
        self.forwarded += [conn, upstream]
        for source, sink in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=_pump, args=(source, sink), daemon=True).start()


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@pytest.fixture
def starting_up(database_url: str) -> Iterator[tuple[StartingUp, str]]:
    """The listener in front of the tests' database (3 refusals), and the URL through it."""
    url = make_url(database_url)
    port = url.port or 5432
    socket_dir = url.query.get("host")
    upstream: tuple[str, int] | str = (
        f"{socket_dir}/.s.PGSQL.{port}"
        if isinstance(socket_dir, str)
        else (url.host or "127.0.0.1", port)
    )
    server = StartingUp(upstream, refusals=3)
    through = url.difference_update_query(["host"]).set(host="127.0.0.1", port=server.port)
    try:
        yield server, through.render_as_string(hide_password=False)
    finally:
        server.close()


def test_a_database_starting_up_is_waited_for_one_line_per_try(
    starting_up: tuple[StartingUp, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Three "starting up" answers are three db_waiting lines naming it, then one db_ready."""
    _, url = starting_up
    with caplog.at_level(logging.INFO, logger="outbox.db"):
        wait_for_database(url, timeout_s=60, component="relay")
    records = [r for r in caplog.records if r.name == "outbox.db"]
    actions = [getattr(r, "action", None) for r in records]
    assert actions == [Action.DB_WAITING] * 3 + [Action.DB_READY]
    for try_number, record in enumerate(records[:3], start=1):
        assert record.__dict__["tries"] == try_number
        assert record.__dict__["error"].startswith("OperationalError: ")
        assert "the database system is starting up" in record.__dict__["error"]
        assert "\n" not in record.__dict__["error"]
    assert records[3].__dict__["tries"] == 4


def test_a_database_still_starting_past_the_limit_is_one_clear_error(
    starting_up: tuple[StartingUp, str],
) -> None:
    """With a zero limit, one try: the error names the setting and the server's answer."""
    server, url = starting_up
    with pytest.raises(DatabaseUnavailable) as raised:
        wait_for_database(url, timeout_s=0, component="beat")
    message = str(raised.value)
    assert message.startswith("beat: gave up waiting for the database at ")
    assert "OUTBOX_DB_START_TIMEOUT" in message
    assert "the database system is starting up" in message
    assert "\n" not in message
    assert server.refusals == 2
