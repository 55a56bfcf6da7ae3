"""A real ``outbox api``'s log cannot be forged through a request: control characters in the
access log's path and in a sign-in's operator name are written escaped, one line per record.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from outbox.logs import Action, LogFormat
from tests.acceptance.test_cli_logs import parse_logfmt
from tests.acceptance.test_console import _chromium, playwright, sign_in
from tests.api_server import api_environment, running_api
from tests.processes import wait_until

__all__ = ["playwright"]  # the fixture, shared with the console's tests

pytestmark = pytest.mark.slow

#: A path that would end the access log's line, forge a record and turn the terminal red.
FORGED_PATH = "/v1/operations/x%0D%0Atime=0 level=error action=api_error%1B[31m%7F%C2%85%E2%80%A8"
#: An operator name doing the same in the sign-in's failure line.
FORGED_NAME = "eve\r\nlevel=info action=console_signed_in operator=root\x1b[2J\x9b"

_CSRF = re.compile(r'name="csrf" value="([^"]+)"')
_RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def _records(text: str, log_format: LogFormat) -> list[dict[str, str]]:
    """Every line of the log, parsed; each one must be a whole record."""
    lines = text.splitlines()
    if log_format is LogFormat.JSON:
        return [json.loads(line) for line in lines]
    return [parse_logfmt(line) for line in lines]


@pytest.mark.parametrize("log_format", list(LogFormat))
def test_control_characters_from_a_request_are_escaped_in_the_log(
    database_url: str, engine: object, tmp_path: Path, log_format: LogFormat
) -> None:
    """CR, LF, ESC, DEL, C1 and U+2028 in a request's path and a sign-in's operator name
    reach the log escaped: no forged record, no raw control character, one line a record."""
    env = api_environment(
        database_url,
        tmp_path,
        OUTBOX_LOG_FORMAT=log_format.value,
        OUTBOX_CONSOLE_SECRET="test-" + "k" * 40,
    )
    with running_api(env, tmp_path / "api.log") as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.get(FORGED_PATH).status_code in {401, 404}
            token = _CSRF.search(client.get("/signin").text)
            assert token is not None
            signin = {"name": FORGED_NAME, "password": "wrong", "csrf": token[1]}
            assert client.post("/signin", data=signin).status_code == 401
        text = server.logs()
    assert _RAW.search(text) is None, ascii(text)
    records = _records(text, log_format)
    assert not [r for r in records if r.get("action") == Action.API_ERROR]
    assert not [r for r in records if r.get("action") == Action.CONSOLE_SIGNED_IN]
    assert not [r for r in records if "color_message" in r]
    paths = [r["path"] for r in records if r.get("action") == Action.API_REQUEST]
    escaped_path = (
        "/v1/operations/x\\r\ntime=0 level=error action=api_error\\x1b[31m\\x7f\\x85\\u2028"
    )
    assert escaped_path in paths, paths
    failed = [r for r in records if r.get("action") == Action.CONSOLE_SIGNIN_FAILED]
    assert [r["operator"] for r in failed] == [
        "eve\\r\nlevel=info action=console_signed_in operator=root\\x1b[2J\\x9b"
    ]


def test_an_operator_name_typed_in_chromium_is_logged_escaped(
    database_url: str, engine: object, tmp_path: Path, playwright: object
) -> None:
    """A name with ESC, DEL, C1 and U+2028 typed into the console's sign-in form in Chromium
    is logged escaped in one line."""
    typed = "eve\x1b[31m\x7f\x9b\u2028root"
    env = api_environment(database_url, tmp_path, OUTBOX_CONSOLE_SECRET="test-" + "k" * 40)
    with (
        running_api(env, tmp_path / "api.log") as server,
        _chromium(playwright) as browser,  # type: ignore[arg-type]
    ):
        page = browser.new_page()
        sign_in(page, server, typed, "wrong")
        wait_until(
            lambda: Action.CONSOLE_SIGNIN_FAILED.value in server.logs(),
            timeout=30,
            what="the failure line",
        )
        text = server.logs()
    assert _RAW.search(text) is None, ascii(text)
    failed = [
        r
        for r in _records(text, LogFormat.LOGFMT)
        if r.get("action") == Action.CONSOLE_SIGNIN_FAILED
    ]
    assert [r["operator"] for r in failed] == ["eve\\x1b[31m\\x7f\\x9b\\u2028root"]
