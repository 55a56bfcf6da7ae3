"""Migrations: from empty they build exactly the models, idempotently, and serialise when racing."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api, migrate
from outbox.db import create_engine
from outbox.locks import MIGRATION_LOCK_KEY
from outbox.schema import SCHEMA, metadata
from tests.conftest import Databases

# The catalog as PostgreSQL reports it: what autogenerate does not compare (CHECK
# constraints, index predicates, defaults, triggers, functions) is compared through these.
CATALOG_QUERIES = {
    "columns": """
        SELECT table_name, column_name, data_type, is_nullable, column_default,
               is_identity, identity_generation
        FROM information_schema.columns WHERE table_schema = 'outbox'
          AND table_name <> 'alembic_version'
    """,
    "constraints": """
        SELECT cls.relname, con.conname, pg_get_constraintdef(con.oid)
        FROM pg_constraint con JOIN pg_class cls ON cls.oid = con.conrelid
        WHERE con.connamespace = 'outbox'::regnamespace AND cls.relname <> 'alembic_version'
    """,
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = 'outbox' AND tablename <> 'alembic_version'
    """,
    "triggers": """
        SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid) FROM pg_trigger
        WHERE NOT tgisinternal AND tgrelid::regclass::text LIKE 'outbox.%'
    """,
    "functions": """
        SELECT proname, pg_get_functiondef(oid) FROM pg_proc
        WHERE pronamespace = 'outbox'::regnamespace
    """,
}
# Object identities, to tell "nothing happened" from "dropped and created again".
IDENTITY_QUERY = """
    SELECT relname, oid::bigint, xmin::text FROM pg_class
    WHERE relnamespace = 'outbox'::regnamespace
"""


def catalog(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """The outbox schema's definition, as sorted rows per kind of object."""
    with engine.connect() as conn:
        return {
            kind: sorted(tuple(row) for row in conn.execute(text(query)))
            for kind, query in CATALOG_QUERIES.items()
        }


def identities(engine: Engine) -> list[tuple[Any, ...]]:
    """Every relation of the outbox schema with its oid and row version in pg_class."""
    with engine.connect() as conn:
        return sorted(tuple(row) for row in conn.execute(text(IDENTITY_QUERY)))


def include_outbox_only(name: str | None, type_: str, parent_names: object) -> bool:
    """Compare only the outbox schema (the test server may hold other schemas)."""
    return name == SCHEMA if type_ == "schema" else True


@pytest.fixture
def fresh_engine(databases: Databases) -> Iterator[Engine]:
    """An engine on a new, empty database."""
    engine = create_engine(databases.create())
    yield engine
    engine.dispose()


@pytest.fixture
def upgraded_engine(fresh_engine: Engine) -> Engine:
    """An engine on a new database upgraded from empty to head."""
    migrate.upgrade(fresh_engine)
    return fresh_engine


def test_upgrade_from_empty_matches_the_models(upgraded_engine: Engine) -> None:
    """After upgrading an empty database, autogenerate finds no difference with the models."""
    with upgraded_engine.connect() as conn:
        context = MigrationContext.configure(
            conn,
            opts={
                "target_metadata": metadata,
                "include_schemas": True,
                "include_name": include_outbox_only,
                "version_table_schema": SCHEMA,
                "compare_type": True,
            },
        )
        assert compare_metadata(context, metadata) == []


def test_upgrade_from_empty_matches_create_all(
    databases: Databases, upgraded_engine: Engine
) -> None:
    """The migrated catalog equals the models' own DDL, CHECK constraints and indexes included."""
    initial = importlib.import_module("outbox.migrations.versions.0001_initial")
    lock_and_read = importlib.import_module("outbox.migrations.versions.0007_lock_and_read")
    # The operation row's invariants as revision 0012 left them (0009's function, replaced).
    invariants = importlib.import_module("outbox.migrations.versions.0012_approval")
    identity = importlib.import_module("outbox.migrations.versions.0010_immutable_identity")
    pruned = importlib.import_module("outbox.migrations.versions.0011_pruned_intents")
    guard_admit = importlib.import_module("outbox.migrations.versions.0020_guard_admit")
    budget_share = importlib.import_module("outbox.migrations.versions.0021_budget_share_returned")
    # 0010's immutable columns and 0011's pruned intents as 0023 left them (with the agent).
    scope = importlib.import_module("outbox.migrations.versions.0023_agent_scope")
    # The immutable columns as 0026 left them (with the trace context).
    trace = importlib.import_module("outbox.migrations.versions.0026_trace_context")
    reference = create_engine(databases.create())
    try:
        with reference.begin() as conn:
            conn.execute(text(f"CREATE SCHEMA {SCHEMA}"))
            conn.execute(text(initial.UUID_V7))
            conn.exec_driver_sql(invariants.OPERATION_INVARIANTS)
            metadata.create_all(conn)
            conn.exec_driver_sql(initial.APPEND_ONLY)
            conn.exec_driver_sql(lock_and_read.OPERATION_IF_LOCKED)
            for ddl in (identity.INTENT_HASH, trace.IMMUTABLE, identity.DELETE_GUARD):
                conn.exec_driver_sql(ddl)
            conn.exec_driver_sql(identity.EVENTS_KEPT)
            conn.exec_driver_sql(pruned.REMEMBER)
            conn.exec_driver_sql(scope.REMEMBER)
            conn.exec_driver_sql(guard_admit.GUARD_ADMIT)
            conn.exec_driver_sql(budget_share.RETURN_SHARE)
        expected = catalog(reference)
    finally:
        reference.dispose()
    actual = catalog(upgraded_engine)
    for kind in CATALOG_QUERIES:
        assert actual[kind] == expected[kind], kind
    names = {row[1] for row in actual["constraints"]}
    assert "ck_operations_invariants" in names


def test_upgrade_twice_is_a_no_op(upgraded_engine: Engine) -> None:
    """A second upgrade changes nothing and leaves the revision at head."""
    before = (catalog(upgraded_engine), identities(upgraded_engine))
    migrate.upgrade(upgraded_engine)
    assert (catalog(upgraded_engine), identities(upgraded_engine)) == before
    assert migrate.current(upgraded_engine) == migrate.head()


def test_upgrade_keeps_existing_rows(upgraded_engine: Engine) -> None:
    """Upgrading a database that already holds operations leaves them in place."""
    with Session(upgraded_engine) as session, session.begin():
        op = api.enqueue(session, tool="t.x", target="a", payload={"k": 1})
    migrate.upgrade(upgraded_engine)
    with upgraded_engine.connect() as conn:
        assert api.get(conn, op.id) == op


def test_status_reports_none_then_head(fresh_engine: Engine) -> None:
    """status shows no revision on an empty database and the head after an upgrade."""
    empty = migrate.status(fresh_engine)
    assert (empty.current, empty.head, empty.up_to_date) == (None, migrate.head(), False)
    migrate.upgrade(fresh_engine)
    done = migrate.status(fresh_engine)
    assert (done.current, done.up_to_date) == (migrate.head(), True)


def test_version_table_lives_in_the_outbox_schema(upgraded_engine: Engine) -> None:
    """The Alembic version table is outbox.alembic_version, never the application's public one."""
    with upgraded_engine.connect() as conn:
        tables = set(
            conn.execute(
                text(
                    "SELECT table_schema || '.' || table_name FROM information_schema.tables "
                    "WHERE table_name = 'alembic_version'"
                )
            ).scalars()
        )
    assert tables == {"outbox.alembic_version"}


def test_downgrade_to_base_and_up_again(upgraded_engine: Engine) -> None:
    """Downgrading to base removes the outbox tables; upgrading again rebuilds the same schema."""
    before = catalog(upgraded_engine)
    config = migrate.alembic_config()
    with upgraded_engine.connect() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, "base")
    assert migrate.current(upgraded_engine) is None
    assert catalog(upgraded_engine)["columns"] == []
    migrate.upgrade(upgraded_engine)
    assert catalog(upgraded_engine) == before


def test_sql_prints_the_ddl_without_connecting(monkeypatch: pytest.MonkeyPatch) -> None:
    """migrate.sql() renders the full DDL offline; any attempt to connect would fail the test."""

    def no_connection(*args: object, **kwargs: object) -> None:
        raise AssertionError("migrate.sql() tried to connect")

    monkeypatch.setattr(psycopg, "connect", no_connection)
    monkeypatch.setattr(psycopg.Connection, "connect", no_connection)
    ddl = migrate.sql()
    assert "CREATE SCHEMA IF NOT EXISTS outbox" in ddl
    assert "CREATE TABLE outbox.operations" in ddl
    assert "CREATE TABLE outbox.events" in ddl
    assert "CREATE TABLE outbox.alembic_version" in ddl
    assert "CONSTRAINT ck_operations_invariants" in ddl
    assert "CREATE FUNCTION outbox.operation_invariants_hold" in ddl
    assert "CREATE TRIGGER events_append_only" in ddl
    assert f"UPDATE outbox.alembic_version SET version_num='{migrate.head()}'" in ddl or (
        f"INSERT INTO outbox.alembic_version (version_num) VALUES ('{migrate.head()}')" in ddl
    )


def test_migrations_have_a_single_head() -> None:
    """The packaged migrations form one linear history with a single head."""
    scripts = ScriptDirectory.from_config(migrate.alembic_config())
    assert scripts.get_heads() == [migrate.head()]
    assert len(scripts.get_bases()) == 1
    revisions = list(scripts.walk_revisions())
    assert all(len(revision.nextrev) <= 1 for revision in revisions)
    assert revisions[0].revision == migrate.head()


@pytest.mark.parametrize("round_", range(3))
def test_concurrent_upgrades_both_succeed(databases: Databases, round_: int) -> None:
    """Two upgrades racing on a fresh database serialise on the lock and both succeed."""
    url = databases.create()
    engines = [create_engine(url), create_engine(url)]
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def upgrade(engine: Engine) -> None:
        try:
            barrier.wait(timeout=10)
            migrate.upgrade(engine)
        except BaseException as exc:  # noqa: BLE001 -- reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=upgrade, args=(engine,)) for engine in engines]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == [], f"round {round_}: {errors}"
        assert migrate.status(engines[0]).up_to_date
        with engines[0].connect() as conn:
            versions = conn.execute(text("SELECT version_num FROM outbox.alembic_version"))
            assert versions.scalars().all() == [migrate.head()]
    finally:
        for engine in engines:
            engine.dispose()


def test_upgrade_waits_for_the_migration_lock(fresh_engine: Engine) -> None:
    """An upgrade blocks while another session holds the migration advisory lock."""
    done = threading.Event()
    errors: list[BaseException] = []

    def upgrade() -> None:
        try:
            migrate.upgrade(fresh_engine)
        except BaseException as exc:  # noqa: BLE001 -- reported by the assertion below
            errors.append(exc)
        finally:
            done.set()

    with fresh_engine.connect() as holder:
        holder.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        thread = threading.Thread(target=upgrade)
        thread.start()
        assert not done.wait(timeout=0.5), "upgrade ran while the migration lock was held"
        assert migrate.current(fresh_engine) is None
        holder.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
        holder.commit()
    thread.join(timeout=30)
    assert errors == []
    assert migrate.status(fresh_engine).up_to_date
