"""``outbox webhooks list``, run as a real subprocess against a real PostgreSQL."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from uuid import UUID

import pytest
from sqlalchemy import Engine, text

from outbox.config import get_settings
from outbox.states import State
from tests.acceptance.conftest import Result, run_outbox
from tests.factories import make_operation

SECRET = "whsec_" + base64.b64encode(bytes(range(100, 132))).decode()
# Nothing listens there; listing never sends anything.
URL = "http://127.0.0.1:9/hooks"


@pytest.fixture
def webhook_env(cli_env: dict[str, str]) -> dict[str, str]:
    """The CLI's environment with webhooks configured."""
    return cli_env | {"OUTBOX_WEBHOOK_URL": URL, "OUTBOX_WEBHOOK_SECRET": SECRET}


@pytest.fixture
def escalations(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[UUID]]:
    """Two escalated operations recorded with webhooks on; the first one's delivery delivered."""
    monkeypatch.setenv("OUTBOX_WEBHOOK_URL", URL)
    monkeypatch.setenv("OUTBOX_WEBHOOK_SECRET", SECRET)
    monkeypatch.delenv("OUTBOX_WEBHOOK_EVENTS", raising=False)
    get_settings.cache_clear()
    try:
        ops = [make_operation(engine, State.NEEDS_HUMAN).id for _ in range(2)]
    finally:
        get_settings.cache_clear()
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox.webhook_deliveries SET status = 'delivered', attempts = 1, "
                "last_status = 200, delivered_at = clock_timestamp() WHERE operation_id = :op"
            ),
            {"op": ops[0]},
        )
    yield ops
    get_settings.cache_clear()


def _assert_one_line_error(result: Result, *fragments: str) -> None:
    assert result.code == 1, result
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_list_json_prints_every_delivery_newest_first(
    webhook_env: dict[str, str], escalations: list[UUID]
) -> None:
    """`webhooks list --json` prints each delivery with its operation, event, status and times."""
    listed = run_outbox("webhooks", "list", "--json", env=webhook_env)
    assert listed.code == 0, listed.stderr
    body = listed.json()
    assert [row["operation_id"] for row in body] == [str(op) for op in reversed(escalations)]
    assert [row["status"] for row in body] == ["pending", "delivered"]
    newest = body[0]
    assert newest["event"] == "needs_human"
    assert newest["payload"]["type"] == "operation.needs_human"
    for field in ("id", "attempts", "next_attempt_at", "last_status", "last_error", "created_at"):
        assert field in newest
    assert body[1]["delivered_at"] is not None
    assert SECRET not in listed.stdout


def test_list_filters_by_status_and_limits(
    webhook_env: dict[str, str], escalations: list[UUID]
) -> None:
    """--status keeps only that status; --limit bounds the count."""
    pending = run_outbox("webhooks", "list", "--status", "pending", "--json", env=webhook_env)
    assert [row["operation_id"] for row in pending.json()] == [str(escalations[1])]
    delivered = run_outbox("webhooks", "list", "--status", "DELIVERED", "--json", env=webhook_env)
    assert [row["operation_id"] for row in delivered.json()] == [str(escalations[0])]
    abandoned = run_outbox("webhooks", "list", "--status", "abandoned", env=webhook_env)
    assert abandoned.code == 0, abandoned.stderr
    assert "no deliveries with status abandoned" in abandoned.stdout
    assert (
        len(run_outbox("webhooks", "list", "--limit", "1", "--json", env=webhook_env).json()) == 1
    )


def test_list_prints_a_table_for_people(
    webhook_env: dict[str, str], escalations: list[UUID]
) -> None:
    """The table names each delivery, its operation, status, attempts and when it is next tried."""
    listed = run_outbox("webhooks", "list", env=webhook_env)
    assert listed.code == 0, listed.stderr
    for header in ("id", "event", "operation", "status", "attempts", "next attempt", "created"):
        assert header in listed.stdout
    for op in escalations:
        assert str(op) in listed.stdout
    assert "needs_human" in listed.stdout
    assert "delivered" in listed.stdout
    assert "due" in listed.stdout


def test_list_with_webhooks_off_says_so(cli_env: dict[str, str], engine: Engine) -> None:
    """With no URL configured and no rows, the list says webhooks are off."""
    listed = run_outbox("webhooks", "list", env=cli_env)
    assert listed.code == 0, listed.stderr
    assert "webhooks are off" in listed.stdout


def test_a_url_without_a_secret_is_a_one_line_error(cli_env: dict[str, str]) -> None:
    """OUTBOX_WEBHOOK_URL without OUTBOX_WEBHOOK_SECRET: exit 1, one line naming the variable."""
    result = run_outbox("webhooks", "list", env=cli_env | {"OUTBOX_WEBHOOK_URL": URL})
    _assert_one_line_error(result, "OUTBOX_WEBHOOK_SECRET")


def test_a_non_http_url_is_a_one_line_error(cli_env: dict[str, str]) -> None:
    """A webhook URL that is not http(s): exit 1, one line naming OUTBOX_WEBHOOK_URL."""
    env = cli_env | {
        "OUTBOX_WEBHOOK_URL": "ftp://hooks.example.com/",
        "OUTBOX_WEBHOOK_SECRET": SECRET,
    }
    _assert_one_line_error(run_outbox("webhooks", "list", env=env), "OUTBOX_WEBHOOK_URL")


def test_an_unknown_status_is_a_usage_error(cli_env: dict[str, str]) -> None:
    """--status with a value that is not a delivery status exits 2 without a traceback."""
    result = run_outbox("webhooks", "list", "--status", "lost", env=cli_env)
    assert result.code == 2
    assert "Traceback" not in result.stderr
    assert "lost" in result.stderr
