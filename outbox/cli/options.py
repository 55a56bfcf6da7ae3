"""Options several commands share, with their choices, so a bad value is a usage error.

Click checks a choice before the command runs: ``--log-level LOUD`` or ``--pool fibers`` is
one ``error:`` line and exit 2 (see :func:`outbox.cli.main`), never a traceback from Celery
or logging. Values that need parsing (durations, JSON) raise :class:`typer.BadParameter` from
a callback for the same reason.
"""

from __future__ import annotations

import enum
from typing import Annotated

import typer

from outbox import logs
from outbox.config import get_settings, load_settings


class LogLevel(enum.StrEnum):
    """``--log-level``, in any case on the command line."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


class Pool(enum.StrEnum):
    """``worker --pool``: Celery's execution pools the outbox supports."""

    PREFORK = "prefork"  #: processes: a hung or leaking tool cannot take its siblings down
    THREADS = "threads"  #: threads: cheaper per slot, for I/O-bound tools
    SOLO = "solo"  #: one task at a time in the worker's own process (debugging)


#: The queues a worker can consume (``outbox.workers.app.QUEUES``, without importing Celery).
QUEUE_NAMES = ("dispatch", "lookup", "reconcile", "human")

LogLevelOption = Annotated[
    LogLevel, typer.Option("--log-level", case_sensitive=False, help="Log level (any case).")
]


def start_logging(level: LogLevel) -> None:
    """Log in OUTBOX_LOG_FORMAT at ``level``, then read the settings: their warnings (an
    unknown ``OUTBOX_*`` variable) come out in that format too."""
    # Alembic logs its plugins' set-up (INFO) when imported: imported before the handlers
    # exist, as when every command imported it with its module, those lines stay unprinted.
    import outbox.migrate  # noqa: F401, PLC0415

    logs.configure(level.value, load_settings().log_format)
    get_settings()


def queue_list(value: str) -> str:
    """``-Q``: comma-separated known queue names, or a usage error naming the unknown one."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in QUEUE_NAMES]
    if not names or unknown:
        raise typer.BadParameter(
            f"unknown queue {', '.join(map(repr, unknown)) or repr(value)}; "
            f"choose from {', '.join(QUEUE_NAMES)}"
        )
    return ",".join(names)
