"""The log formatter escapes every control character, in logfmt and JSON, whatever the text.

A value a caller controls (a request's path, a sign-in's operator name) must not forge a second
line or drive the terminal that shows the log: C0 (CR, ESC...), DEL, C1 and U+2028/U+2029 are
written as escapes, the newline as the renderers' ``\\n``, and nothing else is lost.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.logs import Action, LogFormat, formatter

#: What must never appear raw in a line: Unicode's control characters (C0, DEL, C1) and the
#: line and paragraph separators; the newline included (the renderers escape it).
FORBIDDEN = {chr(c) for c in range(sys.maxunicode + 1) if unicodedata.category(chr(c)) == "Cc"}
FORBIDDEN |= {"\u2028", "\u2029"}

_ESCAPE = re.compile(r"\\(x[0-9a-f]{2}|u[0-9a-f]{4}|t|r)")


def _unescape(text: str) -> str:
    """The text the formatter escaped (for text that held no backslash of its own)."""

    def one(found: re.Match[str]) -> str:
        code = found[1]
        return {"t": "\t", "r": "\r"}.get(code) or chr(int(code[1:], 16))

    return _ESCAPE.sub(one, text)


def _render(log_format: LogFormat, text: str) -> str:
    record = logging.LogRecord("outbox.test", logging.WARNING, __file__, 1, "%s", (text,), None)
    record.action = Action.API_REQUEST
    record.path = text
    record.names = [text]
    record.color_message = "\x1b[1m%s\x1b[0m"
    return formatter(log_format).format(record)


def _assert_one_clean_line(line: str) -> None:
    assert not FORBIDDEN.intersection(line), ascii(line)
    assert len(line.splitlines()) == 1, ascii(line)


@pytest.mark.parametrize("log_format", list(LogFormat))
def test_every_control_character_is_escaped_in_one_line(log_format: LogFormat) -> None:
    """Each of the 66 control characters and U+2028/2029, in a message and a field, renders
    as an escape on one line, and uvicorn's ``color_message`` is not rendered."""
    every = "".join(sorted(FORBIDDEN))
    line = _render(log_format, f"GET /a{every}b")
    _assert_one_clean_line(line)
    assert "color_message" not in line
    if log_format is LogFormat.JSON:
        record = json.loads(line)
        assert _unescape(record["path"]) == f"GET /a{every}b"
        assert _unescape(record["names"][0]) == f"GET /a{every}b"
        assert "\\x1b" in record["msg"]
    else:
        assert "\\\\x1b" in line  # in the quoted msg: the escape, its backslash escaped
        assert "\\r" in line


@pytest.mark.parametrize("log_format", list(LogFormat))
@given(text=st.text(alphabet=st.sampled_from(sorted(FORBIDDEN)) | st.characters(codec="utf-8")))
def test_any_text_renders_as_one_line_without_control_characters(
    log_format: LogFormat, text: str
) -> None:
    """Whatever text a field holds, its line holds no control character and reads back whole."""
    line = _render(log_format, text)
    _assert_one_clean_line(line)
    if log_format is LogFormat.JSON and "\\" not in text:
        assert _unescape(json.loads(line)["path"]) == text
