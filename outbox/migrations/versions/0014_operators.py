"""Operator accounts of the console.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01

``outbox.operators`` holds one row per account ``outbox operators add NAME`` made for the
console (``outbox api`` at ``/``): its name (unique for good: the identity recorded as the
decider of what the operator approves, rejects or resolves), the argon2id hash of its password
(a person's password is guessable, so a slow, salted hash; never the password), when it was
created, and when it was removed (a removed account cannot sign in; its name stays taken).
A new, empty table: no lock on existing ones.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0014"
down_revision: str | None = "0013"
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
        "operators",
        sa.Column(
            "id",
            postgresql.UUID(as_uuid=True),
            nullable=False,
            server_default=sa.text("outbox.uuid_v7()"),
        ),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("password_hash", sa.Text(), nullable=False),
        _ts("created_at", nullable=False, now=True),
        _ts("removed_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_operators")),
        sa.UniqueConstraint("name", name=op.f("uq_operators_name")),
        sa.CheckConstraint(
            "char_length(name) BETWEEN 1 AND 128", name=op.f("ck_operators_name_length")
        ),
        sa.CheckConstraint(
            "password_hash LIKE '$argon2id$%'", name=op.f("ck_operators_password_hash_argon2id")
        ),
        schema="outbox",
    )


def downgrade() -> None:
    op.drop_table("operators", schema="outbox")
