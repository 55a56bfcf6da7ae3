"""Saga keys in the console's links and forms (issue 32, items 5 and 7), in a real headless
Chromium against a real `outbox api` on a real PostgreSQL: a key holding `/`, or a key from
before dot segments were refused, links to and cancels its own saga only; unencodable text in
a path or query parameter is a 400 problem."""

# ruff: noqa: F811 -- the fixtures of test_console.py, imported, are the tests' parameters

from __future__ import annotations

import httpx
import pytest
from playwright.sync_api import Page, expect
from sqlalchemy import Engine, text

from outbox.sagas import SagaState
from tests.acceptance.test_console import (  # noqa: F401 -- the module's browser and server
    alice,
    browser,
    page,
    playwright,
    server,
    sign_in,
)
from tests.api_server import ApiServer
from tests.integration.test_sagas import THREE, open_saga, view

pytestmark = pytest.mark.slow


def legacy_saga(engine: Engine, key: str) -> None:
    """A running saga under ``key`` as a version that took any key could have stored it (no
    step yet): today's saga() refuses such a key."""
    with engine.begin() as conn:
        conn.execute(
            text("INSERT INTO outbox.sagas (key, agent, requested_by) VALUES (:key, '', 'old')"),
            {"key": key},
        )


@pytest.mark.parametrize(
    ("key", "victim", "href"),
    [
        ("harmless/../victim-saga", "victim-saga", "/sagas/harmless%2F..%2Fvictim-saga?agent="),
        ("harmless/x", "x", "/sagas/harmless%2Fx?agent="),
    ],
)
def test_a_saga_keys_link_and_cancel_form_act_on_that_saga_only(
    page: Page, server: ApiServer, engine: Engine, alice: str, key: str, victim: str, href: str
) -> None:
    """The sagas page links a key holding `/` (or, stored before they were refused, `..`)
    as one encoded segment; its page and its Cancel form act on it, never on the saga its
    key's path would resolve to."""
    open_saga(engine, victim, THREE)
    if ".." in key:
        legacy_saga(engine, key)
    else:
        open_saga(engine, key, THREE)
    sign_in(page, server, alice)
    page.goto(f"{server.url}/sagas")
    link = page.get_by_role("link", name=key, exact=True)
    expect(link).to_have_attribute("href", href)
    link.click()
    expect(page.get_by_role("heading", level=1)).to_contain_text(key)
    page.get_by_label("Why cancel it").fill("red team")
    page.get_by_role("button", name="Cancel this saga").click()
    expect(page.get_by_role("status")).to_contain_text("cancelled by alice")
    expect(page.get_by_role("heading", level=1)).to_contain_text(key)
    assert view(engine, key).cancelled_by == "alice"
    assert view(engine, key).state is not SagaState.RUNNING
    untouched = view(engine, victim)
    assert (untouched.state, untouched.cancelled_by) == (SagaState.RUNNING, None)


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/sagas/a%00b", "key"),
        ("/sagas/a?agent=%00", "agent"),
        ("/search?q=%00", "q"),
    ],
)
def test_unencodable_text_in_a_console_parameter_is_400(
    server: ApiServer, path: str, field: str
) -> None:
    """A NUL in a console page's path or query parameter is a 400 problem naming it, not a
    database error."""
    answer = httpx.get(f"{server.url}{path}", timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["field"] == field


def test_a_cancel_posted_to_a_key_with_a_nul_is_400(server: ApiServer) -> None:
    """POST /sagas/a%00/cancel is a 400 problem naming `key`."""
    answer = httpx.post(f"{server.url}/sagas/a%00/cancel", data={"reason": "x"}, timeout=30)
    assert (answer.status_code, answer.json()["field"]) == (400, "key")
