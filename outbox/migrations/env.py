"""Alembic environment for the ``outbox`` schema.

The version table lives in the ``outbox`` schema, so the outbox's migrations never meet an
application's own Alembic history in the same database. Online upgrades hold a
transaction-scoped advisory lock: concurrent starters serialise, and the second finds the
schema at head and does nothing.
"""

from __future__ import annotations

from typing import Any

from alembic import context
from sqlalchemy import Connection, text

from outbox.locks import MIGRATION_LOCK_KEY
from outbox.schema import SCHEMA, metadata

VERSION_TABLE = "alembic_version"


def _include_name(name: str | None, type_: str, parent_names: object) -> bool:
    # Compare only our own schema: the database may hold the application's tables too.
    if type_ == "schema":
        return name == SCHEMA
    return True


def _configure(**options: Any) -> None:
    context.configure(
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        version_table_schema=SCHEMA,
        include_schemas=True,
        include_name=_include_name,
        compare_type=True,
        **options,
    )


def run_offline() -> None:
    """Print the DDL (``outbox db sql``) without connecting."""
    _configure(url="postgresql+psycopg://", literal_binds=True)
    with context.begin_transaction():
        context.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
        context.run_migrations()


def run_online(connection: Connection) -> None:
    """Upgrade over ``connection`` under the migration lock, in one transaction."""
    _configure(connection=connection)
    with context.begin_transaction():
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
        connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online(context.config.attributes["connection"])
