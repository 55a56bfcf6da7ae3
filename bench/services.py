"""The reference service (:class:`DeployService`) in a process of its own, driven over a pipe."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
from typing import Any


def _serve(conn: multiprocessing.connection.Connection, options: dict[str, Any]) -> None:
    """The child: run a DeployService and answer method calls from the pipe until "stop"."""
    from outbox.dev.service import DeployService  # noqa: PLC0415 -- in the child

    with DeployService(**options) as service:
        conn.send(service.url)
        while True:
            try:
                method, args = conn.recv()
            except EOFError:  # the parent died
                return
            if method == "stop":
                conn.send(None)
                return
            conn.send(getattr(service, method)(*args))


class ServiceProcess:
    """The reference service (:class:`DeployService`) in a child process, driven over a pipe.

    Its own interpreter, so its GIL is not the agents'; like a real remote, it shares only
    the machine. ``options`` are DeployService's keyword arguments.
    """

    def __init__(self, **options: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child, options), name="deploy-service", daemon=True
        )
        self.process.start()
        child.close()
        if not self._conn.poll(30):
            self.process.kill()
            raise RuntimeError("the reference service did not start within 30 s")
        self.url: str = self._conn.recv()

    @property
    def pid(self) -> int:
        """The child's process id."""
        assert self.process.pid is not None  # noqa: S101 -- started in __init__
        return self.process.pid

    def call(self, method: str, *args: Any) -> Any:
        """``service.<method>(*args)`` in the child; its result."""
        self._conn.send((method, args))
        return self._conn.recv()

    def arrivals(self) -> dict[str, float]:
        """Key -> wall time of its first create request."""
        result: dict[str, float] = self.call("arrivals")
        return result

    def effects_by_key(self) -> dict[str, int]:
        """Key -> effects committed."""
        result: dict[str, int] = self.call("effects_by_key")
        return result

    def clear(self) -> None:
        """Forget every effect and arrival."""
        self.call("clear")

    def stop(self) -> None:
        """Stop the service and its process."""
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError):
                self._conn.send(("stop", ()))
                self._conn.recv()
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
