"""Retention: terminal operations by the time they were resolved, for `outbox db prune`.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Expand only: an index, which older code simply does not use. Partial, so live rows cost
    # it nothing and a prune reads only the rows it deletes. IF NOT EXISTS lets a DBA build it
    # first with CREATE INDEX CONCURRENTLY (same name and definition) on a large table.
    # Events and webhook deliveries need nothing here: both reference operations with
    # ON DELETE CASCADE (0001, 0003), so they go with their operation.
    op.create_index(
        "ix_operations_resolved_at",
        "operations",
        ["resolved_at"],
        schema="outbox",
        postgresql_where=sa.text("resolved_at IS NOT NULL"),
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_index("ix_operations_resolved_at", table_name="operations", schema="outbox")
