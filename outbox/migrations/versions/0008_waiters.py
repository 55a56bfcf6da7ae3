"""Waiters, so a settled move sends its NOTIFY only when someone waits for that operation.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "waiters",
        sa.Column("operation_id", sa.UUID(), nullable=False),
        sa.Column("backend_pid", sa.Integer(), nullable=False),
        sa.Column(
            "since",
            postgresql.TIMESTAMP(timezone=True),
            server_default=sa.text("clock_timestamp()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("operation_id", "backend_pid", name=op.f("pk_waiters")),
        schema="outbox",
    )


def downgrade() -> None:
    op.drop_table("waiters", schema="outbox")
