"""Operations and their append-only event log.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATES = "'cancelled', 'confirmed', 'failed', 'needs_human', 'planned', 'sent', 'unknown'"
TERMINAL = "'cancelled', 'confirmed', 'failed'"

# UUIDv7 from the database clock, so ids sort by creation time (PostgreSQL < 18 has no uuidv7()).
UUID_V7 = """
CREATE FUNCTION outbox.uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
  SELECT encode(
    set_bit(set_bit(
      overlay(uuid_send(gen_random_uuid())
              PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint)
                                FROM 3)
              FROM 1 FOR 6),
      52, 1), 53, 1),
    'hex')::uuid
$$
"""

APPEND_ONLY = """
CREATE FUNCTION outbox.events_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  RAISE EXCEPTION 'outbox.events is append-only: the audit trail is never rewritten';
END
$$;
CREATE TRIGGER events_append_only BEFORE UPDATE ON outbox.events
  FOR EACH ROW EXECUTE FUNCTION outbox.events_append_only();
"""


def _ts(name: str, *, nullable: bool = True, now: bool = False) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(
        name,
        postgresql.TIMESTAMP(timezone=True),
        nullable=nullable,
        server_default=sa.text("clock_timestamp()") if now else None,
    )


def upgrade() -> None:
    op.execute(UUID_V7)
    op.create_table(
        "operations",
        sa.Column(
            "id",
            postgresql.UUID(as_uuid=True),
            server_default=sa.text("outbox.uuid_v7()"),
            nullable=False,
        ),
        sa.Column("intent_key", sa.Text(), nullable=False),
        sa.Column("tool", sa.Text(), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("payload", postgresql.JSONB(), nullable=False),
        sa.Column("payload_hash", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), server_default="planned", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("checks", sa.Integer(), server_default="0", nullable=False),
        sa.Column("maybe_applied", sa.Boolean(), server_default=sa.text("false"), nullable=False),
        sa.Column("remote_ref", sa.Text()),
        sa.Column("result", postgresql.JSONB()),
        sa.Column("last_error", sa.Text()),
        sa.Column(
            "metadata", postgresql.JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False
        ),
        sa.Column("requested_by", sa.Text()),
        _ts("created_at", nullable=False, now=True),
        _ts("updated_at", nullable=False, now=True),
        _ts("available_at", nullable=False, now=True),
        _ts("published_at"),
        _ts("first_sent_at"),
        _ts("sent_at"),
        _ts("next_check_at"),
        _ts("replay_deadline"),
        _ts("resolved_at"),
        sa.PrimaryKeyConstraint("id", name="pk_operations"),
        sa.UniqueConstraint("intent_key", name="uq_operations_intent_key"),
        sa.CheckConstraint(f"state IN ({STATES})", name=op.f("ck_operations_state_known")),
        sa.CheckConstraint(
            "char_length(intent_key) BETWEEN 1 AND 255",
            name=op.f("ck_operations_intent_key_length"),
        ),
        sa.CheckConstraint(
            "char_length(tool) BETWEEN 1 AND 128", name=op.f("ck_operations_tool_length")
        ),
        sa.CheckConstraint("target <> ''", name=op.f("ck_operations_target_not_empty")),
        sa.CheckConstraint(
            "payload_hash ~ '^[0-9a-f]{64}$'", name=op.f("ck_operations_payload_hash_sha256")
        ),
        sa.CheckConstraint(
            "attempts >= 0 AND checks >= 0", name=op.f("ck_operations_counters_not_negative")
        ),
        sa.CheckConstraint(
            "state <> 'confirmed' OR coalesce(remote_ref, '') <> ''",
            name=op.f("ck_operations_confirmed_has_remote_ref"),
        ),
        sa.CheckConstraint(
            f"(state IN ({TERMINAL})) = (resolved_at IS NOT NULL)",
            name=op.f("ck_operations_terminal_iff_resolved"),
        ),
        sa.CheckConstraint(
            "state <> 'sent' OR (attempts > 0 AND sent_at IS NOT NULL)",
            name=op.f("ck_operations_sent_has_attempt"),
        ),
        sa.CheckConstraint(
            "(attempts = 0) = (first_sent_at IS NULL) AND (first_sent_at IS NULL) = (sent_at IS NULL)"
            " AND (first_sent_at IS NULL OR first_sent_at <= sent_at)",
            name=op.f("ck_operations_sent_times_consistent"),
        ),
        sa.CheckConstraint(
            "state <> 'cancelled' OR NOT maybe_applied",
            name=op.f("ck_operations_cancelled_never_applied"),
        ),
        schema="outbox",
    )
    op.create_index(
        "ix_operations_planned_due",
        "operations",
        ["available_at"],
        schema="outbox",
        postgresql_where=sa.text("state = 'planned'"),
    )
    op.create_index(
        "ix_operations_sent_since",
        "operations",
        ["sent_at"],
        schema="outbox",
        postgresql_where=sa.text("state = 'sent'"),
    )
    op.create_index(
        "ix_operations_unknown_next_check",
        "operations",
        ["next_check_at"],
        schema="outbox",
        postgresql_where=sa.text("state = 'unknown'"),
    )
    op.create_index(
        "ix_operations_needs_human_since",
        "operations",
        ["updated_at"],
        schema="outbox",
        postgresql_where=sa.text("state = 'needs_human'"),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("operation_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("from_state", sa.Text()),
        sa.Column("to_state", sa.Text(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("detail", postgresql.JSONB()),
        _ts("at", nullable=False, now=True),
        sa.PrimaryKeyConstraint("id", name="pk_events"),
        sa.ForeignKeyConstraint(
            ["operation_id"],
            ["outbox.operations.id"],
            ondelete="CASCADE",
            name="fk_events_operation_id_operations",
        ),
        schema="outbox",
    )
    op.create_index("ix_events_operation_id_id", "events", ["operation_id", "id"], schema="outbox")
    op.execute(APPEND_ONLY)


def downgrade() -> None:
    op.drop_table("events", schema="outbox")
    op.drop_table("operations", schema="outbox")
    op.execute("DROP FUNCTION outbox.events_append_only()")
    op.execute("DROP FUNCTION outbox.uuid_v7()")
