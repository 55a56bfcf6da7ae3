"""The relay's claim in two halves, each from a partial index of its own candidates only.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-02

The claim read `ix_operations_planned_due` (every `planned` row, by available_at) and fetched
each row from the heap to test published_at: a row published and still waiting for a worker
(a backlog in the broker) is not a candidate until republish_after has passed, yet every
claim stepped over all of them. Now the claim is two scans (outbox/sql/relay.py): rows never
published, by available_at, from `ix_operations_planned_unpublished`; then rows published
longer than republish_after ago, oldest publish first, from `ix_operations_planned_published`,
whose range condition on published_at leaves out the rows published recently. Each reads its
own candidates and stops at its LIMIT. `ix_operations_planned_due` stays: `outbox metrics`
reads the oldest `planned` row's available_at from it.

Expand only: indexes; the previous release's relay runs unchanged beside them. Built in the
migration's transaction, which blocks writes to the table while they are built (as 0005); IF
NOT EXISTS lets a DBA build them first with CREATE INDEX CONCURRENTLY (same names and
definitions) on a large table.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022"
down_revision: str | None = "0021"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_operations_planned_unpublished",
        "operations",
        ["available_at"],
        schema="outbox",
        postgresql_where=sa.text("state = 'planned' AND published_at IS NULL"),
        if_not_exists=True,
    )
    op.create_index(
        "ix_operations_planned_published",
        "operations",
        ["published_at"],
        schema="outbox",
        postgresql_where=sa.text("state = 'planned' AND published_at IS NOT NULL"),
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_index("ix_operations_planned_published", table_name="operations", schema="outbox")
    op.drop_index("ix_operations_planned_unpublished", table_name="operations", schema="outbox")
