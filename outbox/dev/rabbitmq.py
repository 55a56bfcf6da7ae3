"""A RabbitMQ node of one's own, that a chaos run may restart without disturbing anyone.

``rabbitmqctl stop_app`` drops every connection of a node: done to the machine's broker, it
would disturb every other user of it (a production outbox, a colleague's tests). So the chaos
run starts a node of its own: its own node name (``outbox-chaos-<hex>@localhost``), AMQP and
distribution ports (free ones, on 127.0.0.1), Erlang cookie (``HOME`` is its directory),
configuration, data (``RABBITMQ_MNESIA_BASE``) and logs, all under a directory of the caller's;
``rabbitmqctl -n <its name>`` restarts it and ``stop()`` halts it. Only the machine's ``epmd``
(the Erlang port mapper, which any node registers with) is shared.

It needs the RabbitMQ server installed (``rabbitmq-server`` and ``rabbitmqctl`` on ``PATH``),
but no node running. Debian's packages put a wrapper on ``PATH`` that runs the real scripts
as the ``rabbitmq`` user, from its home; this module calls the real scripts beside it, as the
current user, so every file stays in the caller's directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

from outbox.dev.clusters import free_port
from outbox.errors import DatabaseUnavailable

#: The file Debian's ``rabbitmq-server`` and ``rabbitmqctl`` on ``PATH`` resolve to.
_DEBIAN_WRAPPER = "rabbitmq-script-wrapper"


def rabbitmq_script(name: str) -> Path | None:
    """The RabbitMQ script ``name`` (``rabbitmq-server``, ``rabbitmqctl``) to run, or None.

    Found on ``PATH``; a Debian wrapper is replaced by the real script in its directory.
    """
    found = shutil.which(name)
    if found is None:
        return None
    resolved = Path(found).resolve()
    if resolved.name == _DEBIAN_WRAPPER:
        real = resolved.parent / name
        return real if real.exists() else None
    return Path(found)


def rabbitmq_installed() -> bool:
    """Whether this machine can start a RabbitMQ node of its own."""
    return (
        rabbitmq_script("rabbitmq-server") is not None
        and rabbitmq_script("rabbitmqctl") is not None
    )


class RabbitNode:
    """A RabbitMQ node of one's own under ``root``; see the module doc."""

    def __init__(self, root: Path) -> None:
        server, ctl = rabbitmq_script("rabbitmq-server"), rabbitmq_script("rabbitmqctl")
        if server is None or ctl is None:
            raise DatabaseUnavailable(
                "no rabbitmq-server and rabbitmqctl on PATH: cannot start a RabbitMQ node"
            )
        self.root = root.resolve()
        self.name = f"outbox-chaos-{uuid.uuid4().hex[:8]}@localhost"
        self.port = free_port()
        self.dist_port = free_port()
        self._server = server
        self._ctl = ctl

    @property
    def url(self) -> str:
        """The AMQP URL of its default vhost (user ``guest``, allowed from 127.0.0.1)."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the node in the background and wait until it accepts AMQP connections."""
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{self.port}\n", encoding="utf-8"
        )
        (self.root / "rabbitmq-env.conf").write_text("", encoding="utf-8")  # not /etc's
        (self.root / "enabled_plugins").write_text("[].\n", encoding="utf-8")
        subprocess.run(  # noqa: S603 -- the installed RabbitMQ script, our own arguments
            [str(self._server), "-detached"],
            env=self._env(),
            cwd=self.root,
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + timeout_s
        while not self._started():
            if time.monotonic() > deadline:
                raise DatabaseUnavailable(
                    f"the RabbitMQ node {self.name} did not start in {timeout_s:g}s "
                    f"(logs in {self.root / 'log'})"
                )
            time.sleep(0.5)

    def stop_app(self) -> None:
        """Stop the RabbitMQ application (every connection drops); the node stays up."""
        self._rabbitmqctl("stop_app")

    def start_app(self) -> None:
        """Start the RabbitMQ application again after :meth:`stop_app`."""
        self._rabbitmqctl("start_app")

    def stop(self) -> None:
        """Halt the node (its Erlang VM too); nothing if it is not running."""
        pid_file = self.root / "rabbitmq.pid"
        stopped = subprocess.run(  # noqa: S603 -- see start
            [str(self._ctl), "-n", self.name, "stop", str(pid_file)],  # waits for the VM to end
            env=self._env(),
            cwd=self.root,
            check=False,
            capture_output=True,
            timeout=120,
        )
        if stopped.returncode == 0:
            return
        # A VM that would not halt (it never finished booting) must not outlive the run; the
        # pid is killed only while its command line still names this node.
        with contextlib.suppress(ValueError, OSError):
            pid = int(pid_file.read_text().strip())
            if self.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)

    def _started(self) -> bool:
        # await_startup fails at once while the node has not registered with epmd yet.
        done = subprocess.run(  # noqa: S603 -- see start
            [str(self._ctl), "-n", self.name, "await_startup", "--timeout", "10"],
            env=self._env(),
            cwd=self.root,
            check=False,
            capture_output=True,
            timeout=60,
        )
        if done.returncode != 0:
            return False
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return True
        except OSError:
            return False

    def _rabbitmqctl(self, command: str) -> None:
        subprocess.run(  # noqa: S603 -- see start
            [str(self._ctl), "-n", self.name, command],
            env=self._env(),
            cwd=self.root,
            check=True,
            capture_output=True,
            timeout=120,
        )

    def _env(self) -> dict[str, str]:
        """Everything the scripts read, pointed at this node's own files and ports."""
        root = self.root
        return {
            **{k: v for k, v in os.environ.items() if not k.startswith(("RABBITMQ_", "ERL_"))},
            "HOME": str(root),  # its own Erlang cookie: rabbitmqctl reaches only this node
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONF_ENV_FILE": str(root / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(root / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(root / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(root / "mnesia"),
            "RABBITMQ_LOG_BASE": str(root / "log"),
            "RABBITMQ_PID_FILE": str(root / "rabbitmq.pid"),
            "RABBITMQ_PLUGINS_EXPAND_DIR": str(root / "plugins-expand"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }
