"""The guards' state: circuit breakers, rate-limit buckets, and who reset them.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-02

``outbox.guard_breakers`` holds one circuit breaker per scope (``dispatch`` or ``lookup``),
tool and target (``''``: the whole tool); ``outbox.guard_buckets`` the rate limits' GCRA
state; ``outbox.guard_resets`` the audit of ``outbox guards reset``. The concurrency cap
counts ``sent`` rows through the existing partial index of the ``sent`` rows
(``ix_operations_sent_since``: only the rows in flight). New, empty tables: no lock on
existing ones.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NOW = sa.text("clock_timestamp()")


def _ts(name: str, *, nullable: bool = True, now: bool = False) -> sa.Column[object]:
    return sa.Column(
        name,
        postgresql.TIMESTAMP(timezone=True),
        nullable=nullable,
        server_default=_NOW if now else None,
    )


def upgrade() -> None:
    op.create_table(
        "guard_breakers",
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("tool", sa.Text(), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False, server_default=sa.text("'closed'")),
        sa.Column("failures", sa.Integer(), nullable=False, server_default=sa.text("0")),
        _ts("window_started_at"),
        sa.Column("window_calls", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.Column("window_failures", sa.Integer(), nullable=False, server_default=sa.text("0")),
        _ts("opened_at"),
        _ts("open_until"),
        sa.Column("probe_operation_id", postgresql.UUID(as_uuid=True), nullable=True),
        _ts("probe_until"),
        _ts("updated_at", nullable=False, now=True),
        sa.PrimaryKeyConstraint("scope", "tool", "target", name=op.f("pk_guard_breakers")),
        sa.CheckConstraint(
            "scope IN ('dispatch', 'lookup')", name=op.f("ck_guard_breakers_scope_known")
        ),
        sa.CheckConstraint(
            "state IN ('closed', 'open', 'half_open')", name=op.f("ck_guard_breakers_state_known")
        ),
        sa.CheckConstraint(
            "state = 'closed' OR open_until IS NOT NULL",
            name=op.f("ck_guard_breakers_open_has_until"),
        ),
        schema="outbox",
    )
    op.create_table(
        "guard_buckets",
        sa.Column("tool", sa.Text(), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        _ts("tat", nullable=False),
        sa.PrimaryKeyConstraint("tool", "target", name=op.f("pk_guard_buckets")),
        schema="outbox",
    )
    op.create_table(
        "guard_resets",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("guard", sa.Text(), nullable=False),
        sa.Column("tool", sa.Text(), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("reset_by", sa.Text(), nullable=False),
        sa.Column("note", sa.Text(), nullable=False),
        _ts("reset_at", nullable=False, now=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_guard_resets")),
        sa.CheckConstraint(
            "guard IN ('breaker', 'lookup_breaker', 'rate')",
            name=op.f("ck_guard_resets_guard_known"),
        ),
        schema="outbox",
    )


def downgrade() -> None:
    op.drop_table("guard_resets", schema="outbox")
    op.drop_table("guard_buckets", schema="outbox")
    op.drop_table("guard_breakers", schema="outbox")
