"""Webhook deliveries about something other than one operation: guard events.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02

The guard rails (circuit breakers, budgets) report on a tool, a target or a budget, not on one
operation: ``circuit_opened``, ``circuit_closed``, ``budget_exhausted``. Their delivery rows
have no ``operation_id`` and name what they are about in ``subject`` (a guard or budget key);
every row still names one or the other. The event check gains the three names.

Dropping NOT NULL and adding a nullable column rewrite nothing; the new CHECK is added
``NOT VALID`` and validated separately, so the table is not locked against the deliverer
while existing rows are read (they all have an operation).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD_EVENTS = (
    "event IN ('approval_expired', 'approval_requested', 'confirmed', 'failed',"
    " 'needs_human', 'resolved')"
)
_NEW_EVENTS = (
    "event IN ('approval_expired', 'approval_requested', 'budget_exhausted',"
    " 'circuit_closed', 'circuit_opened', 'confirmed', 'failed', 'needs_human', 'resolved')"
)


def upgrade() -> None:
    op.alter_column("webhook_deliveries", "operation_id", nullable=True, schema="outbox")
    op.add_column("webhook_deliveries", sa.Column("subject", sa.Text()), schema="outbox")
    op.execute(
        "ALTER TABLE outbox.webhook_deliveries ADD CONSTRAINT "
        "ck_webhook_deliveries_about_something "
        "CHECK (operation_id IS NOT NULL OR subject IS NOT NULL) NOT VALID"
    )
    op.execute(
        "ALTER TABLE outbox.webhook_deliveries VALIDATE CONSTRAINT "
        "ck_webhook_deliveries_about_something"
    )
    op.drop_constraint(
        op.f("ck_webhook_deliveries_event_known"), "webhook_deliveries", "check", schema="outbox"
    )
    op.create_check_constraint(
        op.f("ck_webhook_deliveries_event_known"),
        "webhook_deliveries",
        _NEW_EVENTS,
        schema="outbox",
    )


def downgrade() -> None:
    op.execute("DELETE FROM outbox.webhook_deliveries WHERE operation_id IS NULL")
    op.drop_constraint(
        op.f("ck_webhook_deliveries_event_known"), "webhook_deliveries", "check", schema="outbox"
    )
    op.create_check_constraint(
        op.f("ck_webhook_deliveries_event_known"),
        "webhook_deliveries",
        _OLD_EVENTS,
        schema="outbox",
    )
    op.drop_constraint(
        op.f("ck_webhook_deliveries_about_something"),
        "webhook_deliveries",
        "check",
        schema="outbox",
    )
    op.drop_column("webhook_deliveries", "subject", schema="outbox")
    op.alter_column("webhook_deliveries", "operation_id", nullable=False, schema="outbox")
