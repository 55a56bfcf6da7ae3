"""The socket `outbox api` and `outbox mcp --http` hand to uvicorn."""

from __future__ import annotations

import socket

from outbox.cli.apiserver import bind_socket


def test_the_printed_address_takes_connections_before_uvicorn_starts() -> None:
    """The URL is printed before uvicorn's start-up: a client quicker than it must be queued by
    the kernel, not refused (a CI run lost a test to that window)."""
    listening = bind_socket("127.0.0.1", 0)
    try:
        with socket.create_connection(listening.getsockname(), timeout=2) as client:
            accepted, _ = listening.accept()
            with accepted:
                client.sendall(b"ping")
                assert accepted.recv(4) == b"ping"
    finally:
        listening.close()
