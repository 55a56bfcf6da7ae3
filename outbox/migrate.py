"""Schema migrations: upgrade (serialised by an advisory lock), print the DDL, check the head."""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine

from outbox.schema import SCHEMA

SCRIPT_LOCATION = "outbox:migrations"
VERSION_TABLE = "alembic_version"

# Alembic's `context` and `op` are process-wide proxies, so two commands running in threads
# of one process would drive each other's migration. The advisory lock in env.py serialises
# processes; this serialises the threads of one process.
_ALEMBIC_COMMAND = threading.Lock()


def alembic_config(output: io.StringIO | None = None) -> Config:
    """An Alembic configuration for the packaged migrations (no ``alembic.ini`` needed)."""
    config = Config(output_buffer=output) if output is not None else Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    return config


def head() -> str:
    """The newest revision shipped with this version of the package."""
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"the packaged migrations have {len(heads)} heads: {heads}")
    return heads[0]


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the ``outbox`` schema to ``revision``; concurrent callers serialise and all succeed."""
    config = alembic_config()
    with _ALEMBIC_COMMAND, engine.connect() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def sql(revision: str = "head") -> str:
    """The DDL that upgrades an empty database to ``revision``, without connecting."""
    output = io.StringIO()
    with _ALEMBIC_COMMAND:
        command.upgrade(alembic_config(output), revision, sql=True)
    return output.getvalue()


def current(engine: Engine) -> str | None:
    """The revision the database's ``outbox`` schema is at, or ``None`` if never migrated."""
    with engine.connect() as connection:
        return current_on(connection)


def current_on(connection: Connection) -> str | None:
    """:func:`current`, read on ``connection`` (in its transaction, if one is open)."""
    context = MigrationContext.configure(
        connection, opts={"version_table": VERSION_TABLE, "version_table_schema": SCHEMA}
    )
    heads = context.get_current_heads()
    return heads[0] if heads else None


@dataclass(frozen=True)
class SchemaStatus:
    """Where the database is against the packaged migrations."""

    current: str | None
    head: str

    @property
    def up_to_date(self) -> bool:
        """Whether the database is at the newest packaged revision."""
        return self.current == self.head


def status(engine: Engine) -> SchemaStatus:
    """Compare the database's revision with the packaged head."""
    return SchemaStatus(current=current(engine), head=head())
