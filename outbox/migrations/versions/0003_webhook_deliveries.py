"""Escalation webhook deliveries, written in the same transaction as the move they report.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _ts(name: str, *, nullable: bool = True, now: bool = False) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(
        name,
        postgresql.TIMESTAMP(timezone=True),
        nullable=nullable,
        server_default=sa.text("clock_timestamp()") if now else None,
    )


def upgrade() -> None:
    op.create_table(
        "webhook_deliveries",
        sa.Column(
            "id",
            postgresql.UUID(as_uuid=True),
            server_default=sa.text("outbox.uuid_v7()"),
            nullable=False,
        ),
        sa.Column("operation_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("event", sa.Text(), nullable=False),
        sa.Column("payload", postgresql.JSONB(), nullable=False),
        sa.Column("status", sa.Text(), server_default="pending", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        _ts("next_attempt_at", nullable=False, now=True),
        sa.Column("last_status", sa.Integer()),
        sa.Column("last_error", sa.Text()),
        _ts("created_at", nullable=False, now=True),
        _ts("delivered_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_deliveries")),
        sa.ForeignKeyConstraint(
            ["operation_id"],
            ["outbox.operations.id"],
            ondelete="CASCADE",
            name=op.f("fk_webhook_deliveries_operation_id_operations"),
        ),
        sa.CheckConstraint(
            "event IN ('confirmed', 'failed', 'needs_human', 'resolved')",
            name=op.f("ck_webhook_deliveries_event_known"),
        ),
        sa.CheckConstraint(
            "status IN ('abandoned', 'delivered', 'pending')",
            name=op.f("ck_webhook_deliveries_status_known"),
        ),
        sa.CheckConstraint(
            "attempts >= 0", name=op.f("ck_webhook_deliveries_attempts_not_negative")
        ),
        sa.CheckConstraint(
            "(status = 'delivered') = (delivered_at IS NOT NULL)",
            name=op.f("ck_webhook_deliveries_delivered_iff_delivered_at"),
        ),
        schema="outbox",
    )
    op.create_index(
        op.f("ix_webhook_deliveries_pending_due"),
        "webhook_deliveries",
        ["next_attempt_at"],
        schema="outbox",
        postgresql_where=sa.text("status = 'pending'"),
    )
    op.create_index(
        op.f("ix_webhook_deliveries_operation_id"),
        "webhook_deliveries",
        ["operation_id"],
        schema="outbox",
    )


def downgrade() -> None:
    op.drop_table("webhook_deliveries", schema="outbox")
