"""Log lines operators can grep: every line carries an ``action`` (``dispatch_sent``, …).

Components log with ``extra={"action": "...", **fields}``; :func:`configure` renders
``time level action message key=value…`` on stderr. Secrets never reach a log line: URLs are
redacted where they are formatted (``outbox.db.redact``) and headers are never logged.
"""

from __future__ import annotations

import logging
import sys

# Attributes every LogRecord has; anything else came from `extra=` and is printed as a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class ActionFormatter(logging.Formatter):
    """``2026-11-29T10:00:00 INFO dispatch_sent message key=value …``."""

    def format(self, record: logging.LogRecord) -> str:
        """Render the record with its action and extra fields."""
        action = getattr(record, "action", record.name)
        fields = " ".join(
            f"{key}={value}"
            for key, value in vars(record).items()
            if key not in _STANDARD and key != "action"
        )
        line = f"{self.formatTime(record)} {record.levelname} {action} {record.getMessage()}"
        if fields:
            line += f" {fields}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(level: int | str = logging.INFO) -> None:
    """Send the outbox's logs to stderr in the action format (idempotent)."""
    root = logging.getLogger()
    if any(isinstance(h.formatter, ActionFormatter) for h in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(ActionFormatter())
    root.addHandler(handler)
    root.setLevel(level)
    # httpx logs every request with its full URL, which may carry a receiver's token.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
