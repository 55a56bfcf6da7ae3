"""The console's sessions, so that signing out ends one for good.

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-04

A console session was only a signed cookie: signing out cleared it in that browser, but a copy
of the cookie kept working for up to 8 hours. ``outbox.console_sessions`` holds one row per
signed-in session (its id is in the cookie); every console request reads it with the account,
and sign-out, `outbox operators sign-out-all NAME`, a password change and a removal delete
rows, which ends those sessions at once. A new, empty table: no lock on existing ones.
Sessions started before this release carry no id and must sign in again.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0025"
down_revision: str | None = "0024"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "console_sessions",
        sa.Column(
            "id",
            postgresql.UUID(as_uuid=True),
            nullable=False,
            server_default=sa.text("gen_random_uuid()"),
        ),
        sa.Column("operator_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column(
            "started_at",
            postgresql.TIMESTAMP(timezone=True),
            nullable=False,
            server_default=sa.text("clock_timestamp()"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_console_sessions")),
        sa.ForeignKeyConstraint(
            ["operator_id"],
            ["outbox.operators.id"],
            ondelete="CASCADE",
            name=op.f("fk_console_sessions_operator_id_operators"),
        ),
        schema="outbox",
    )
    op.create_index(
        "ix_console_sessions_operator_id", "console_sessions", ["operator_id"], schema="outbox"
    )
    op.create_index(
        "ix_console_sessions_started_at", "console_sessions", ["started_at"], schema="outbox"
    )


def downgrade() -> None:
    op.drop_table("console_sessions", schema="outbox")
