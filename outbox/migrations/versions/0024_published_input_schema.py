"""Each tool's published input_schema, beside its approval policy.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-03

`outbox.tool_policies` told an agent process (one that loads no tools) only whether a tool
requires approval; a typo'd tool name was accepted there and ended `needs_human` on the
worker ("not registered"), and a payload the tool's input_schema refuses was sent to be
refused by the remote. The workers (and `outbox tools publish`) now publish the schema too,
and `enqueue` checks a payload against it before anything is written (outbox/published.py).

Expand only: one nullable column (NULL: the tool declares no schema, or a previous release's
worker published it); the previous release's workers and agents run unchanged beside it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0024"
down_revision: str | None = "0023"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "tool_policies",
        sa.Column("input_schema", postgresql.JSONB(), nullable=True),
        schema="outbox",
    )


def downgrade() -> None:
    op.drop_column("tool_policies", "input_schema", schema="outbox")
