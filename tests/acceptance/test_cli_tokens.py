"""`outbox tokens create|list|revoke`, run as a real subprocess against a real PostgreSQL."""

from __future__ import annotations

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import tokens
from tests.acceptance.conftest import CLI
from tests.acceptance.test_cli_resolve import assert_one_line_error


def stored_hashes(engine: Engine) -> list[str]:
    """Every token hash the database holds."""
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT token_hash FROM outbox.api_tokens")).scalars())


def test_create_prints_the_token_once_and_stores_only_its_hash(
    outbox_cli: CLI, engine: Engine
) -> None:
    """`tokens create` prints the token alone on stdout, warns on stderr, and stores its sha256."""
    done = outbox_cli("tokens", "create", "billing-agent", "--scope", "agent")
    assert done.code == 0, done.stderr
    token = done.stdout.strip()
    assert token.startswith("obx_")
    assert len(done.stdout.splitlines()) == 1
    assert "only time" in done.stderr
    assert stored_hashes(engine) == [tokens.hash_token(token)]
    with Session(engine) as session, session.begin():
        found = tokens.authenticate(session, token)
    assert found is not None
    assert (found.name, found.scope.value) == ("billing-agent", "agent")


def test_list_shows_names_and_scopes_never_a_hash(outbox_cli: CLI, engine: Engine) -> None:
    """`tokens list --json` names each token and scope, and neither a token nor its hash."""
    made = outbox_cli("tokens", "create", "ops-alice", "--scope", "operator").stdout.strip()
    listed = outbox_cli("tokens", "list", "--json")
    assert listed.code == 0, listed.stderr
    rows = listed.json()
    assert [(row["name"], row["scope"], row["revoked_at"]) for row in rows] == [
        ("ops-alice", "operator", None)
    ]
    table = outbox_cli("tokens", "list")
    for output in (listed.stdout, table.stdout):
        assert made not in output
        assert tokens.hash_token(made) not in output
    assert "ops-alice" in table.stdout


def test_revoke_refuses_the_token_afterwards(outbox_cli: CLI, engine: Engine) -> None:
    """After `tokens revoke NAME` the token no longer authenticates and the list says revoked."""
    made = outbox_cli("tokens", "create", "temp", "--scope", "agent").stdout.strip()
    done = outbox_cli("tokens", "revoke", "temp")
    assert done.code == 0, done.stderr
    assert "revoked" in done.stdout
    with Session(engine) as session, session.begin():
        assert tokens.authenticate(session, made) is None
    assert outbox_cli("tokens", "list", "--json").json()[0]["revoked_at"] is not None


def test_a_taken_name_is_refused_even_once_revoked(outbox_cli: CLI, engine: Engine) -> None:
    """A second token with a name already used (even revoked) is one error line; nothing new."""
    assert outbox_cli("tokens", "create", "dup", "--scope", "agent").code == 0
    assert outbox_cli("tokens", "revoke", "dup").code == 0
    again = outbox_cli("tokens", "create", "dup", "--scope", "operator")
    assert_one_line_error(again, "'dup' exists already")
    assert len(stored_hashes(engine)) == 1


def test_revoking_an_unknown_name_is_one_line(outbox_cli: CLI, engine: Engine) -> None:
    """`tokens revoke` of a name nobody has exits 1 naming it."""
    assert_one_line_error(outbox_cli("tokens", "revoke", "ghost"), "no API token named 'ghost'")


def test_a_bad_scope_or_name_is_refused(outbox_cli: CLI, engine: Engine) -> None:
    """An unknown scope is a usage error (exit 2); a malformed name, one line naming it."""
    assert outbox_cli("tokens", "create", "x", "--scope", "root").code == 2
    assert_one_line_error(
        outbox_cli("tokens", "create", "has space", "--scope", "agent"), "'has space'"
    )
    assert stored_hashes(engine) == []
