"""Operator accounts in a real PostgreSQL: argon2id hashes, sign-in checks, removal, rehash."""

from __future__ import annotations

import pytest
from argon2 import PasswordHasher
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from outbox import operators, sql
from outbox.errors import OperatorNotFound, OperatorRefused

PASSWORD = "correct horse battery"  # noqa: S105 -- a test account's


def stored_hash(engine: Engine, name: str) -> str:
    """The password hash the database holds for ``name``."""
    with engine.connect() as conn:
        found = conn.execute(
            text("SELECT password_hash FROM outbox.operators WHERE name = :n"), {"n": name}
        )
        return str(found.scalar_one())


def test_only_the_right_password_of_a_live_account_authenticates(engine: Engine) -> None:
    """The right password signs in; a wrong one, an unknown name or a removed account do not."""
    with Session(engine) as session, session.begin():
        made = operators.add_operator(session, name="alice", password=PASSWORD)
        assert operators.authenticate(session, "alice", PASSWORD) == made
        assert operators.authenticate(session, "alice", "wrong password!") is None
        assert operators.authenticate(session, "nobody", PASSWORD) is None
        assert operators.authenticate(session, "not a name", PASSWORD) is None
        operators.remove_operator(session, "alice")
        assert operators.authenticate(session, "alice", PASSWORD) is None
        assert operators.get_live_operator(session, "alice") is None


def test_a_hash_with_weaker_parameters_is_renewed_at_sign_in(engine: Engine) -> None:
    """A hash made with lower argon2 costs is replaced by one with today's, same password."""
    weak = PasswordHasher(time_cost=1, memory_cost=8192).hash(PASSWORD)
    with Session(engine) as session, session.begin():
        operators.add_operator(session, name="bob", password=PASSWORD)
        sql.operators.rehash_operator(session, name="bob", password_hash=weak)
    with Session(engine) as session, session.begin():
        assert operators.authenticate(session, "bob", PASSWORD) is not None
    renewed = stored_hash(engine, "bob")
    assert renewed != weak
    assert not PasswordHasher().check_needs_rehash(renewed)


def test_the_database_refuses_a_hash_that_is_not_argon2id(engine: Engine) -> None:
    """ck_operators_password_hash_argon2id: no plain or other-scheme hash can be stored."""
    with Session(engine) as session, session.begin():
        operators.add_operator(session, name="carol", password=PASSWORD)
    with (
        pytest.raises(IntegrityError, match="ck_operators_password_hash_argon2id"),
        Session(engine) as session,
        session.begin(),
    ):
        sql.operators.rehash_operator(session, name="carol", password_hash="plain")  # noqa: S106


def test_refusals_name_the_field_and_write_nothing(engine: Engine) -> None:
    """A bad name, a short password, a taken name, an unknown removal: named errors."""
    with Session(engine) as session, session.begin():
        with pytest.raises(OperatorRefused) as bad_name:
            operators.add_operator(session, name="-x", password=PASSWORD)
        assert bad_name.value.field == "name"
        with pytest.raises(OperatorRefused) as short:
            operators.add_operator(session, name="dave", password="short")  # noqa: S106
        assert short.value.field == "password"
        operators.add_operator(session, name="erin", password=PASSWORD)
        with pytest.raises(OperatorRefused, match="exists already"):
            operators.add_operator(session, name="erin", password=PASSWORD)
        with pytest.raises(OperatorNotFound):
            operators.remove_operator(session, "ghost")
        assert [op.name for op in operators.list_operators(session)] == ["erin"]
