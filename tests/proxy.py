"""A TCP proxy a test can cut: a broker or database outage without touching the real server."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from pathlib import Path

from sqlalchemy import make_url


class TcpProxy:
    """Forwards 127.0.0.1:<port> to an upstream port (or a Unix socket) until :meth:`cut`.

    ``cut()`` drops every open connection (a reset) and refuses new ones, as a crashed or
    unreachable server would; ``restore()`` listens again on the same port.
    """

    def __init__(
        self,
        upstream_port: int,
        *,
        upstream_host: str = "127.0.0.1",
        upstream_socket: Path | None = None,
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.upstream_socket = upstream_socket
        self.port = 0
        self._listener: socket.socket | None = None
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> TcpProxy:
        """Listen (on a free port the first time, on the same port after a cut)."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("127.0.0.1", self.port))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def cut(self) -> None:
        """Reset every connection and refuse new ones."""
        with self._lock:
            listener, self._listener = self._listener, None
            connections, self._connections = self._connections, []
        if listener is not None:
            # shutdown() wakes the thread blocked in accept(); close() alone would leave the
            # port bound until that accept returned.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for conn in connections:
            with contextlib.suppress(OSError):
                # Linger 0: close with a reset, as a crashed peer's kernel would.
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            with contextlib.suppress(OSError):
                # shutdown() first: close() alone does not wake a pump blocked in recv() on
                # this socket, whose in-flight call keeps it open, so a client waiting for an
                # answer already sent upstream would wait forever instead of being reset.
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def restore(self) -> None:
        """Accept connections again on the same port."""
        self.start()

    def stop(self) -> None:
        """Cut everything for good."""
        self.cut()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # the listener was closed by cut()
            try:
                upstream = self._connect_upstream()
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._connections += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _connect_upstream(self) -> socket.socket:
        if self.upstream_socket is None:
            return socket.create_connection(self.upstream, timeout=5)
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.settimeout(5)
        try:
            upstream.connect(str(self.upstream_socket))
        except OSError:
            upstream.close()
            raise
        return upstream

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def database_proxy(database_url: str) -> tuple[TcpProxy, str]:
    """A started :class:`TcpProxy` in front of the PostgreSQL of ``database_url``, and the URL
    of the same database through it (TCP on 127.0.0.1).

    The server may listen on TCP (the machine's PostgreSQL) or on a Unix socket only (the
    embedded one, whose URL names its socket directory in ``?host=``): either way the test
    gets a TCP connection it can cut.
    """
    url = make_url(database_url)
    socket_dir = url.query.get("host")
    port = url.port or 5432
    if isinstance(socket_dir, str) and socket_dir.startswith("/"):
        proxy = TcpProxy(port, upstream_socket=Path(socket_dir) / f".s.PGSQL.{port}")
    else:
        proxy = TcpProxy(port, upstream_host=url.host or "127.0.0.1")
    proxy.start()
    query = {name: value for name, value in url.query.items() if name != "host"}
    through = url.set(host="127.0.0.1", port=proxy.port, query=query)
    return proxy, through.render_as_string(hide_password=False)
