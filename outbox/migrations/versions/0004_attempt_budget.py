"""An operator's replay grants a fresh budget of attempts.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Expand only: a column with a default, which older code simply ignores.
    op.add_column(
        "operations",
        sa.Column("attempt_budget_base", sa.Integer(), server_default="0", nullable=False),
        schema="outbox",
    )
    op.create_check_constraint(
        op.f("ck_operations_budget_within_attempts"),
        "operations",
        "attempt_budget_base BETWEEN 0 AND attempts",
        schema="outbox",
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_operations_budget_within_attempts"), "operations", schema="outbox")
    op.drop_column("operations", "attempt_budget_base", schema="outbox")
