"""What identifies a pruned intent, so a re-enqueue of its key cannot make it happen twice.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01

``outbox.pruned_intents`` holds one small row per deleted operation (its intent key, id,
tool, target, payload hash, final state, remote_ref and times; never its payload), written
by the trigger ``operations_remember_intent`` in the statement that deletes the operation:
whoever deletes a finished operation (``outbox db prune`` or a person in psql), its intent
is remembered in the same transaction. ``enqueue`` inserts nothing for a key found here
(``IntentAlreadyDone``, or ``IntentConflict`` if the tool, target or payload differ).
``outbox db prune --forget-intents-older-than`` is their own retention.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# AFTER DELETE: only a deletion that passed operations_delete_guard (a finished operation)
# gets here. A key already remembered keeps its first row.
REMEMBER = """
CREATE FUNCTION outbox.remember_pruned_intent() RETURNS trigger
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
CREATE TRIGGER operations_remember_intent AFTER DELETE ON outbox.operations
  FOR EACH ROW EXECUTE FUNCTION outbox.remember_pruned_intent();
"""


def _ts(name: str, *, nullable: bool = True, now: bool = False) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(
        name,
        postgresql.TIMESTAMP(timezone=True),
        nullable=nullable,
        server_default=sa.text("clock_timestamp()") if now else None,
    )


def upgrade() -> None:
    op.create_table(
        "pruned_intents",
        sa.Column("intent_key", sa.Text(), nullable=False),
        sa.Column("operation_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("tool", sa.Text(), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("payload_hash", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("remote_ref", sa.Text()),
        sa.Column("attempts", sa.Integer(), nullable=False),
        _ts("created_at", nullable=False),
        _ts("first_sent_at"),
        _ts("resolved_at", nullable=False),
        _ts("pruned_at", nullable=False, now=True),
        sa.PrimaryKeyConstraint("intent_key", name=op.f("pk_pruned_intents")),
        schema="outbox",
    )
    op.create_index(
        op.f("ix_pruned_intents_resolved_at"),
        "pruned_intents",
        ["resolved_at"],
        schema="outbox",
    )
    op.execute(REMEMBER)


def downgrade() -> None:
    op.execute("DROP TRIGGER operations_remember_intent ON outbox.operations")
    op.execute("DROP FUNCTION outbox.remember_pruned_intent()")
    op.drop_table("pruned_intents", schema="outbox")
