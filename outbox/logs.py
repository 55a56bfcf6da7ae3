"""Log lines operators can grep: every line carries an ``action`` (``dispatch_sent``, …).

Components log with ``extra={"action": Action.X, **fields}``: every action is a member of
:class:`Action`, so grepping an action's name finds the code that logs it, and a test checks
that no module logs an action outside the catalogue. :func:`configure` renders
each line on stderr as logfmt (``time=2026-11-29T10:00:00.000Z level=info
action=dispatch_sent msg="…" operation_id=…``), or as one JSON object with
``OUTBOX_LOG_FORMAT=json``; times are UTC. Secrets never reach a log line: URLs are
redacted where they are formatted (``outbox.db.redact``) and headers are never logged.

No value can forge a line or drive a terminal: every control character (C0 but the newline,
which both renderers escape, DEL, C1, U+2028 and U+2029) of every key and value is written
as an escape (``\\r``, ``\\x1b``, ``\\u2028``) by the formatter, whichever the format.
"""

from __future__ import annotations

import enum
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from structlog.typing import EventDict, Processor

# psycopg, SQLAlchemy and structlog are imported where a line is described or rendered, not
# with this module: the settings import it for its enums, and `outbox relay --help` needs
# the settings, not a logger (issue 33).


class Action(enum.StrEnum):
    """Every ``action`` a log line can carry; the value is what operators grep for."""

    # Guards (outbox.guard_state): circuit breakers, rate limits, concurrency caps
    GUARD_PROBE = "guard_probe"  #: a half-open breaker let one probe through
    GUARD_OPENED = "guard_opened"
    GUARD_CLOSED = "guard_closed"
    GUARD_RESET = "guard_reset"
    # Relay (outbox.relay, outbox relay)
    RELAY_STARTED = "relay_started"
    RELAY_STOPPING = "relay_stopping"  #: asked to stop: finishes the batch in hand
    RELAY_STOPPED = "relay_stopped"
    RELAY_PUBLISHED = "relay_published"
    RELAY_ERROR = "relay_error"
    #: standing by while workers take due operations directly, or back to claiming at once
    RELAY_STANDBY = "relay_standby"
    BROKER_PRUNED = "broker_pruned"  #: messages of pruned operations dropped from the broker

    # Dispatch (outbox.workers)
    WORKER_REFUSED = "worker_refused"  #: a worker refused to start (bad configuration)
    TOOLS_LOADED = "tools_loaded"
    DISPATCH_SENT = "dispatch_sent"
    DISPATCH_HELD = "dispatch_held"  #: a guard held it back: still planned, no attempt
    DISPATCH_CONFIRMED = "dispatch_confirmed"
    DISPATCH_FAILED = "dispatch_failed"
    DISPATCH_UNKNOWN = "dispatch_unknown"
    DISPATCH_REPLANNED = "dispatch_replanned"
    DISPATCH_LOST = "dispatch_lost"  #: found in `sent`: its dispatcher died
    DISPATCH_NEEDS_HUMAN = "dispatch_needs_human"
    #: its tool requires approval and the row had none: back to `awaiting_approval`, not sent
    DISPATCH_AWAITING_APPROVAL = "dispatch_awaiting_approval"
    TOOL_POLICIES_PUBLISHED = "tool_policies_published"  #: approval policies written
    BUDGETS_PUBLISHED = "budgets_published"  #: declared budgets written to outbox.budgets
    BUDGET_EXCEEDED = "budget_exceeded"  #: an enqueue refused over a budget; nothing written
    BUDGET_ALERT_FAILED = "budget_alert_failed"  #: the exhaustion alert could not be written
    # Sagas (outbox.sagas, outbox.reconcilers.sagas)
    SAGA_MOVED = "saga_moved"  #: a saga changed state (completed, compensating, ...)
    SAGA_STEP_RELEASED = "saga_step_released"  #: a held step was released: due now
    SAGA_COMPENSATION_STARTED = "saga_compensation_started"  #: a step's undo was recorded
    SAGA_ADVANCE_FAILED = "saga_advance_failed"  #: advancing one saga raised; the pass went on
    DISPATCH_LATE = "dispatch_late"  #: the outcome arrived after the row moved on
    DISPATCH_OUTCOME_UNRECORDED = "dispatch_outcome_unrecorded"
    DISPATCH_UNKNOWN_OPERATION = "dispatch_unknown_operation"  #: no such row (other deployment?)
    DISPATCH_ERROR = "dispatch_error"
    DISPATCH_DROPPED = "dispatch_dropped"
    DISPATCH_HANDED_BACK = "dispatch_handed_back"
    DISPATCH_HAND_BACK_FAILED = "dispatch_hand_back_failed"
    TOOL_CALL_ABANDONED = "tool_call_abandoned"
    #: a task met a database error (a restart): one line, its class and message, no statement
    TASK_DATABASE_ERROR = "task_database_error"
    BEAT_RECONNECT = "beat_reconnect"

    # Sweep and reconciliation (outbox.reconcilers)
    SWEEP_DONE = "sweep_done"
    SWEEP_SKIPPED = "sweep_skipped"  #: another sweep holds the sweep lock
    SWEEP_UNKNOWN = "sweep_unknown"  #: `sent` too long, lock free: moved to `unknown`
    SWEEP_NEEDS_HUMAN = "sweep_needs_human"  #: `sent` too long, lock still held
    SWEEP_ROW_FAILED = "sweep_row_failed"
    SWEEP_ROW_FAILURE_UNRECORDED = "sweep_row_failure_unrecorded"
    SWEEP_ROW_ESCALATED = "sweep_row_escalated"
    SWEEP_APPROVAL_EXPIRED = "sweep_approval_expired"  #: approvals past their TTL: cancelled
    RECONCILE_LOOKUP = "reconcile_lookup"
    RECONCILE_REPLAY = "reconcile_replay"
    RECONCILE_WAIT = "reconcile_wait"
    RECONCILE_HUMAN = "reconcile_human"
    LOOKUP_CONFIRMED = "lookup_confirmed"
    LOOKUP_FAILED = "lookup_failed"
    LOOKUP_PLANNED = "lookup_planned"  #: provably not applied: planned again
    LOOKUP_NEEDS_HUMAN = "lookup_needs_human"
    LOOKUP_LATE = "lookup_late"
    LOOKUP_OUTCOME_UNRECORDED = "lookup_outcome_unrecorded"
    LOOKUP_UNKNOWN_OPERATION = "lookup_unknown_operation"

    # Webhooks (outbox.reconcilers.webhooks)
    WEBHOOK_DELIVERED = "webhook_delivered"
    WEBHOOK_RETRY = "webhook_retry"
    WEBHOOK_ABANDONED = "webhook_abandoned"
    WEBHOOK_LEASE_LOST = "webhook_lease_lost"
    WEBHOOK_ERROR = "webhook_error"

    # Metrics exporter (outbox.metrics, outbox metrics)
    METRICS_STARTED = "metrics_started"
    METRICS_STOPPED = "metrics_stopped"
    METRICS_LISTENING = "metrics_listening"
    METRICS_LISTEN_FAILED = "metrics_listen_failed"
    METRICS_BASELINE_FAILED = "metrics_baseline_failed"
    METRICS_CURSOR_RESET = "metrics_cursor_reset"
    METRICS_SCRAPE_FAILED = "metrics_scrape_failed"

    # HTTP API (outbox.web, outbox api)
    API_STARTED = "api_started"
    API_STOPPED = "api_stopped"
    API_REQUEST = "api_request"  #: the access log: method, path, status, ms, caller (a name)
    API_ERROR = "api_error"  #: an unexpected error, answered 500 (its type only)
    MCP_STARTED = "mcp_started"  #: `outbox mcp`: its transport (and URL over HTTP), its tools
    MCP_STOPPED = "mcp_stopped"
    API_WORKER_FAILED = "api_worker_failed"  #: a worker of `outbox api --workers N` could not start

    # Operator console (outbox.web.console, at / of outbox api)
    CONSOLE_SESSION_KEY_MADE = "console_session_key_made"  #: no OUTBOX_CONSOLE_SECRET: made one
    CONSOLE_SIGNED_IN = "console_signed_in"
    CONSOLE_SIGNED_OUT = "console_signed_out"
    CONSOLE_SIGNIN_FAILED = "console_signin_failed"  #: the name and address, never the password
    CONSOLE_SIGNIN_THROTTLED = "console_signin_throttled"
    CONSOLE_SIGNIN_BUSY = "console_signin_busy"  #: refused at once: the password checks are full
    CONSOLE_CSRF_REFUSED = "console_csrf_refused"  #: a POST without this session's CSRF token
    CONSOLE_DECIDED = "console_decided"  #: an approve, reject or resolve by a signed-in operator

    # Start-up (outbox.db.wait_for_database): every component waits for the database
    DB_WAITING = "db_waiting"  #: a try to connect failed: its error class and message
    DB_READY = "db_ready"  #: connected: the component goes on starting
    # Elsewhere
    CONFIG_UNKNOWN_VARIABLE = "config_unknown_variable"  #: a misspelt OUTBOX_* variable?
    ASYNC_REPLICAS_ALLOWED = "async_replicas_allowed"
    FAULT_HANG = "fault_hang"  #: a test fault point is hanging on purpose


class LogFormat(enum.StrEnum):
    """How log lines are rendered (``OUTBOX_LOG_FORMAT``)."""

    LOGFMT = "logfmt"  #: ``time=… level=info action=dispatch_sent msg="…" key=value``
    JSON = "json"  #: one JSON object per line, the same keys


#: The keys every line starts with, in this order; a record's ``extra`` fields follow.
_FIRST_KEYS = ("time", "level", "action", "logger", "msg")
_HANDLER_NAME = "outbox"


def _from_record(_: Any, __: str, event: EventDict) -> EventDict:
    """Time (UTC, ISO 8601, when the record was made), level and action of a stdlib record."""
    record: logging.LogRecord = event["_record"]
    when = datetime.fromtimestamp(record.created, UTC)
    event["time"] = when.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    event["level"] = record.levelname.lower()
    if "action" not in event:
        event["logger"] = record.name  # Celery's or a library's line: say whose it is
    if record.name.startswith("celery."):
        # Celery's copy of a failed task's line (its arguments and traceback, as text).
        event.pop("data", None)
    return event


def describe_error(error: BaseException) -> str:
    """``error`` as one line a log may carry: its class and the first line of its message.

    A SQLAlchemy ``DBAPIError`` is described by the driver's error it wraps (``.orig``): its
    own text goes on with the statement (``[SQL: ...]``) and a link, lines no log wants."""
    from sqlalchemy.exc import DBAPIError  # noqa: PLC0415

    cause = error.orig if isinstance(error, DBAPIError) and error.orig is not None else error
    text = str(cause).strip()
    message = text.splitlines()[0] if text else ""
    return f"{type(cause).__name__}: {message}" if message else type(cause).__name__


#: What SQLAlchemy's text of a driver's error holds after its first line: the statement.
_SQL_MARK = "\n[SQL: "


def _database_errors_in_one_line(_: Any, __: str, event: EventDict) -> EventDict:
    """A record's database error as one ``error`` field (:func:`describe_error`) instead of
    its traceback, and no statement text in its message (only its first line is kept),
    whoever logged it (Celery, kombu, a library): the statement may quote a payload's
    shape, and a restart would otherwise print a traceback per message in flight."""
    import psycopg  # noqa: PLC0415
    from sqlalchemy.exc import DBAPIError  # noqa: PLC0415

    exc_info = event.get("exc_info")
    error = exc_info[1] if isinstance(exc_info, tuple) else None
    database = isinstance(error, DBAPIError | psycopg.Error)
    if isinstance(error, DBAPIError | psycopg.Error):
        del event["exc_info"]
        event.setdefault("error", describe_error(error))
    message = event.get("event")
    if isinstance(message, str) and (database or _SQL_MARK in message):
        event["event"] = message.split("\n", 1)[0]
    return event


def _escape_for(code: int) -> str:
    named = {0x09: "\\t", 0x0D: "\\r"}
    if code in named:
        return named[code]
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


#: Every control character but the newline (LF), each to its escape: C0, DEL, C1, and the
#: two Unicode line and paragraph separators some viewers break lines on. The renderers
#: escape LF themselves (logfmt as ``\\n``, JSON as ``\\n``), so a traceback reads back whole.
_CONTROL_ESCAPES: dict[int, str] = {
    code: _escape_for(code)
    for code in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)
    if code != 0x0A
}

#: Values rendered as they are (no text of a caller's in them).
_PLAIN = (bool, int, float, type(None))

#: uvicorn's copy of its message with ANSI colours, in every record's ``extra``.
_DROPPED_EXTRAS = ("color_message",)


def escape_controls(value: object) -> object:
    """``value`` with every control character escaped (:data:`_CONTROL_ESCAPES`): text as
    text, lists and mappings item by item, numbers as they are, anything else as its text."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, str):
        return value.translate(_CONTROL_ESCAPES)
    if isinstance(value, Mapping):
        return {str(escape_controls(k)): escape_controls(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [escape_controls(item) for item in value]
    return str(value).translate(_CONTROL_ESCAPES)


def _trace_ids(_: Any, __: str, event: EventDict) -> EventDict:
    """``trace_id`` and ``span_id`` of the span current where the line was logged (a handler
    formats in the logging thread), so that logs join traces (docs/observability.md). A
    process that never imported the tracing API has no current span: nothing is imported."""
    if "opentelemetry.trace" not in sys.modules:
        return event
    from opentelemetry import trace  # noqa: PLC0415 -- imported already (above): no cost

    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event["trace_id"] = f"{context.trace_id:032x}"
        event["span_id"] = f"{context.span_id:016x}"
    return event


def _escaped(_: Any, __: str, event: EventDict) -> EventDict:
    """Every key and value with its control characters escaped, in one place for both
    formats: structlog's logfmt escapes only ``\\n`` and ``"`` (CR, ESC, DEL, C1 and U+2028
    went out raw), and JSON leaves DEL raw."""
    return {
        str(escape_controls(key)): escape_controls(value)
        for key, value in event.items()
        if key not in _DROPPED_EXTRAS
    }


def _first_keys_first(_: Any, __: str, event: EventDict) -> EventDict:
    """The same key order in JSON as in logfmt: time, level, action, … then the fields."""
    first = {key: event.pop(key) for key in _FIRST_KEYS if key in event}
    first.update(event)
    return first


def formatter(log_format: LogFormat) -> logging.Formatter:
    """A stdlib formatter rendering a record and its ``extra`` fields as ``log_format``.

    structlog does the rendering: logfmt quotes a value holding a space, ``=`` or ``"`` and
    escapes newlines (a traceback stays on its line, under ``exception``); JSON renders the
    same keys as one object per line. Before either, every other control character is
    escaped (:func:`escape_controls`) and uvicorn's ``color_message`` (its message again,
    with ANSI escapes) is dropped.
    """
    import structlog  # noqa: PLC0415

    renderer: Processor = (
        structlog.processors.JSONRenderer()
        if log_format is LogFormat.JSON
        else structlog.processors.LogfmtRenderer(key_order=_FIRST_KEYS, drop_missing=True)
    )
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.ExtraAdder(),
            _from_record,
            _trace_ids,
            _database_errors_in_one_line,
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.EventRenamer("msg"),
            structlog.processors.format_exc_info,
            _escaped,
            _first_keys_first,
            renderer,
        ],
    )


def configure(level: int | str = logging.INFO, log_format: LogFormat = LogFormat.LOGFMT) -> None:
    """Send the outbox's logs to stderr as ``log_format`` (the commands pass
    ``OUTBOX_LOG_FORMAT``). Idempotent: a second call changes nothing."""
    root = logging.getLogger()
    if any(handler.name == _HANDLER_NAME for handler in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.name = _HANDLER_NAME
    handler.setFormatter(formatter(log_format))
    root.addHandler(handler)
    root.setLevel(level)
    # httpx logs every request with its full URL, which may carry a receiver's token.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
