"""The deployment name, derived from a real PostgreSQL's identity or set by OUTBOX_DEPLOYMENT."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import make_url, text

from outbox import migrate
from outbox.config import load_settings
from outbox.db import create_engine
from outbox.deployment import DERIVED_PREFIX, deployment_name, derived_name
from outbox.errors import ConfigError, DatabaseUnavailable
from tests.conftest import Databases


@pytest.fixture
def other_database(databases: Databases) -> str:
    """A second migrated database on the same server: another deployment."""
    url = databases.create()
    engine = create_engine(url)
    migrate.upgrade(engine)
    engine.dispose()
    return url


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spelled_differently(url: str) -> str:
    """The same database through another URL (another host spelling, an option added)."""
    parsed = make_url(url)
    if parsed.host in ("127.0.0.1", "localhost"):
        host = "localhost" if parsed.host == "127.0.0.1" else "127.0.0.1"
        parsed = parsed.set(host=host)
    return parsed.update_query_dict({"application_name": "another-process"}).render_as_string(
        hide_password=False
    )


def test_every_process_of_a_deployment_derives_one_name(
    database_url: str, other_database: str
) -> None:
    """Two URLs of one database give one name; another database on the same server another."""
    name = deployment_name(load_settings(database_url=database_url))
    assert name.startswith(DERIVED_PREFIX)
    assert len(name) == len(DERIVED_PREFIX) + 12
    assert derived_name(_spelled_differently(database_url)) == name
    assert deployment_name(load_settings(database_url=other_database)) != name


def test_outbox_deployment_wins_without_asking_the_database() -> None:
    """OUTBOX_DEPLOYMENT is used as given, with no round trip (the URL leads nowhere)."""
    nowhere = f"postgresql://postgres@127.0.0.1:{_free_port()}/nothing"
    settings = load_settings(database_url=nowhere, deployment="blue")
    assert deployment_name(settings) == "blue"


def test_an_unreachable_database_is_a_clear_error() -> None:
    """Deriving the name from a database that does not answer raises DatabaseUnavailable."""
    nowhere = f"postgresql://postgres@127.0.0.1:{_free_port()}/nothing"
    with pytest.raises(DatabaseUnavailable, match="cannot reach the database"):
        derived_name(nowhere)


@pytest.fixture
def restricted_role(admin_url: str, other_database: str) -> Iterator[str]:
    """A URL on ``other_database`` as a role that may not call pg_control_system() there."""
    role = f"outbox_test_{uuid.uuid4().hex[:8]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    owner = create_engine(other_database, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE ROLE "{role}" LOGIN'))
        with owner.connect() as conn:
            # pg_proc is per database: this revokes it in the test's own database only.
            conn.execute(text("REVOKE EXECUTE ON FUNCTION pg_control_system() FROM PUBLIC"))
        yield (
            make_url(other_database)
            .set(username=role, password=None)
            .render_as_string(hide_password=False)
        )
    finally:
        owner.dispose()
        with admin.connect() as conn:
            conn.execute(
                text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = :role"
                ),
                {"role": role},
            )
            conn.execute(text(f'DROP ROLE IF EXISTS "{role}"'))
        admin.dispose()


def test_a_role_that_cannot_read_the_identity_is_told_to_set_outbox_deployment(
    restricted_role: str,
) -> None:
    """Without pg_control_system() the name is not guessed: one error naming OUTBOX_DEPLOYMENT."""
    with pytest.raises(ConfigError, match="set OUTBOX_DEPLOYMENT") as raised:
        derived_name(restricted_role)
    assert "permission denied" in str(raised.value)
