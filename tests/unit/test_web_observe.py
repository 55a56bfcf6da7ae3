"""The API's outermost middleware answers an error nothing else handled: a bare 500 problem,
one log line naming its type (never its message, which may quote a payload), and the status
in the access log; nothing reaches the server to log as a traceback."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from outbox.logs import Action
from outbox.web.observe import Observe, Receive, RequestMetrics, Scope, Send

MARKER = "payload-marker-7f3a"


async def _failing(scope: Scope, receive: Receive, send: Send) -> None:
    raise RuntimeError(f"statement failed with parameters {{'payload': '{MARKER}'}}")


def _get(app: Observe) -> httpx.Response:
    async def call() -> httpx.Response:
        # raise_app_exceptions: an exception that escaped the middleware would raise here.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            return await client.get("/v1/operations")

    return asyncio.run(call())


def test_an_unhandled_error_is_a_bare_500_problem_logged_by_its_type_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The app raises with a payload in its message: the client gets a 500 problem without
    it, the log names RuntimeError without it, the access log says 500."""
    app = Observe(_failing, metrics=RequestMetrics(), max_body_bytes=1024)
    with caplog.at_level(logging.INFO):
        answer = _get(app)
    assert answer.status_code == 500
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["detail"] == "the server failed to answer; it is logged"
    assert MARKER not in answer.text
    errors = [r for r in caplog.records if getattr(r, "action", None) == Action.API_ERROR]
    assert [getattr(r, "error", None) for r in errors] == ["RuntimeError"]
    assert MARKER not in caplog.text
    [access] = [r for r in caplog.records if getattr(r, "action", None) == Action.API_REQUEST]
    assert getattr(access, "status", None) == 500
