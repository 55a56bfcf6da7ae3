"""Bearer tokens of the HTTP API.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01

``outbox.api_tokens`` holds one row per token ``outbox tokens create NAME --scope S`` made: its
name (unique for good: the identity the API records as ``requested_by`` or the decider), its
scope (``agent`` or ``operator``), the sha256 of the token (never the token: a token is 256
random bits, so a fast hash is as safe as a slow one and lets each request find its row with
one index probe; argon2 is for guessable passwords), and when it was created, last used and
revoked. A new, empty table: no lock on existing ones.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0013"
down_revision: str | None = "0012"
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
        "api_tokens",
        sa.Column(
            "id",
            postgresql.UUID(as_uuid=True),
            nullable=False,
            server_default=sa.text("outbox.uuid_v7()"),
        ),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("token_hash", sa.Text(), nullable=False),
        _ts("created_at", nullable=False, now=True),
        _ts("last_used_at"),
        _ts("revoked_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("name", name=op.f("uq_api_tokens_name")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_api_tokens_token_hash")),
        sa.CheckConstraint(
            "scope IN ('agent', 'operator')", name=op.f("ck_api_tokens_scope_known")
        ),
        sa.CheckConstraint(
            "char_length(name) BETWEEN 1 AND 128", name=op.f("ck_api_tokens_name_length")
        ),
        sa.CheckConstraint(
            "octet_length(token_hash) = 64 AND ltrim(token_hash, '0123456789abcdef') = ''",
            name=op.f("ck_api_tokens_token_hash_sha256"),
        ),
        schema="outbox",
    )


def downgrade() -> None:
    op.drop_table("api_tokens", schema="outbox")
