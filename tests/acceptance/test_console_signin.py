"""The console's sign-in under load and its sessions' end, against real `outbox api`
subprocesses on a real PostgreSQL: concurrent sign-ins (real concurrent HTTP requests, each
with its own cookie and CSRF token, from client addresses of their own) checked against the
throttle's limit, a burst of unknown names refused beyond the password checks' queue while an
agent's enqueue still answers, and a copied session cookie refused (in Chromium and over
plain HTTP) once its session ended: sign-out, a password change, a removal, sign-out-all.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, expect
from sqlalchemy import Engine

from outbox.logs import Action
from outbox.models import TokenScope
from tests.acceptance.conftest import CLI
from tests.acceptance.test_api import enqueue, known_tool, make_token
from tests.acceptance.test_console import (
    PASSWORD,
    _context,
    _environment,
    _signed_in,
    add_operator,
    browser,
    playwright,
    sign_in,
)
from tests.api_server import ApiServer, running_api

pytestmark = pytest.mark.slow

__all__ = ["browser", "known_tool", "playwright"]  # fixtures, used by name

_CSRF = re.compile(r'name="csrf" value="([^"]+)"')
_CHECKS = re.compile(r"^outbox_console_password_checks_total (\S+)$", re.MULTILINE)
#: The throttle's limit (the default) and the short lockout these servers run with.
LIMIT = 5
LOCKOUT_S = 3


@pytest.fixture(scope="module")
def server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """One `outbox api` whose lockout is short and whose password checks queue every sign-in
    of a burst of 40 (none refused as busy: the throttle alone decides)."""
    home = tmp_path_factory.mktemp("signin")
    env = _environment(database_url, home) | {
        "OUTBOX_CONSOLE_SIGNIN_LOCKOUT": str(LOCKOUT_S),
        "OUTBOX_CONSOLE_HASH_QUEUE": "100",
    }
    with running_api(env, home / "api.log") as running:
        yield running


def password_checks(server: ApiServer, *, before: bool = False) -> int:
    """How many passwords the server has checked with argon2 (its /metrics counter); 0 when
    ``before`` a burst and the counter is missing (the assertions after it say so)."""
    found = _CHECKS.search(httpx.get(f"{server.url}/metrics", timeout=30).text)
    if found is None and before:
        return 0
    assert found is not None, "no outbox_console_password_checks_total on /metrics"
    return int(float(found[1]))


def sign_in_at_once(
    server: ApiServer, forms: list[dict[str, str]], address: Callable[[int], str]
) -> list[httpx.Response]:
    """POST /signin with each of ``forms`` at the same moment, each from its own client (its
    cookie and CSRF token from its own GET /signin) bound to the address ``address(i)``."""
    clients = []
    try:
        for i in range(len(forms)):
            transport = httpx.HTTPTransport(local_address=address(i))
            client = httpx.Client(base_url=server.url, transport=transport, timeout=120)
            clients.append(client)
        tokens = []
        for client in clients:
            token = _CSRF.search(client.get("/signin").text)
            assert token is not None
            tokens.append(token[1])
        start = threading.Barrier(len(forms))

        def post(i: int) -> httpx.Response:
            start.wait()
            return clients[i].post("/signin", data=forms[i] | {"csrf": tokens[i]})

        with ThreadPoolExecutor(len(forms)) as pool:
            return list(pool.map(post, range(len(forms))))
    finally:
        for client in clients:
            client.close()


def statuses(answers: list[httpx.Response]) -> Counter[int]:
    """How many answers had each status."""
    return Counter(answer.status_code for answer in answers)


def test_forty_concurrent_wrong_passwords_for_one_name_check_at_most_the_limit(
    server: ApiServer, engine: Engine
) -> None:
    """Of 40 simultaneous wrong passwords for one name, from 40 addresses, 5 are checked and
    35 refused (429); once the lockout lapses another 40 get one check."""
    name = add_operator(engine, "carol")
    wrong = [{"name": name, "password": f"wrong password {i}"} for i in range(40)]
    before = password_checks(server, before=True)
    first = sign_in_at_once(server, wrong, lambda i: f"127.0.3.{i + 1}")
    assert statuses(first) == {401: LIMIT, 429: 40 - LIMIT}
    assert password_checks(server) - before == LIMIT
    for refused in (answer for answer in first if answer.status_code == 429):
        assert "this name" in refused.text
        assert int(refused.headers["retry-after"]) >= 1
    time.sleep(LOCKOUT_S + 1)  # the lockout lapses; the 5 failures stay in the window
    second = sign_in_at_once(server, wrong, lambda i: f"127.0.4.{i + 1}")
    assert statuses(second) == {401: 1, 429: 39}
    assert password_checks(server) - before == LIMIT + 1


def test_forty_concurrent_sign_ins_from_one_address_check_at_most_the_limit(
    server: ApiServer, engine: Engine
) -> None:
    """Of 40 simultaneous sign-ins with 40 names (known and unknown) from one address, 5
    passwords are checked and 35 refused (429), naming the address."""
    names = [add_operator(engine, f"dana{i}") if i % 2 else f"nobody{i}" for i in range(40)]
    forms = [{"name": name, "password": "a wrong password"} for name in names]
    before = password_checks(server, before=True)
    answers = sign_in_at_once(server, forms, lambda _: "127.0.5.1")
    assert statuses(answers) == {401: LIMIT, 429: 40 - LIMIT}
    assert password_checks(server) - before == LIMIT
    assert all("this address" in a.text for a in answers if a.status_code == 429)


def test_a_burst_of_unknown_names_is_refused_beyond_the_queue_and_enqueue_still_answers(
    database_url: str, engine: Engine, known_tool: str, tmp_path: Path
) -> None:
    """150 simultaneous sign-ins with unknown names and 1 KiB passwords, from 150 addresses,
    get 401 (each checked with argon2 against the dummy hash) or 503 with Retry-After (the
    queue is full), never a 500, while an agent's enqueue answers 201."""
    env = _environment(database_url, tmp_path) | {
        "OUTBOX_CONSOLE_HASH_THREADS": "1",
        "OUTBOX_CONSOLE_HASH_QUEUE": "4",
    }
    agent_token = make_token(engine, "agent-a", TokenScope.AGENT)
    forms = [{"name": f"nobody-{i}", "password": "x" * 1024} for i in range(150)]
    with running_api(env, tmp_path / "api.log") as server:
        before = password_checks(server, before=True)
        enqueued: list[int] = []

        def agent() -> None:
            headers = {"Authorization": f"Bearer {agent_token}"}
            with httpx.Client(base_url=server.url, headers=headers, timeout=120) as client:
                enqueued.extend(enqueue(client, f"burst-{n}").status_code for n in range(3))

        with ThreadPoolExecutor(1) as side:
            running = side.submit(agent)
            answers = sign_in_at_once(server, forms, lambda i: f"127.0.6.{i + 1}")
            running.result()
        counted = statuses(answers)
        assert set(counted) <= {401, 503}, counted
        assert counted[503] > 0  # the queue is bounded: refused at once, not queued
        assert password_checks(server) - before == counted[401] > 0  # each 401 ran argon2
        logs = server.logs()
    assert all(a.headers["retry-after"] == "2" for a in answers if a.status_code == 503)
    assert enqueued == [201, 201, 201]
    assert f"action={Action.CONSOLE_SIGNIN_BUSY}" in logs
    assert "x" * 64 not in logs


# --- sessions ---------------------------------------------------------------------------------


def _copied_cookie_works(server: ApiServer, cookie: str) -> bool:
    """Whether a plain HTTP client holding only ``cookie`` is let in to the overview."""
    answer = httpx.get(f"{server.url}/", cookies={"outbox_console": cookie}, timeout=30)
    return answer.status_code == 200 and "Signed in as" in answer.text


@pytest.mark.parametrize("end", ["sign-out", "set-password", "remove", "sign-out-all"])
def test_a_copied_session_cookie_is_refused_once_its_session_ended(
    browser: Browser, server: ApiServer, engine: Engine, outbox_cli: CLI, end: str
) -> None:
    """A copy of alice's session cookie works until she signs out, her password changes, her
    account is removed or `outbox operators sign-out-all alice` runs; then it and her browser
    are sent to the sign-in form. Sign-out ends that session only; the others end all hers;
    bob's session stays."""
    alice, bob = add_operator(engine, "alice"), add_operator(engine, "bob")
    other_alice, _ = _signed_in(server, alice)
    bobs, _ = _signed_in(server, bob)
    with _context(browser) as context:
        page = context.new_page()
        sign_in(page, server, alice)
        expect(page.get_by_role("heading", name="Overview")).to_be_visible()
        [cookie] = [c["value"] for c in context.cookies() if c["name"] == "outbox_console"]
        assert _copied_cookie_works(server, cookie)  # the control: a copy works while live
        if end == "sign-out":
            page.get_by_role("button", name="Sign out").click()
            expect(page).to_have_url(re.compile(r"/signin$"))
        else:
            args = {
                "set-password": ("set-password", alice, "--password-stdin"),
                "remove": ("remove", alice),
                "sign-out-all": ("sign-out-all", alice),
            }[end]
            done = outbox_cli("operators", *args, stdin="a brand new password\n")
            assert done.code == 0, done.stderr
        assert not _copied_cookie_works(server, cookie)
        page.goto(f"{server.url}/queue")
        expect(page).to_have_url(re.compile(r"/signin$"))
    try:
        assert (other_alice.get("/").status_code == 200) is (end == "sign-out")
        assert bobs.get("/").status_code == 200
    finally:
        other_alice.close()
        bobs.close()


def test_after_a_password_change_only_the_new_password_signs_in(
    browser: Browser, server: ApiServer, engine: Engine, outbox_cli: CLI
) -> None:
    """After a password change the old password is refused and the new one signs in."""
    alice = add_operator(engine, "alice")
    done = outbox_cli(
        "operators", "set-password", alice, "--password-stdin", stdin="new one here!\n"
    )
    assert done.code == 0, done.stderr
    with _context(browser) as context:
        page = context.new_page()
        sign_in(page, server, alice, PASSWORD)
        expect(page.get_by_role("alert")).to_have_text("Wrong name or password.")
        sign_in(page, server, alice, "new one here!")
        expect(page.get_by_role("heading", name="Overview")).to_be_visible()
