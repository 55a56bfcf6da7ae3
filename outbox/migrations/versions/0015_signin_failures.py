"""Failed console sign-ins, shared by every ``outbox api`` process.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-02

``outbox.signin_failures`` holds one row per failed sign-in at the console, counted against
the name tried (``kind = 'name'``) and against the client's address (``kind = 'address'``):
the sign-in throttle reads the recent ones of both. It was kept in each process's memory; with
several API worker processes (``outbox api --workers N``) a guesser would have had N times the
tries. Rows older than the throttle's window are deleted as new failures come in. A new, empty
table: no lock on existing ones.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "signin_failures",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column(
            "failed_at",
            postgresql.TIMESTAMP(timezone=True),
            nullable=False,
            server_default=sa.text("clock_timestamp()"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_signin_failures")),
        sa.CheckConstraint(
            "kind IN ('name', 'address')", name=op.f("ck_signin_failures_kind_known")
        ),
        sa.CheckConstraint(
            "char_length(value) <= 128", name=op.f("ck_signin_failures_value_length")
        ),
        schema="outbox",
    )
    op.create_index(
        "ix_signin_failures_kind_value_failed_at",
        "signin_failures",
        ["kind", "value", "failed_at"],
        schema="outbox",
    )
    op.create_index(
        "ix_signin_failures_failed_at", "signin_failures", ["failed_at"], schema="outbox"
    )


def downgrade() -> None:
    op.drop_table("signin_failures", schema="outbox")
