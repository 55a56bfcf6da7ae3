"""Autovacuum of outbox.operations follows the churn of its live rows, not the size of its history.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-29
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Every operation passes through the live queues (planned, sent, unknown) and leaves a dead
    # entry behind in their partial indexes; the relay's claim and the sweep walk those entries
    # until a vacuum removes them. PostgreSQL's default trigger (50 + 20 % of the table's rows
    # dead) grows with the finished rows kept for retention, so the queues' dead entries, and
    # the claim's cost, would grow with the history (docs/performance.md, "Table storage and
    # autovacuum"; bench/scale.py measures it). A fixed threshold ties autovacuum to the churn.
    # Storage parameters only: no rewrite, and the lock (SHARE UPDATE EXCLUSIVE) does not block
    # reads or writes. A DBA may tune them further with ALTER TABLE ... SET.
    op.execute(
        "ALTER TABLE outbox.operations SET "
        "(autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000)"
    )


def downgrade() -> None:
    op.execute(
        "ALTER TABLE outbox.operations RESET "
        "(autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold)"
    )
