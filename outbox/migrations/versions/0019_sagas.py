"""Sagas: several operations that succeed together or are undone together.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-02

``outbox.sagas`` holds each saga's state (moved only by ``outbox.sagas``) and when the periodic
pass looks at it again; ``outbox.saga_steps`` its steps in order, each one operation with its
declared compensation and, once undone, the compensation's operation; ``outbox.saga_events``
its audit trail. The webhook event check gains ``saga_compensated`` and ``saga_needs_human``.
New, empty tables: no lock on existing ones but the constraint swap on
``webhook_deliveries`` (its new CHECK is a superset of the old: every row passes it).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_EVENTS = (
    "event IN ('approval_expired', 'approval_requested', 'budget_exhausted',"
    " 'circuit_closed', 'circuit_opened', 'confirmed', 'failed', 'needs_human', 'resolved')"
)
_NEW_EVENTS = (
    "event IN ('approval_expired', 'approval_requested', 'budget_exhausted',"
    " 'circuit_closed', 'circuit_opened', 'confirmed', 'failed', 'needs_human', 'resolved',"
    " 'saga_compensated', 'saga_needs_human')"
)


def _ts(name: str, *, now: bool = False) -> sa.Column[object]:
    return sa.Column(
        name,
        postgresql.TIMESTAMP(timezone=True),
        nullable=not now,
        server_default=sa.text("clock_timestamp()") if now else None,
    )


def upgrade() -> None:
    op.create_table(
        "sagas",
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False, server_default="running"),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("requested_by", sa.Text(), nullable=True),
        sa.Column("cancelled_by", sa.Text(), nullable=True),
        _ts("created_at", now=True),
        _ts("updated_at", now=True),
        _ts("next_check_at", now=True),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_sagas")),
        sa.CheckConstraint(
            "state IN ('cancelled', 'compensated', 'compensating', 'completed', 'needs_human',"
            " 'running')",
            name=op.f("ck_sagas_state_known"),
        ),
        sa.CheckConstraint("char_length(key) BETWEEN 1 AND 160", name=op.f("ck_sagas_key_length")),
        schema="outbox",
    )
    op.create_index(
        "ix_sagas_live_next_check_at",
        "sagas",
        ["next_check_at"],
        schema="outbox",
        postgresql_where=sa.text("state IN ('compensating', 'needs_human', 'running')"),
    )
    op.create_table(
        "saga_steps",
        sa.Column("saga_key", sa.Text(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("grp", sa.Text(), nullable=True),
        sa.Column("pivot", sa.Boolean(), nullable=False, server_default=sa.text("false")),
        sa.Column("operation_id", sa.UUID(), nullable=True),
        sa.Column("compensate_tool", sa.Text(), nullable=True),
        sa.Column("compensate_target", sa.Text(), nullable=True),
        sa.Column("compensate_payload", postgresql.JSONB(), nullable=True),
        sa.Column("compensation_operation_id", sa.UUID(), nullable=True),
        sa.Column("approval_ttl_s", sa.Double(), nullable=True),
        _ts("released_at"),
        _ts("created_at", now=True),
        sa.PrimaryKeyConstraint("saga_key", "position", name=op.f("pk_saga_steps")),
        sa.UniqueConstraint("saga_key", "name", name=op.f("uq_saga_steps_saga_key_name")),
        sa.ForeignKeyConstraint(
            ["saga_key"],
            ["outbox.sagas.key"],
            name=op.f("fk_saga_steps_saga_key_sagas"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["operation_id"],
            ["outbox.operations.id"],
            name=op.f("fk_saga_steps_operation_id_operations"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["compensation_operation_id"],
            ["outbox.operations.id"],
            name=op.f("fk_saga_steps_compensation_operation_id_operations"),
            ondelete="SET NULL",
        ),
        sa.CheckConstraint("position >= 0", name=op.f("ck_saga_steps_position_not_negative")),
        sa.CheckConstraint(
            "(compensate_tool IS NULL) = (compensate_target IS NULL)"
            " AND (compensate_tool IS NULL) = (compensate_payload IS NULL)",
            name=op.f("ck_saga_steps_compensation_whole"),
        ),
        sa.CheckConstraint(
            "NOT (pivot AND compensate_tool IS NOT NULL)",
            name=op.f("ck_saga_steps_pivot_not_compensated"),
        ),
        schema="outbox",
    )
    op.create_index("ix_saga_steps_operation_id", "saga_steps", ["operation_id"], schema="outbox")
    op.create_index(
        "ix_saga_steps_compensation_operation_id",
        "saga_steps",
        ["compensation_operation_id"],
        schema="outbox",
    )
    op.create_table(
        "saga_events",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("saga_key", sa.Text(), nullable=False),
        _ts("at", now=True),
        sa.Column("from_state", sa.Text(), nullable=True),
        sa.Column("to_state", sa.Text(), nullable=False),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("detail", postgresql.JSONB(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_saga_events")),
        sa.ForeignKeyConstraint(
            ["saga_key"],
            ["outbox.sagas.key"],
            name=op.f("fk_saga_events_saga_key_sagas"),
            ondelete="CASCADE",
        ),
        schema="outbox",
    )
    op.create_index(
        "ix_saga_events_saga_key_id", "saga_events", ["saga_key", "id"], schema="outbox"
    )
    op.drop_constraint(
        op.f("ck_webhook_deliveries_event_known"), "webhook_deliveries", "check", schema="outbox"
    )
    op.create_check_constraint(
        op.f("ck_webhook_deliveries_event_known"),
        "webhook_deliveries",
        _NEW_EVENTS,
        schema="outbox",
    )


def downgrade() -> None:
    op.execute(
        "DELETE FROM outbox.webhook_deliveries"
        " WHERE event IN ('saga_compensated', 'saga_needs_human')"
    )
    op.drop_constraint(
        op.f("ck_webhook_deliveries_event_known"), "webhook_deliveries", "check", schema="outbox"
    )
    op.create_check_constraint(
        op.f("ck_webhook_deliveries_event_known"),
        "webhook_deliveries",
        _OLD_EVENTS,
        schema="outbox",
    )
    op.drop_table("saga_events", schema="outbox")
    op.drop_table("saga_steps", schema="outbox")
    op.drop_table("sagas", schema="outbox")
