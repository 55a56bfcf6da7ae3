"""`outbox operators add|list|remove`, run as a real subprocess against a real PostgreSQL."""

from __future__ import annotations

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import operators
from tests.acceptance.conftest import CLI
from tests.acceptance.test_cli_resolve import assert_one_line_error

PASSWORD = "correct horse battery"  # noqa: S105 -- a test account's


def stored_hashes(engine: Engine) -> list[str]:
    """Every password hash the database holds."""
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT password_hash FROM outbox.operators")).scalars())


def test_add_reads_the_password_from_stdin_and_stores_an_argon2id_hash(
    outbox_cli: CLI, engine: Engine
) -> None:
    """`operators add --password-stdin` stores an argon2id hash that verifies the password."""
    done = outbox_cli("operators", "add", "alice", "--password-stdin", stdin=PASSWORD + "\n")
    assert done.code == 0, done.stderr
    assert "'alice' added" in done.stdout
    assert PASSWORD not in done.stdout + done.stderr
    [stored] = stored_hashes(engine)
    assert stored.startswith("$argon2id$")
    with Session(engine) as session, session.begin():
        found = operators.authenticate(session, "alice", PASSWORD)
        assert found is not None
        assert found.name == "alice"
        assert operators.authenticate(session, "alice", PASSWORD + "!") is None


def test_add_without_a_terminal_or_password_stdin_is_a_usage_error(
    outbox_cli: CLI, engine: Engine
) -> None:
    """Without a terminal to prompt on and without --password-stdin, add exits 2; nothing stored."""
    done = outbox_cli("operators", "add", "bob", stdin="")
    assert done.code == 2, done.stderr
    assert "--password-stdin" in done.stderr
    assert stored_hashes(engine) == []


def test_a_short_password_or_a_bad_name_is_refused(outbox_cli: CLI, engine: Engine) -> None:
    """A password under 12 characters and a malformed name are each one error line."""
    short = outbox_cli("operators", "add", "carol", "--password-stdin", stdin="short\n")
    assert_one_line_error(short, "12")
    spaced = outbox_cli("operators", "add", "has space", "--password-stdin", stdin=PASSWORD)
    assert_one_line_error(spaced, "'has space'")
    assert stored_hashes(engine) == []


def test_list_shows_names_never_a_hash(outbox_cli: CLI, engine: Engine) -> None:
    """`operators list` (table and --json) names each account and never shows a hash."""
    assert outbox_cli("operators", "add", "dave", "--password-stdin", stdin=PASSWORD).code == 0
    listed = outbox_cli("operators", "list", "--json")
    assert listed.code == 0, listed.stderr
    assert [(row["name"], row["removed_at"]) for row in listed.json()] == [("dave", None)]
    table = outbox_cli("operators", "list")
    assert "dave" in table.stdout
    for output in (listed.stdout, table.stdout):
        assert "$argon2" not in output


def test_remove_stops_sign_in_and_keeps_the_name_taken(outbox_cli: CLI, engine: Engine) -> None:
    """A removed account no longer authenticates, and its name cannot be added again."""
    assert outbox_cli("operators", "add", "erin", "--password-stdin", stdin=PASSWORD).code == 0
    done = outbox_cli("operators", "remove", "erin")
    assert done.code == 0, done.stderr
    assert "removed" in done.stdout
    with Session(engine) as session, session.begin():
        assert operators.authenticate(session, "erin", PASSWORD) is None
    again = outbox_cli("operators", "add", "erin", "--password-stdin", stdin=PASSWORD)
    assert_one_line_error(again, "'erin' exists already")
    assert len(stored_hashes(engine)) == 1


def test_removing_an_unknown_name_is_one_line(outbox_cli: CLI, engine: Engine) -> None:
    """`operators remove` of a name nobody has exits 1 naming it."""
    assert_one_line_error(outbox_cli("operators", "remove", "ghost"), "no operator named 'ghost'")


def test_sign_out_all_ends_every_session_of_that_operator_only(
    outbox_cli: CLI, engine: Engine
) -> None:
    """`operators sign-out-all NAME` ends each of NAME's console sessions and says how many;
    another operator's session stays."""
    for name in ("frank", "gina"):
        assert outbox_cli("operators", "add", name, "--password-stdin", stdin=PASSWORD).code == 0
    with Session(engine) as session, session.begin():
        franks = [operators.start_session(session, "frank") for _ in range(2)]
        ginas = operators.start_session(session, "gina")
    done = outbox_cli("operators", "sign-out-all", "frank")
    assert done.code == 0, done.stderr
    assert "'frank': 2 sessions ended" in done.stdout
    again = outbox_cli("operators", "sign-out-all", "frank", "--json")
    assert again.json() == {"name": "frank", "sessions_ended": 0}
    with Session(engine) as session:
        assert [operators.session_operator(session, s) for s in franks if s] == [None, None]
        assert ginas is not None
        live = operators.session_operator(session, ginas)
        assert live is not None
        assert live.name == "gina"


def test_sign_out_all_of_an_unknown_name_or_without_one_is_refused(
    outbox_cli: CLI, engine: Engine
) -> None:
    """`operators sign-out-all` of a name nobody has exits 1 naming it; without a name, 2."""
    assert_one_line_error(outbox_cli("operators", "sign-out-all", "ghost"), "'ghost'")
    assert outbox_cli("operators", "sign-out-all").code == 2


def test_set_password_replaces_the_password_and_ends_the_sessions(
    outbox_cli: CLI, engine: Engine
) -> None:
    """`operators set-password NAME --password-stdin`: the new password signs in, the old one
    no longer does, and NAME's sessions have ended; nothing printed holds the password."""
    assert outbox_cli("operators", "add", "hana", "--password-stdin", stdin=PASSWORD).code == 0
    with Session(engine) as session, session.begin():
        started = operators.start_session(session, "hana")
    assert started is not None
    new = "a new password for hana"
    done = outbox_cli("operators", "set-password", "hana", "--password-stdin", stdin=new + "\n")
    assert done.code == 0, done.stderr
    assert "every session ended" in done.stdout
    assert new not in done.stdout + done.stderr
    with Session(engine) as session, session.begin():
        assert operators.session_operator(session, started) is None
        assert operators.authenticate(session, "hana", PASSWORD) is None
        assert operators.authenticate(session, "hana", new) is not None


def test_set_password_refusals_are_one_line(outbox_cli: CLI, engine: Engine) -> None:
    """A short new password, an unknown or removed name: one error line each (exit 1);
    without a terminal or --password-stdin, exit 2."""
    assert outbox_cli("operators", "add", "ivan", "--password-stdin", stdin=PASSWORD).code == 0
    short = outbox_cli("operators", "set-password", "ivan", "--password-stdin", stdin="short\n")
    assert_one_line_error(short, "12")
    ghost = outbox_cli("operators", "set-password", "ghost", "--password-stdin", stdin=PASSWORD)
    assert_one_line_error(ghost, "'ghost'")
    assert outbox_cli("operators", "remove", "ivan").code == 0
    removed = outbox_cli("operators", "set-password", "ivan", "--password-stdin", stdin=PASSWORD)
    assert_one_line_error(removed, "'ivan'")
    assert outbox_cli("operators", "set-password", "ivan", stdin="").code == 2
