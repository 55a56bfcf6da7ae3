"""A TCP proxy a test can cut: a broker or database outage without touching the real server."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class TcpProxy:
    """Forwards 127.0.0.1:<port> to an upstream port until :meth:`cut`.

    ``cut()`` drops every open connection (a reset) and refuses new ones, as a crashed or
    unreachable server would; ``restore()`` listens again on the same port.
    """

    def __init__(self, upstream_port: int, *, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
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
                upstream = socket.create_connection(self.upstream, timeout=5)
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
