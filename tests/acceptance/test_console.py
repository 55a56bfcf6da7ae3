"""The operator console in a real headless Chromium (Debian's, driven by Playwright) against a
real `outbox api` subprocess on a real PostgreSQL: sign in, find, approve, resolve, CSRF,
two operators racing, the sign-in throttle, the sagas' pages and a saga's cancel. Screenshots
are kept in each test's tmp dir.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from itsdangerous import TimestampSigner
from playwright.sync_api import (
    Browser,
    BrowserContext,
    Page,
    Playwright,
    expect,
    sync_playwright,
)
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import operators
from outbox.config import get_settings
from outbox.contracts import ToolContract
from outbox.logs import Action
from outbox.sagas import SagaState
from outbox.states import Actor, State
from tests.acceptance.test_cli_sagas import compensated_saga
from tests.api_server import ApiServer, api_environment, running_api
from tests.factories import age, event_count, events_of, make_operation, move, reload
from tests.integration.test_sagas import THREE, advance, finish, open_saga, view

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
PASSWORD = "correct horse battery"  # noqa: S105 -- the test accounts'
#: Set to write the README's screenshot (docs/img/console.png) from the operation page test.
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "console.png"


#: Where each test's screenshots are kept after the run, a folder per test (not in git).
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "console"


@pytest.fixture
def shots(request: pytest.FixtureRequest) -> Path:
    """This test's screenshot folder under test-artifacts/console/, emptied first: the
    screenshots of the last run stay there to look at (CI prints where)."""
    folder = ARTIFACTS / re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    """Playwright, for Debian's Chromium only (never a downloaded browser)."""
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is missing: apt-get install chromium (.ci/run does)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason + ", and CI requires it")
        pytest.skip(reason)
    with sync_playwright() as started:
        yield started


@contextmanager
def _chromium(playwright: Playwright) -> Iterator[Browser]:
    """A headless Chromium process of its own, closed at the end."""
    launched = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
    try:
        yield launched
    finally:
        launched.close()


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    """Debian's headless Chromium, one process for the module."""
    with _chromium(playwright) as launched:
        yield launched


def _environment(database_url: str, home: Path) -> dict[str, str]:
    return api_environment(
        database_url,
        home,
        OUTBOX_CONSOLE_SECRET="test-" + "k" * 40,
        OUTBOX_CONSOLE_FLOWER_URL="http://flower.example:5555/",
        OUTBOX_CONSOLE_METRICS_URL="http://grafana.example/d/outbox",
    )


@pytest.fixture(scope="module")
def server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """One `outbox api` (API and console) for the module."""
    home = tmp_path_factory.mktemp("console")
    with running_api(_environment(database_url, home), home / "api.log") as running:
        yield running


def add_operator(engine: Engine, name: str) -> str:
    """An operator account, committed; its name."""
    with Session(engine) as session, session.begin():
        operators.add_operator(session, name=name, password=PASSWORD)
    return name


@pytest.fixture
def alice(engine: Engine) -> str:
    """The operator account `alice`."""
    return add_operator(engine, "alice")


@contextmanager
def _context(browser: Browser, **options: Any) -> Iterator[BrowserContext]:
    """A fresh browser context (its own cookies), closed at the end."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, **options)
    try:
        yield context
    finally:
        context.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A page in a fresh browser context."""
    with _context(browser) as context:
        yield context.new_page()


def sign_in(page: Page, server: ApiServer, name: str, password: str = PASSWORD) -> None:
    """Fill the sign-in form by its labels and submit it with the keyboard."""
    page.goto(f"{server.url}/signin")
    page.get_by_label("Operator name").fill(name)
    page.get_by_label("Password").fill(password)
    page.get_by_label("Password").press("Enter")


def test_signing_in_shows_the_overview_and_the_queue_with_reasons(
    page: Page, server: ApiServer, engine: Engine, alice: str, shots: Path
) -> None:
    """A signed-in operator sees counts by state, and the queue oldest first with why each waits."""
    page.goto(f"{server.url}/")
    expect(page).to_have_url(re.compile(r"/signin$"))
    waiting = make_operation(engine, State.AWAITING_APPROVAL, target="first")
    stuck = make_operation(engine, State.NEEDS_HUMAN, target="second")
    age(engine, stuck.id, 2 * 3600 + 5 * 60 + 30, "updated_at")  # escalated 2 h 5 min ago
    sign_in(page, server, alice)
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()
    expect(page.get_by_text("Signed in as alice")).to_be_visible()
    row = page.get_by_role("row").filter(has_text="needs_human")
    expect(row.get_by_role("cell").first).to_have_text("1")
    expect(row.get_by_role("cell").nth(1)).to_have_text("2 h 5 min")  # its oldest wait
    flower = page.get_by_role("link", name="Flower (the Celery workers)")
    expect(flower).to_have_attribute("href", "http://flower.example:5555/")
    expect(page.get_by_role("link", name="Metrics", exact=True)).to_have_attribute(
        "href", "http://grafana.example/d/outbox"
    )
    page.screenshot(path=shots / "overview.png", full_page=True)
    page.get_by_role("link", name="Queue", exact=True).click()
    rows = page.get_by_role("row")
    expect(rows).to_have_count(3)
    # The longest-waiting first: the one escalated 2 h ago, though it was enqueued later.
    expect(rows.nth(1)).to_contain_text(str(stuck.id))
    expect(rows.nth(1)).to_contain_text(events_of(engine, stuck.id)[-1].reason)
    expect(rows.nth(1)).to_contain_text("2 h 5 min")
    expect(rows.nth(2)).to_contain_text(str(waiting.id))
    page.screenshot(path=shots / "queue.png", full_page=True)


def test_the_overview_shows_how_many_operations_were_decided_per_second(
    page: Page, server: ApiServer, engine: Engine, alice: str
) -> None:
    """The overview's "decided per second" is the operations that reached confirmed, failed or
    cancelled in the last 5 minutes, over those 300 seconds: a dispatcher's outcomes, an
    agent's cancel and an operator's rejection count; waiting and live operations do not."""
    sign_in(page, server, alice)
    rate = page.get_by_role("region", name="Decided per second")
    expect(rate).to_contain_text(re.compile(r"0\.00 per second\s*:\s*0 operations\s+reached"))
    for state in (State.CONFIRMED, State.FAILED, State.CANCELLED, State.CONFIRMED, State.FAILED):
        make_operation(engine, state)
    for state in (State.PLANNED, State.SENT, State.UNKNOWN, State.NEEDS_HUMAN):
        make_operation(engine, state)
    rejected = make_operation(engine, State.AWAITING_APPROVAL)
    make_operation(engine, State.AWAITING_APPROVAL)  # still waiting
    page.goto(f"{server.url}/operations/{rejected.id}")
    page.get_by_label("Why reject it").fill("wrong project")
    page.get_by_role("button", name="Reject").click()
    expect(page.get_by_role("status")).to_contain_text("rejected by alice")
    page.get_by_role("link", name="Overview").click()
    # 6 in 300 s: 0.02 per second.
    expect(rate).to_contain_text(
        re.compile(
            r"0\.02 per second\s*:\s*6 operations\s+reached confirmed, failed or cancelled\s+"
            r"in the last 5 minutes"
        )
    )


def test_search_finds_an_operation_by_intent_key_and_by_id(
    page: Page, server: ApiServer, engine: Engine, alice: str, shots: Path
) -> None:
    """The search box goes to the operation named by its intent key or its id; else says none."""
    op = make_operation(engine, State.NEEDS_HUMAN, intent_key="refund-order-77")
    sign_in(page, server, alice)
    search = page.get_by_label("Search by id or intent key")
    search.fill("refund-order-77")
    search.press("Enter")
    expect(page).to_have_url(f"{server.url}/operations/{op.id}")
    expect(page.get_by_text(op.payload_hash)).to_be_visible()
    page.get_by_label("Search by id or intent key").fill(str(op.id))
    page.get_by_role("button", name="Find").click()
    expect(page).to_have_url(f"{server.url}/operations/{op.id}")
    page.get_by_label("Search by id or intent key").fill("no-such-key")
    page.get_by_role("button", name="Find").click()
    expect(page.get_by_role("alert")).to_contain_text("no-such-key")
    page.screenshot(path=shots / "not-found.png", full_page=True)


def test_search_by_a_key_two_agents_used_lists_both_operations(
    page: Page, server: ApiServer, engine: Engine, alice: str, shots: Path
) -> None:
    """An intent key two agents used names two operations: the search lists each with its
    agent and links to it; the operation page names its agent."""
    mine = make_operation(engine, State.NEEDS_HUMAN, intent_key="order-5/refund", agent="shop")
    theirs = make_operation(engine, State.PLANNED, intent_key="order-5/refund", agent="crm")
    sign_in(page, server, alice)
    page.get_by_label("Search by id or intent key").fill("order-5/refund")
    page.get_by_role("button", name="Find").click()
    rows = page.get_by_role("row")
    expect(rows).to_have_count(3)
    expect(rows.nth(1)).to_contain_text("crm")
    expect(rows.nth(2)).to_contain_text("shop")
    page.screenshot(path=shots / "two-agents.png", full_page=True)
    page.get_by_role("link", name=str(mine.id)).click()
    expect(page).to_have_url(f"{server.url}/operations/{mine.id}")
    expect(page.get_by_text("shop", exact=True)).to_be_visible()
    assert str(theirs.id) not in page.content()


def test_approve_from_the_operation_page_records_the_operator(
    page: Page, server: ApiServer, engine: Engine, alice: str, shots: Path
) -> None:
    """Approve on the operation page plans it, bound to the hash shown, decided by alice."""
    op = make_operation(
        engine,
        State.AWAITING_APPROVAL,
        tool="payments.refund",
        target="order-8812",
        payload={"amount": {"currency": "EUR", "value": "120.00"}, "reason": "damaged"},
    )
    sign_in(page, server, alice)
    page.goto(f"{server.url}/operations/{op.id}")
    expect(page.locator("#payload-hash")).to_have_text(op.payload_hash)
    expect(page.get_by_label("The payload, as JSON")).to_contain_text('"currency": "EUR"')
    page.screenshot(path=shots / "awaiting.png", full_page=True)
    if os.environ.get("OUTBOX_WRITE_DOCS_SCREENSHOT") == "1":
        DOCS_SCREENSHOT.parent.mkdir(exist_ok=True)
        page.screenshot(path=DOCS_SCREENSHOT, full_page=True)
    page.get_by_label("Note (optional)").fill("amount matches the ticket")
    page.get_by_role("button", name="Approve this payload").click()
    expect(page.get_by_role("status")).to_contain_text("approved by alice")
    page.screenshot(path=shots / "approved.png", full_page=True)
    now = reload(engine, op.id)
    assert (now.state, now.decided_by, now.approved_payload_hash) == (
        State.PLANNED,
        "alice",
        op.payload_hash,
    )


def test_the_operation_page_shows_attempts_timeline_last_lookup_and_webhooks(
    page: Page,
    server: ApiServer,
    engine: Engine,
    alice: str,
    monkeypatch: pytest.MonkeyPatch,
    shots: Path,
) -> None:
    """An escalated operation's page shows its attempts, every move of its timeline, what the
    last lookup said, and the escalation webhook written about it."""
    monkeypatch.setenv("OUTBOX_WEBHOOK_URL", "http://127.0.0.1:9/hooks")
    monkeypatch.setenv("OUTBOX_WEBHOOK_SECRET", "whsec_" + base64.b64encode(bytes(32)).decode())
    get_settings.cache_clear()
    try:
        unknown = make_operation(engine, State.UNKNOWN, target="web-7")
        lookup = "lookup: no release for this key at the remote after 3 tries"
        op = move(engine, unknown, State.NEEDS_HUMAN, Actor.RECONCILER, reason=lookup)
    finally:
        monkeypatch.delenv("OUTBOX_WEBHOOK_URL")
        monkeypatch.delenv("OUTBOX_WEBHOOK_SECRET")
        get_settings.cache_clear()
    sign_in(page, server, alice)
    page.goto(f"{server.url}/operations/{op.id}")
    facts = page.locator("dl.facts")
    expect(facts).to_contain_text(f"Attempts{op.attempts}")
    expect(facts).to_contain_text("read timeout")  # the last error
    lookup_section = page.get_by_role("region", name="The last lookup")
    expect(lookup_section).to_contain_text(lookup)
    expect(lookup_section).to_contain_text("reconciler")
    timeline = page.get_by_role("table").filter(has_text="Every state change")
    moves = [
        f"{e.from_state.value if e.from_state else '(new)'} → {e.to_state.value}"
        for e in events_of(engine, op.id)
    ]
    expect(timeline.locator("tbody tr")).to_have_count(len(moves))
    for n, shown in enumerate(moves):
        expect(timeline.locator("tbody tr").nth(n)).to_contain_text(shown)
    webhooks = page.get_by_role("table").filter(has_text="Escalation webhooks")
    expect(webhooks.locator("tbody tr")).to_have_count(1)
    expect(webhooks.locator("tbody tr").first).to_contain_text("needs_human")
    page.screenshot(path=shots / "escalated.png", full_page=True)


def test_resolve_applied_from_the_operation_page_confirms_it(
    page: Page, server: ApiServer, engine: Engine, alice: str, shots: Path
) -> None:
    """Resolve 'applied' with a remote reference confirms it; the event names alice."""
    op = make_operation(engine, State.NEEDS_HUMAN)
    sign_in(page, server, alice)
    page.goto(f"{server.url}/operations/{op.id}")
    page.get_by_label("Applied: the effect exists (confirm it)").check()
    page.get_by_label("Remote reference (when applied)").fill("rel-42")
    page.get_by_label("What you checked and found").fill("release rel-42 is live")
    page.screenshot(path=shots / "resolving.png", full_page=True)
    page.get_by_role("button", name="Resolve").click()
    expect(page.get_by_role("status")).to_contain_text("now confirmed")
    now = reload(engine, op.id)
    assert (now.state, now.remote_ref) == (State.CONFIRMED, "rel-42")
    last = events_of(engine, op.id)[-1]
    assert last.detail is not None
    assert (last.actor, last.detail["by"]) == (Actor.OPERATOR.value, "alice")


#: The in-flight horizon the console's server judges "not applied" by: it loads no tools (no
#: OUTBOX_TOOLS or OUTBOX_CONFIG in its environment), so every tool has the default.
DEFAULT_HORIZON_S = ToolContract(name="any.tool").inflight_horizon_s


def test_resolve_not_applied_from_the_operation_page_fails_it_under_alices_name(
    page: Page, server: ApiServer, engine: Engine, alice: str, shots: Path
) -> None:
    """Past the in-flight horizon, 'Not applied: fail it' fails the operation, clears
    maybe_applied and keeps the note as its last error; the event names alice."""
    op = make_operation(engine, State.NEEDS_HUMAN)
    # Both by the same amount: the schema checks first_sent_at <= sent_at.
    age(engine, op.id, DEFAULT_HORIZON_S + 1, "sent_at", "first_sent_at")
    note = "no release for this key in the remote's list"
    sign_in(page, server, alice)
    page.goto(f"{server.url}/operations/{op.id}")
    page.get_by_label("Not applied: fail it").check()
    page.get_by_label("What you checked and found").fill(note)
    page.get_by_role("button", name="Resolve").click()
    expect(page.get_by_role("status")).to_contain_text("resolved by alice")
    expect(page.get_by_role("status")).to_contain_text("now failed")
    expect(page.get_by_role("button", name="Resolve")).to_have_count(0)
    page.screenshot(path=shots / "failed.png", full_page=True)
    now = reload(engine, op.id)
    assert (now.state, now.maybe_applied, now.last_error, now.remote_ref) == (
        State.FAILED,
        False,
        note,
        None,
    )
    assert now.resolved_at is not None
    last = events_of(engine, op.id)[-1]
    assert (last.from_state, last.to_state, last.actor) == (
        State.NEEDS_HUMAN,
        State.FAILED,
        Actor.OPERATOR.value,
    )
    assert last.detail == {
        "by": "alice",
        "note": note,
        "forced": False,
        "applied": False,
        "replay": False,
    }


def test_an_approve_form_with_a_tampered_payload_hash_is_refused(
    browser: Browser, server: ApiServer, engine: Engine, alice: str, shots: Path
) -> None:
    """An approve form whose hidden payload hash was changed to another payload's is refused
    (409, naming the mismatch); nothing is decided or written."""
    op = make_operation(engine, State.AWAITING_APPROVAL, payload={"amount": "120.00"})
    other = make_operation(engine, State.AWAITING_APPROVAL, payload={"amount": "12000.00"})
    before, events_before = reload(engine, op.id), event_count(engine, op.id)
    with _context(browser, bypass_csp=True) as context:
        page = context.new_page()
        sign_in(page, server, alice)
        page.goto(f"{server.url}/operations/{op.id}")
        hidden = page.locator('form[action$="/approve"] input[name="payload_hash"]')
        expect(hidden).to_have_value(op.payload_hash)
        page.evaluate(
            """hash => {
                document.querySelector('form[action$="/approve"] input[name="payload_hash"]')
                    .value = hash;
            }""",
            other.payload_hash,
        )
        expect(hidden).to_have_value(other.payload_hash)
        with page.expect_response(re.compile(r"/approve$")) as answer:
            page.get_by_role("button", name="Approve this payload").click()
        assert answer.value.status == 409
        told = page.get_by_role("alert")
        expect(told).to_contain_text("Nothing was written")
        expect(told).to_contain_text("payload hash mismatch")
        expect(told).to_contain_text(other.payload_hash[:12])
        page.screenshot(path=shots / "tampered.png", full_page=True)
    assert (reload(engine, op.id), event_count(engine, op.id)) == (before, events_before)
    assert before.decided_by is None


def test_a_form_posted_without_its_csrf_token_is_refused(
    browser: Browser, server: ApiServer, engine: Engine, alice: str, shots: Path
) -> None:
    """An approve form whose CSRF field was removed gets the 403 page; nothing is written."""
    context = browser.new_context(bypass_csp=True)
    page = context.new_page()
    try:
        op = make_operation(engine, State.AWAITING_APPROVAL)
        sign_in(page, server, alice)
        page.goto(f"{server.url}/operations/{op.id}")
        page.locator('form[action$="/approve"] input[name="csrf"]').evaluate("e => e.remove()")
        with page.expect_response(re.compile(r"/approve$")) as answer:
            page.get_by_role("button", name="Approve this payload").click()
        assert answer.value.status == 403
        expect(page.get_by_role("heading", level=1)).to_contain_text("Refused")
        page.screenshot(path=shots / "csrf-refused.png", full_page=True)
    finally:
        context.close()
    assert reload(engine, op.id).state is State.AWAITING_APPROVAL


_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def _signed_in(server: ApiServer, name: str) -> tuple[httpx.Client, str]:
    """A plain HTTP client signed in as ``name`` through the form, and its session's CSRF."""
    client = httpx.Client(base_url=server.url, timeout=30)
    token = _CSRF.search(client.get("/signin").text)
    assert token is not None
    done = client.post("/signin", data={"name": name, "password": PASSWORD, "csrf": token[1]})
    assert (done.status_code, done.headers["location"]) == (303, "/")
    page = _CSRF.search(client.get("/").text)
    assert page is not None
    return client, page[1]


def test_every_form_is_refused_without_this_sessions_csrf_token(
    server: ApiServer, engine: Engine, alice: str
) -> None:
    """Sign-in, sign-out, approve, reject and resolve, posted with no CSRF token or another
    session's, get the 403 page and change nothing; the same forms with the token work."""
    anonymous = httpx.Client(base_url=server.url, timeout=30)
    anonymous.get("/signin")
    credentials = {"name": alice, "password": PASSWORD}
    for forged in ({}, {"csrf": "not-this-sessions"}):
        refused = anonymous.post("/signin", data=credentials | forged)
        assert refused.status_code == 403
        assert "Refused" in refused.text
    assert anonymous.get("/").headers["location"] == "/signin"
    awaiting = make_operation(engine, State.AWAITING_APPROVAL)
    stuck = make_operation(engine, State.NEEDS_HUMAN)
    client, own = _signed_in(server, alice)
    other_client, others = _signed_in(server, add_operator(engine, "dave"))
    seen = {"seen_state": "awaiting_approval", "expect_attempts": "0"}
    forms = {
        "/signout": {},
        f"/operations/{awaiting.id}/approve": seen | {"payload_hash": awaiting.payload_hash},
        f"/operations/{awaiting.id}/reject": seen | {"reason": "wrong project"},
        f"/operations/{stuck.id}/resolve": {
            "seen_state": "needs_human",
            "expect_attempts": str(stuck.attempts),
            "verdict": "applied",
            "remote_ref": "rel-1",
            "note": "checked",
        },
    }
    seen_event = {"seen_event": "0"}
    try:
        for path, form in forms.items():
            for forged in ({}, {"csrf": others}):
                refused = client.post(path, data=form | seen_event | forged)
                assert refused.status_code == 403, path
                assert "Refused" in refused.text, path
            assert client.get("/").status_code == 200, path  # still signed in
        assert reload(engine, awaiting.id).state is State.AWAITING_APPROVAL
        assert reload(engine, stuck.id).state is State.NEEDS_HUMAN
        # The control: the very same forms with this session's token are accepted.
        resolved = client.post(
            f"/operations/{stuck.id}/resolve",
            data=forms[f"/operations/{stuck.id}/resolve"] | seen_event | {"csrf": own},
        )
        assert resolved.status_code == 303, resolved.text
        assert reload(engine, stuck.id).state is State.CONFIRMED
        assert client.post("/signout", data={"csrf": own}).headers["location"] == "/signin"
    finally:
        for opened in (client, other_client, anonymous):
            opened.close()


def test_a_session_cookie_not_signed_with_the_servers_key_is_refused(
    server: ApiServer, engine: Engine, alice: str
) -> None:
    """A session cookie naming alice and her session, unsigned or signed with another key,
    signs no one in; the same content signed with OUTBOX_CONSOLE_SECRET does (the cookie's
    format is right)."""
    with Session(engine) as session, session.begin():
        session_id = operators.start_session(session, alice)
    content = base64.b64encode(
        json.dumps(
            {"operator": alice, "session": str(session_id), "since": time.time(), "csrf": "x"}
        ).encode()
    )
    secret = _environment("", Path())["OUTBOX_CONSOLE_SECRET"]
    cookies = {
        "unsigned": content.decode(),
        "another key": TimestampSigner("another-" + "k" * 40).sign(content).decode(),
        "the server's key": TimestampSigner(secret).sign(content).decode(),
    }
    answers = {
        what: httpx.get(f"{server.url}/", cookies={"outbox_console": value}, timeout=30)
        for what, value in cookies.items()
    }
    assert answers["unsigned"].headers["location"] == "/signin"
    assert answers["another key"].headers["location"] == "/signin"
    assert answers["the server's key"].status_code == 200
    assert "Signed in as" in answers["the server's key"].text


def _browser_pid(browser: Browser) -> int:
    """The process id of ``browser``'s main Chromium process, as Chromium itself tells it."""
    info = browser.new_browser_cdp_session().send("SystemInfo.getProcessInfo")
    [pid] = [process["id"] for process in info["processInfo"] if process["type"] == "browser"]
    return int(pid)


def test_two_operators_deciding_one_operation_the_second_is_told_who_won(
    playwright: Playwright, server: ApiServer, engine: Engine, alice: str, shots: Path
) -> None:
    """Of two browsers (two Chromium processes) on the same page, alice's approval wins; bob's
    reject says so, unwritten."""
    bob = add_operator(engine, "bob")
    op = make_operation(engine, State.AWAITING_APPROVAL)
    with _chromium(playwright) as first, _chromium(playwright) as second:
        assert _browser_pid(first) != _browser_pid(second)
        alice_page, bob_page = first.new_page(), second.new_page()
        for page, name in ((alice_page, alice), (bob_page, bob)):
            sign_in(page, server, name)
            page.goto(f"{server.url}/operations/{op.id}")
        alice_page.get_by_role("button", name="Approve this payload").click()
        expect(alice_page.get_by_role("status")).to_contain_text("approved by alice")
        bob_page.get_by_label("Why reject it").fill("wrong project")
        with bob_page.expect_response(re.compile(r"/reject$")) as answer:
            bob_page.get_by_role("button", name="Reject").click()
        assert answer.value.status == 409
        told = bob_page.get_by_role("alert")
        expect(told).to_contain_text("Nothing was written")
        expect(told).to_contain_text("approved by alice")
        expect(told).to_contain_text("now planned")
        bob_page.screenshot(path=shots / "stale.png", full_page=True)
    now = reload(engine, op.id)
    assert (now.state, now.decided_by) == (State.PLANNED, "alice")


def test_a_stale_resolve_names_the_resolution_made_meanwhile(
    browser: Browser, server: ApiServer, engine: Engine, alice: str
) -> None:
    """Two browsers resolving one needs_human operation: the second is told what the first did."""
    bob = add_operator(engine, "bob")
    op = make_operation(engine, State.NEEDS_HUMAN)
    first, second = browser.new_context(), browser.new_context()
    try:
        pages = [first.new_page(), second.new_page()]
        for page, name in zip(pages, (alice, bob), strict=True):
            sign_in(page, server, name)
            page.goto(f"{server.url}/operations/{op.id}")
            page.get_by_label("Applied: the effect exists (confirm it)").check()
            page.get_by_label("Remote reference (when applied)").fill(f"ref-{name}")
            page.get_by_label("What you checked and found").fill(f"checked by {name}")
        pages[0].get_by_role("button", name="Resolve").click()
        expect(pages[0].get_by_role("status")).to_contain_text("now confirmed")
        pages[1].get_by_role("button", name="Resolve").click()
        expect(pages[1].get_by_role("alert")).to_contain_text("resolved by alice")
    finally:
        first.close()
        second.close()
    assert reload(engine, op.id).remote_ref == "ref-alice"


def test_wrong_passwords_are_throttled(
    browser: Browser, database_url: str, engine: Engine, tmp_path: Path, shots: Path
) -> None:
    """After 5 wrong passwords for a name, even the right one is refused with a wait."""
    # A server of its own: the lockout of this client address must not reach other tests.
    env = _environment(database_url, tmp_path)
    with running_api(env, tmp_path / "api.log") as server, _context(browser) as context:
        name = add_operator(engine, "carol")
        page = context.new_page()
        for _ in range(5):
            sign_in(page, server, name, "not the password")
            expect(page.get_by_role("alert")).to_have_text("Wrong name or password.")
        sign_in(page, server, name)
        expect(page.get_by_role("alert")).to_contain_text("Too many failed sign-ins")
        expect(page.get_by_role("alert")).to_contain_text("wait")
        page.screenshot(path=shots / "throttled.png", full_page=True)
        page.goto(f"{server.url}/")
        expect(page).to_have_url(re.compile(r"/signin$"))
        assert "not the password" not in server.logs()


def test_a_removed_operator_is_signed_out_at_the_next_request(
    page: Page, server: ApiServer, engine: Engine, alice: str
) -> None:
    """Removing an account ends its open session: the next page is the sign-in form."""
    sign_in(page, server, alice)
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()
    with Session(engine) as session, session.begin():
        operators.remove_operator(session, alice)
    page.goto(f"{server.url}/queue")
    expect(page).to_have_url(re.compile(r"/signin$"))


def test_the_session_cookie_is_httponly_and_samesite_strict(
    page: Page, server: ApiServer, alice: str
) -> None:
    """The session cookie is HttpOnly and SameSite=Strict."""
    sign_in(page, server, alice)
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()
    [cookie] = [c for c in page.context.cookies() if c["name"] == "outbox_console"]
    assert (cookie["httpOnly"], cookie["sameSite"]) == (True, "Strict")


def test_an_operation_is_rejected_with_the_keyboard_alone(
    page: Page, server: ApiServer, engine: Engine, alice: str
) -> None:
    """Tab from the reason field reaches the Reject button, and Enter rejects the operation."""
    op = make_operation(engine, State.AWAITING_APPROVAL)
    sign_in(page, server, alice)
    page.goto(f"{server.url}/operations/{op.id}")
    page.keyboard.press("Tab")
    expect(page.get_by_role("link", name="Skip to the content")).to_be_focused()
    page.get_by_label("Why reject it").focus()
    page.keyboard.type("wrong project")
    page.keyboard.press("Tab")
    expect(page.get_by_role("button", name="Reject")).to_be_focused()
    page.keyboard.press("Enter")
    expect(page.get_by_role("status")).to_contain_text("rejected by alice")
    assert reload(engine, op.id).state is State.CANCELLED
    page.get_by_role("link", name="Overview").focus()
    page.keyboard.press("Enter")
    expect(page.get_by_text("1 operation reached confirmed, failed or cancelled")).to_be_visible()


def test_every_control_of_every_page_has_a_label(
    browser: Browser, server: ApiServer, engine: Engine, alice: str
) -> None:
    """On each page, every visible input, textarea and button has an accessible name."""
    approve = make_operation(engine, State.AWAITING_APPROVAL)
    stuck = make_operation(engine, State.NEEDS_HUMAN)
    open_saga(engine, "s-labels", THREE)
    with _context(browser, bypass_csp=True) as context:
        page = context.new_page()
        page.goto(f"{server.url}/signin")
        pages = ["/signin"]
        sign_in(page, server, alice)
        pages += ["/", "/queue", f"/operations/{approve.id}", f"/operations/{stuck.id}"]
        pages += ["/sagas", "/sagas/s-labels"]
        for path in pages:
            page.goto(f"{server.url}{path}")
            unlabelled = page.locator("input:not([type=hidden]), textarea, select").evaluate_all(
                "controls => controls.filter(c => c.labels.length === 0).map(c => c.name)"
            )
            assert unlabelled == [], path
            for button in page.get_by_role("button").all():
                assert button.inner_text().strip(), path


def test_not_applied_inside_the_inflight_horizon_is_refused_saying_how_long(
    page: Page, server: ApiServer, engine: Engine, alice: str
) -> None:
    """'Not applied' right after the last send is refused (409, as the HTTP API answers it)
    with the wait; nothing written."""
    op = make_operation(engine, State.NEEDS_HUMAN)
    sign_in(page, server, alice)
    page.goto(f"{server.url}/operations/{op.id}")
    page.get_by_label("Not applied: fail it").check()
    page.get_by_label("What you checked and found").fill("not in the remote's list")
    with page.expect_response(re.compile(r"/resolve$")) as answer:
        page.get_by_role("button", name="Resolve").click()
    assert answer.value.status == 409
    expect(page.get_by_role("alert")).to_contain_text("try again in")
    assert reload(engine, op.id).state is State.NEEDS_HUMAN


def test_signing_out_ends_the_session(page: Page, server: ApiServer, alice: str) -> None:
    """After Sign out, pages lead to the sign-in form again."""
    sign_in(page, server, alice)
    page.get_by_role("button", name="Sign out").click()
    expect(page).to_have_url(re.compile(r"/signin$"))
    page.goto(f"{server.url}/queue")
    expect(page).to_have_url(re.compile(r"/signin$"))


def test_without_a_configured_secret_the_process_makes_one_and_says_so(
    database_url: str, engine: Engine, tmp_path: Path
) -> None:
    """No OUTBOX_CONSOLE_SECRET: the server logs that it made a session key; never the key."""
    env = api_environment(database_url, tmp_path)
    with running_api(env, tmp_path / "api.log") as server:
        signin = httpx.get(f"{server.url}/signin", timeout=30)
        assert signin.status_code == 200
        assert "outbox_console=" in signin.headers["set-cookie"]
        assert "httponly" in signin.headers["set-cookie"].lower()
        assert "samesite=strict" in signin.headers["set-cookie"].lower()
        logs = server.logs()
    assert f"action={Action.CONSOLE_SESSION_KEY_MADE}" in logs
    assert "OUTBOX_CONSOLE_SECRET is unset" in logs


# --- sagas ----------------------------------------------------------------------------------

#: Set (with OUTBOX_WRITE_DOCS_SCREENSHOT=1) to write docs/console.md's saga page screenshot.
DOCS_SAGA_SCREENSHOT = DOCS_SCREENSHOT.parent / "console-saga.png"


def test_the_sagas_page_and_a_compensated_sagas_timeline(
    page: Page, server: ApiServer, engine: Engine, alice: str, shots: Path
) -> None:
    """The Sagas page lists sagas by state, newest first; a compensated saga's page shows its
    steps in order with their operations, remote references and undos, and its trail."""
    compensated_saga(engine, "release-1.2.3")
    open_saga(engine, "release-1.2.4", THREE)
    sign_in(page, server, alice)
    page.get_by_role("link", name="Sagas", exact=True).click()
    expect(page.get_by_role("heading", name="Sagas", level=1)).to_be_visible()
    rows = page.get_by_role("row")
    expect(rows).to_have_count(3)
    expect(rows.nth(1)).to_contain_text("release-1.2.4")
    expect(rows.nth(2)).to_contain_text("compensated")
    by_state = page.get_by_role("navigation", name="Sagas by state")
    expect(by_state).to_contain_text("running (1)")
    expect(by_state).to_contain_text("compensated (1)")
    by_state.get_by_role("link", name="compensated").click()
    expect(page.get_by_role("row")).to_have_count(2)
    page.screenshot(path=shots / "sagas.png", full_page=True)
    page.get_by_role("link", name="release-1.2.3").click()
    expect(page).to_have_url(f"{server.url}/sagas/release-1.2.3?agent=agent-7")
    expect(page.locator("#saga-reason")).to_contain_text(
        "step announce was refused (failed); every confirmed step compensated"
    )
    steps = page.get_by_role("list", name="The steps, in order").locator(":scope > li")
    expect(steps).to_have_count(3)
    expect(steps.nth(0)).to_contain_text("release")
    expect(steps.nth(0)).to_contain_text("rel-42")
    expect(steps.nth(1)).to_contain_text("lb-change-7")
    expect(steps.nth(1)).to_contain_text("lb.point → lb-1: confirmed")
    expect(steps.nth(2)).to_contain_text("failed")
    expect(steps.nth(2)).to_contain_text("none declared")
    trail = page.get_by_role("table").filter(has_text="Every move and note of the saga")
    expect(trail.get_by_role("row").last).to_contain_text("compensating → compensated")
    expect(page.get_by_role("button", name="Cancel this saga")).to_have_count(0)
    page.screenshot(path=shots / "saga.png", full_page=True)
    if os.environ.get("OUTBOX_WRITE_DOCS_SCREENSHOT") == "1":
        page.screenshot(path=DOCS_SAGA_SCREENSHOT, full_page=True)
    steps.nth(2).get_by_role("link", name="failed").click()
    expect(page.get_by_role("heading", level=1)).to_contain_text("chat.post")
    page.get_by_role("link", name="release-1.2.3").click()
    expect(page).to_have_url(f"{server.url}/sagas/release-1.2.3?agent=agent-7")


def test_a_saga_held_by_an_undo_in_needs_human_links_to_it(
    page: Page, server: ApiServer, engine: Engine, alice: str
) -> None:
    """A needs_human saga says which operation a person must resolve, and links to it."""
    release, point, _ = open_saga(engine, "s-human", THREE)
    finish(engine, release.id, State.CONFIRMED)
    advance(engine, "s-human")
    finish(engine, point.id, State.FAILED)
    advance(engine, "s-human")
    undo = view(engine, "s-human").steps[0].compensation_operation_id
    assert undo is not None
    finish(engine, undo, State.NEEDS_HUMAN)
    advance(engine, "s-human")
    sign_in(page, server, alice)
    page.goto(f"{server.url}/sagas/s-human")
    expect(page.locator("#saga-reason")).to_contain_text("needs a human")
    blockers = page.locator("#blockers")
    expect(blockers).to_contain_text("Step release, its undo")
    blockers.get_by_role("link", name="needs_human").click()
    expect(page).to_have_url(f"{server.url}/operations/{undo}")
    expect(page.get_by_role("heading", name="Resolve")).to_be_visible()
    expect(page.locator("#saga-link")).to_have_text("s-human")


def test_a_running_saga_is_cancelled_through_the_form(
    page: Page, server: ApiServer, engine: Engine, alice: str, shots: Path
) -> None:
    """Cancel on a running saga's page (its key holding a slash and a space) cancels it under
    alice's name (actor operator)."""
    key = "team-a/release 1.2.4"
    ops = open_saga(engine, key, THREE)
    sign_in(page, server, alice)
    page.goto(f"{server.url}/sagas")
    page.get_by_role("link", name=key).click()
    expect(page.get_by_role("heading", level=1)).to_contain_text(key)
    page.get_by_label("Why cancel it").fill("wrong version")
    page.get_by_role("button", name="Cancel this saga").click()
    expect(page.get_by_role("status")).to_contain_text("cancelled by alice")
    expect(page.locator("#saga-reason")).to_contain_text("cancelled")
    page.screenshot(path=shots / "cancelled.png", full_page=True)
    saga = view(engine, key)
    assert (saga.state, saga.cancelled_by) == (SagaState.CANCELLED, "alice")
    moved = [e for e in saga.events if e.from_state is SagaState.RUNNING and e.detail]
    assert [(e.actor, e.detail) for e in moved] == [
        ("operator", {"by": "alice", "reason": "wrong version"})
    ]
    assert [reload(engine, op.id).state for op in ops] == [State.CANCELLED] * 3


def test_saga_pages_and_cancel_need_a_signed_in_operator(server: ApiServer, engine: Engine) -> None:
    """Without a session the saga pages redirect to the sign-in form, and a cancel does nothing."""
    open_saga(engine, "s-anonymous", THREE)
    for path in ("/sagas", "/sagas/s-anonymous"):
        answer = httpx.get(f"{server.url}{path}", timeout=30)
        assert (answer.status_code, answer.headers["location"]) == (303, "/signin"), path
    posted = httpx.post(
        f"{server.url}/sagas/s-anonymous/cancel", data={"reason": "x", "csrf": "x"}, timeout=30
    )
    assert (posted.status_code, posted.headers["location"]) == (303, "/signin")
    assert view(engine, "s-anonymous").state is SagaState.RUNNING


def test_a_saga_cancel_posted_without_its_csrf_token_is_refused(
    browser: Browser, server: ApiServer, engine: Engine, alice: str
) -> None:
    """A cancel form whose CSRF field was removed gets the 403 page; the saga runs on."""
    open_saga(engine, "s-csrf", THREE)
    with _context(browser, bypass_csp=True) as context:
        page = context.new_page()
        sign_in(page, server, alice)
        page.goto(f"{server.url}/sagas/s-csrf")
        page.locator('form[action$="/cancel"] input[name="csrf"]').evaluate("e => e.remove()")
        page.get_by_label("Why cancel it").fill("no token")
        with page.expect_response(re.compile(r"/cancel$")) as answer:
            page.get_by_role("button", name="Cancel this saga").click()
        assert answer.value.status == 403
        expect(page.get_by_role("heading", level=1)).to_contain_text("Refused")
    saga = view(engine, "s-csrf")
    assert (saga.state, saga.cancelled_by) == (SagaState.RUNNING, None)
