"""Log lines as the processes print them: quoted logfmt by default, JSON on request, UTC times.

Each test reads the real stderr of a real process (a Python program using ``outbox.logs``, or
``outbox metrics``) and parses it, so a line a parser cannot read fails here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outbox.logs import Action
from tests.acceptance.conftest import REPO, clean_environment

# One logfmt pair: a bare value, or a quoted one with backslash escapes.
_PAIR = re.compile(r'([^\s=]+)=("(?:[^"\\]|\\.)*"|[^\s"]*)')

_PROGRAM = f"""
import logging
from outbox import logs
from outbox.config import get_settings
logs.configure("INFO", get_settings().log_format)
log = logging.getLogger("outbox.example")
log.info(
    "attempt %d: %s",
    1,
    'refused: "quota" exceeded = 3',
    extra={{"action": "{Action.DISPATCH_FAILED}", "operation_id": "op 1", "tool": "x=y"}},
)
logging.getLogger("celery.apps.worker").warning("celery@host ready.")
try:
    raise ValueError("line one\\nline two")
except ValueError:
    log.exception("it broke", extra={{"action": "{Action.DISPATCH_ERROR}"}})
"""


def parse_logfmt(line: str) -> dict[str, str]:
    """A logfmt line as a dict; the whole line must be pairs, or the test fails."""
    pairs = _PAIR.findall(line)
    assert " ".join(f"{key}={value}" for key, value in pairs) == line, line
    return {
        key: value[1:-1].replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
        if value.startswith('"')
        else value
        for key, value in pairs
    }


def _log_lines(**env: str) -> list[str]:
    # TZ far from UTC: a local-time timestamp would show.
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM],
        env=clean_environment(TZ="Asia/Tokyo", **env),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=True,
    )
    return done.stderr.splitlines()


def _assert_utc_now(stamp: str) -> None:
    assert stamp.endswith(("Z", "+00:00")), stamp
    when = datetime.fromisoformat(stamp)
    assert when.utcoffset() == timedelta(0)
    assert abs(datetime.now(UTC) - when) < timedelta(minutes=1), stamp


def _assert_the_records(records: list[dict[str, Any]]) -> None:
    first, celery, failure = records
    _assert_utc_now(first["time"])
    assert first["level"] == "info"
    assert first["action"] == Action.DISPATCH_FAILED
    assert first["msg"] == 'attempt 1: refused: "quota" exceeded = 3'
    assert (first["operation_id"], first["tool"]) == ("op 1", "x=y")
    assert "logger" not in first
    assert (celery["logger"], celery["msg"], celery["level"]) == (
        "celery.apps.worker",
        "celery@host ready.",
        "warning",
    )
    assert "action" not in celery
    assert failure["action"] == Action.DISPATCH_ERROR
    assert failure["exception"].startswith("Traceback")
    assert failure["exception"].endswith("ValueError: line one\nline two")


def test_logfmt_by_default_quotes_what_needs_quoting_one_line_per_record() -> None:
    """Spaces, quotes, ``=`` and newlines (a traceback) stay inside one parseable line."""
    lines = _log_lines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("time=")
    _assert_the_records([parse_logfmt(line) for line in lines])


@pytest.mark.parametrize("value", ["json", "JSON"])
def test_outbox_log_format_json_prints_one_object_per_line(value: str) -> None:
    """``OUTBOX_LOG_FORMAT=json``: the same keys, one JSON object a line, time first."""
    lines = _log_lines(OUTBOX_LOG_FORMAT=value)
    assert len(lines) == 3, lines
    records = [json.loads(line) for line in lines]
    assert list(records[0])[:4] == ["time", "level", "action", "msg"]
    _assert_the_records(records)


def test_a_bad_log_format_is_one_line_naming_the_variable(cli_env: dict[str, str]) -> None:
    """A value that is neither logfmt nor json stops the command before it runs."""
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "metrics", "--port", "0"],
        env={**cli_env, "OUTBOX_LOG_FORMAT": "xml"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "OUTBOX_LOG_FORMAT" in lines[0]


def test_a_cli_service_logs_json_lines(cli_env: dict[str, str]) -> None:
    """``outbox metrics`` with OUTBOX_LOG_FORMAT=json: its start line parses as JSON."""
    with subprocess.Popen(
        [sys.executable, "-m", "outbox", "metrics", "--port", "0"],
        env={**cli_env, "OUTBOX_LOG_FORMAT": "json", "TZ": "America/Los_Angeles"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    ) as process:
        try:
            assert process.stderr is not None
            deadline = time.monotonic() + 60
            started = None
            while started is None and time.monotonic() < deadline:
                line = process.stderr.readline()
                if not line:
                    break
                record = json.loads(line)
                if record.get("action") == Action.METRICS_STARTED:
                    started = record
            assert started is not None, "no metrics_started line"
            assert started["level"] == "info"
            assert started["msg"].startswith("serving on http://")
            _assert_utc_now(started["time"])
        finally:
            process.terminate()
            process.wait(30)
