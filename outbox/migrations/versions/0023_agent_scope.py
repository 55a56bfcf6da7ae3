"""An intent key is scoped to its agent: the same key from two agents names two operations.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-03

* ``operations.agent`` (text, ``''`` = the deployment's shared scope) is part of the intent's
  identity: the unique rule is now ``(intent_key, agent)`` (``uq_operations_intent_key_agent``,
  key first, so an operator's search by key alone still reads the index), and the immutable
  columns' trigger (0010) guards it like the key. Existing rows get the scope each door now
  computes for the caller that made them, so no existing operation changes identity: every
  door recorded its caller as ``requested_by`` (an API token's name, ``outbox mcp``'s agent
  name, the Python caller's own), and an intent's agent is ``requested_by`` unless named
  (``outbox.enqueue(agent=...)``). One UPDATE of the rows that have a ``requested_by``.
* ``pruned_intents`` remembers the agent too (primary key ``(intent_key, agent)``). A row
  pruned before this revision did not record its agent: it is kept with ``all_agents``, and
  its key is done for every agent, so no intent can happen twice across the upgrade (it is
  the only answer that may still speak of another agent's operation; ``outbox db prune
  --forget-intents-older-than`` removes such rows with the others).
* Sagas too: a saga key is its agent's (``sagas`` keyed by ``(key, agent)``, its steps and
  events carrying the agent under composite foreign keys); existing sagas get their
  ``requested_by`` as agent, as their steps' operations do. A step keeps its operation's
  intent key (``saga_steps.intent_key``): new sagas build theirs unambiguously
  (``saga:<length>:<key>:step:<name>``; ``saga:rel:a`` + ``b`` and ``saga:rel`` + ``a:b``
  were one key), existing ones keep the form they were recorded with.
* ``api_tokens.agent``: the agent a token speaks for, its intent keys' scope. Existing tokens
  speak for the agent of their own name; ``outbox tokens create NEW --agent NAME`` makes
  another token of the same agent (rotation keeps the scope).

Expand and contract in one: the previous release's ``ON CONFLICT (intent_key)`` has no
unique index to infer once this runs, so stop the agents' enqueues (and the API) while it
does. Downgrading fails if two agents have used one key since.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023"
down_revision: str | None = "0022"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: 0010's immutable columns, and the agent: part of the intent's identity now.
IMMUTABLE_COLUMNS = (
    "id",
    "intent_key",
    "tool",
    "target",
    "payload",
    "payload_hash",
    "intent_hash",
    "requested_by",
    "metadata",
    "agent",
)


def _immutable(columns: Sequence[str]) -> str:
    changed = "\n".join(
        f"  IF OLD.{name}{'::text' if name == 'payload' else ''} IS DISTINCT FROM "
        f"NEW.{name}{'::text' if name == 'payload' else ''} THEN changed := '{name}'; END IF;"
        for name in reversed(columns)
    )
    return f"""
CREATE OR REPLACE FUNCTION outbox.operations_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
  changed text;
BEGIN
{changed}
  IF changed IS NOT NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'integrity_constraint_violation',
      SCHEMA = 'outbox', TABLE = 'operations', COLUMN = changed,
      MESSAGE = 'outbox.operations.' || changed || ' is immutable: an operation''s identity '
        || 'never changes after enqueue (operation ' || OLD.id || ')';
  END IF;
  RETURN NULL;
END
$$;
CREATE TRIGGER operations_immutable
  AFTER UPDATE OF {", ".join(columns)} ON outbox.operations
  FOR EACH ROW EXECUTE FUNCTION outbox.operations_immutable();
"""


IMMUTABLE = _immutable(IMMUTABLE_COLUMNS)

# As 0011's, with the agent: a key already remembered for this agent keeps its first row.
REMEMBER = """
CREATE OR REPLACE FUNCTION outbox.remember_pruned_intent() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO outbox.pruned_intents (intent_key, agent, operation_id, tool, target,
                                     payload_hash, state, remote_ref, attempts, created_at,
                                     first_sent_at, resolved_at)
  VALUES (OLD.intent_key, OLD.agent, OLD.id, OLD.tool, OLD.target, OLD.payload_hash,
          OLD.state, OLD.remote_ref, OLD.attempts, OLD.created_at, OLD.first_sent_at,
          OLD.resolved_at)
  ON CONFLICT (intent_key, agent) DO NOTHING;
  RETURN NULL;
END
$$;
"""

REMEMBER_UNSCOPED = """
CREATE OR REPLACE FUNCTION outbox.remember_pruned_intent() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO outbox.pruned_intents (intent_key, operation_id, tool, target, payload_hash,
                                     state, remote_ref, attempts, created_at, first_sent_at,
                                     resolved_at)
  VALUES (OLD.intent_key, OLD.id, OLD.tool, OLD.target, OLD.payload_hash, OLD.state,
          OLD.remote_ref, OLD.attempts, OLD.created_at, OLD.first_sent_at, OLD.resolved_at)
  ON CONFLICT (intent_key) DO NOTHING;
  RETURN NULL;
END
$$;
"""

_SCHEMA = "outbox"


def upgrade() -> None:
    op.add_column(
        "operations",
        sa.Column("agent", sa.Text(), nullable=False, server_default=sa.text("''")),
        schema=_SCHEMA,
    )
    op.execute(
        "UPDATE outbox.operations SET agent = requested_by "
        "WHERE requested_by IS NOT NULL AND requested_by <> ''"
    )
    op.create_unique_constraint(
        op.f("uq_operations_intent_key_agent"),
        "operations",
        ["intent_key", "agent"],
        schema=_SCHEMA,
    )
    op.drop_constraint("uq_operations_intent_key", "operations", schema=_SCHEMA)
    op.execute("DROP TRIGGER operations_immutable ON outbox.operations")
    op.execute(IMMUTABLE)

    # Existing rows: all_agents (their agent was not recorded); new rows: their own agent.
    op.add_column(
        "pruned_intents",
        sa.Column("agent", sa.Text(), nullable=False, server_default=sa.text("''")),
        schema=_SCHEMA,
    )
    op.add_column(
        "pruned_intents",
        sa.Column("all_agents", sa.Boolean(), nullable=False, server_default=sa.text("true")),
        schema=_SCHEMA,
    )
    op.alter_column("pruned_intents", "all_agents", server_default=sa.text("false"), schema=_SCHEMA)
    op.drop_constraint("pk_pruned_intents", "pruned_intents", schema=_SCHEMA)
    op.create_primary_key(
        op.f("pk_pruned_intents"), "pruned_intents", ["intent_key", "agent"], schema=_SCHEMA
    )
    op.execute(REMEMBER)

    _scope_sagas()

    op.add_column("api_tokens", sa.Column("agent", sa.Text()), schema=_SCHEMA)
    op.execute("UPDATE outbox.api_tokens SET agent = name")
    op.alter_column("api_tokens", "agent", nullable=False, schema=_SCHEMA)
    op.create_check_constraint(
        op.f("ck_api_tokens_agent_length"),
        "api_tokens",
        "char_length(agent) BETWEEN 1 AND 128",
        schema=_SCHEMA,
    )


def _scope_sagas() -> None:
    for table in ("sagas", "saga_steps", "saga_events"):
        op.add_column(
            table,
            sa.Column("agent", sa.Text(), nullable=False, server_default=sa.text("''")),
            schema=_SCHEMA,
        )
    op.execute(
        "UPDATE outbox.sagas SET agent = requested_by "
        "WHERE requested_by IS NOT NULL AND requested_by <> ''"
    )
    op.execute(
        "UPDATE outbox.saga_steps AS t SET agent = s.agent FROM outbox.sagas AS s "
        "WHERE s.key = t.saga_key AND s.agent <> ''"
    )
    op.execute(
        "UPDATE outbox.saga_events AS t SET agent = s.agent FROM outbox.sagas AS s "
        "WHERE s.key = t.saga_key AND s.agent <> ''"
    )
    # A step's intent key, kept: a saga declared before this revision goes on finding its
    # steps' operations under the keys they were recorded with; new sagas' keys are built
    # by the unambiguous form (outbox.sagas.step_intent_key).
    op.add_column("saga_steps", sa.Column("intent_key", sa.Text()), schema=_SCHEMA)
    op.execute("UPDATE outbox.saga_steps SET intent_key = 'saga:' || saga_key || ':' || name")
    op.alter_column("saga_steps", "intent_key", nullable=False, schema=_SCHEMA)
    _rekey_sagas(
        ["saga_key", "agent"],
        ["key", "agent"],
        steps_pk=["saga_key", "agent", "position"],
        old_unique="uq_saga_steps_saga_key_name",
        old_index="ix_saga_events_saga_key_id",
    )


def _rekey_sagas(
    child: list[str], parent: list[str], *, steps_pk: list[str], old_unique: str, old_index: str
) -> None:
    """Key the sagas by ``parent``, and their steps' and events' references by ``child``."""
    for table in ("saga_steps", "saga_events"):
        op.drop_constraint(f"fk_{table}_saga_key_sagas", table, schema=_SCHEMA)
    op.drop_constraint("pk_saga_steps", "saga_steps", schema=_SCHEMA)
    op.drop_constraint(old_unique, "saga_steps", schema=_SCHEMA)
    op.drop_index(old_index, table_name="saga_events", schema=_SCHEMA)
    op.drop_constraint("pk_sagas", "sagas", schema=_SCHEMA)
    op.create_primary_key(op.f("pk_sagas"), "sagas", parent, schema=_SCHEMA)
    op.create_primary_key(op.f("pk_saga_steps"), "saga_steps", steps_pk, schema=_SCHEMA)
    unique = [*child, "name"]
    op.create_unique_constraint(
        op.f(f"uq_saga_steps_{'_'.join(unique)}"), "saga_steps", unique, schema=_SCHEMA
    )
    for table in ("saga_steps", "saga_events"):
        op.create_foreign_key(
            op.f(f"fk_{table}_saga_key_sagas"),
            table,
            "sagas",
            child,
            parent,
            source_schema=_SCHEMA,
            referent_schema=_SCHEMA,
            ondelete="CASCADE",
        )
    indexed = [*child, "id"]
    op.create_index(
        op.f(f"ix_saga_events_{'_'.join(indexed)}"), "saga_events", indexed, schema=_SCHEMA
    )


def downgrade() -> None:
    op.drop_constraint("ck_api_tokens_agent_length", "api_tokens", schema=_SCHEMA)
    op.drop_column("api_tokens", "agent", schema=_SCHEMA)

    _rekey_sagas(
        ["saga_key"],
        ["key"],
        steps_pk=["saga_key", "position"],
        old_unique="uq_saga_steps_saga_key_agent_name",
        old_index="ix_saga_events_saga_key_agent_id",
    )
    op.drop_column("saga_steps", "intent_key", schema=_SCHEMA)
    for table in ("saga_events", "saga_steps", "sagas"):
        op.drop_column(table, "agent", schema=_SCHEMA)

    op.execute(REMEMBER_UNSCOPED)
    op.drop_constraint("pk_pruned_intents", "pruned_intents", schema=_SCHEMA)
    op.create_primary_key("pk_pruned_intents", "pruned_intents", ["intent_key"], schema=_SCHEMA)
    op.drop_column("pruned_intents", "all_agents", schema=_SCHEMA)
    op.drop_column("pruned_intents", "agent", schema=_SCHEMA)

    op.execute("DROP TRIGGER operations_immutable ON outbox.operations")
    op.execute(_immutable(IMMUTABLE_COLUMNS[:-1]))
    op.create_unique_constraint(
        "uq_operations_intent_key", "operations", ["intent_key"], schema=_SCHEMA
    )
    op.drop_constraint("uq_operations_intent_key_agent", "operations", schema=_SCHEMA)
    op.drop_column("operations", "agent", schema=_SCHEMA)
