"""Budgets: their declarations, the usage ledger and the exhaustion alerts.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-02

``outbox.budgets`` holds each declared budget (``[budgets."name"]``), upserted by every worker
at start, so an agent process that loads no configuration still enforces them at ``enqueue``.
``outbox.budget_usage`` records what each budgeted operation used (one row per budget and
operation), counted per budget key inside the window under a transaction-scoped advisory lock.
``outbox.budget_alerts`` remembers when a key was last found exhausted, so its webhook is sent
once per window. New, empty tables: no lock on existing ones. Only ``down_revision`` names the
revision before it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _now(name: str) -> sa.Column[object]:
    return sa.Column(
        name,
        postgresql.TIMESTAMP(timezone=True),
        nullable=False,
        server_default=sa.text("clock_timestamp()"),
    )


def upgrade() -> None:
    op.create_table(
        "budgets",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("tools", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("counted_by", sa.Text(), nullable=False),
        sa.Column("window_s", sa.Double(), nullable=False),
        sa.Column("max_operations", sa.BigInteger(), nullable=True),
        sa.Column("cost_path", sa.Text(), nullable=True),
        sa.Column("max_cost", sa.Double(), nullable=True),
        _now("updated_at"),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_budgets")),
        sa.CheckConstraint("window_s > 0", name=op.f("ck_budgets_window_positive")),
        sa.CheckConstraint("max_operations > 0", name=op.f("ck_budgets_max_operations_positive")),
        sa.CheckConstraint("max_cost > 0", name=op.f("ck_budgets_max_cost_positive")),
        sa.CheckConstraint(
            "max_operations IS NOT NULL OR max_cost IS NOT NULL", name=op.f("ck_budgets_has_limit")
        ),
        sa.CheckConstraint(
            "(cost_path IS NULL) = (max_cost IS NULL)", name=op.f("ck_budgets_cost_with_max")
        ),
        schema="outbox",
    )
    op.create_table(
        "budget_usage",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("budget", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("operation_id", sa.UUID(), nullable=False),
        sa.Column("cost", sa.Double(), nullable=False, server_default="0"),
        _now("used_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_budget_usage")),
        sa.CheckConstraint("cost >= 0", name=op.f("ck_budget_usage_cost_not_negative")),
        schema="outbox",
    )
    op.create_index(
        "ix_budget_usage_budget_key_used_at",
        "budget_usage",
        ["budget", "key", "used_at"],
        schema="outbox",
    )
    op.create_index(
        "ix_budget_usage_budget_used_at",
        "budget_usage",
        ["budget", "used_at"],
        schema="outbox",
    )
    op.create_table(
        "budget_alerts",
        sa.Column("budget", sa.Text(), nullable=False),
        sa.Column("key", sa.Text(), nullable=False),
        _now("exhausted_at"),
        sa.Column("refusals", sa.BigInteger(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("budget", "key", name=op.f("pk_budget_alerts")),
        schema="outbox",
    )


def downgrade() -> None:
    op.drop_table("budget_alerts", schema="outbox")
    op.drop_table("budget_usage", schema="outbox")
    op.drop_table("budgets", schema="outbox")
