"""Approval before send: the state ``awaiting_approval``, its columns, its invariants, and the
tools' approval policies.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01

``outbox.operations`` gains ``approval_required`` (set at enqueue when the tool or the call
requires a person's approval), ``approval_expires_at`` (the database clock at enqueue plus the
tool's TTL), and the decision: ``decided_by``, ``decided_at`` and ``approved_payload_hash`` (the
hash the approver saw; an approval binds to it). The row's invariants function (migration 0009)
is replaced by one with three more rules, each with its constraint name:

* ``ck_operations_approval_before_send``: an operation that requires approval and holds no
  approval of its stored payload is ``awaiting_approval`` or ``cancelled``, never attempted;
* ``ck_operations_awaiting_approval_unsent``: ``awaiting_approval`` means approval required, no
  attempt, nothing decided, and an expiry;
* ``ck_operations_decision_recorded``: a decision names who and when, together.

``outbox.tool_policies`` holds each tool's approval policy, upserted by every process that loads
the tools: ``enqueue`` reads it in its INSERT (an agent process usually loads no tools). The
webhook deliveries accept the events ``approval_requested`` and ``approval_expired``.

The new columns have defaults that need no rewrite; swapping the CHECK scans
``outbox.operations`` once under its ACCESS EXCLUSIVE lock.
"""

import importlib
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATES = (
    "'awaiting_approval', 'cancelled', 'confirmed', 'failed', 'needs_human', 'planned', 'sent',"
    " 'unknown'"
)
TERMINAL = "'cancelled', 'confirmed', 'failed'"

OPERATION_INVARIANTS = f"""
CREATE FUNCTION outbox.operation_invariants_hold(
    state text, intent_key text, tool text, target text, payload_hash text,
    attempts integer, checks integer, attempt_budget_base integer, maybe_applied boolean,
    remote_ref text, first_sent_at timestamptz, sent_at timestamptz, resolved_at timestamptz,
    approval_required boolean, approval_expires_at timestamptz, decided_by text,
    decided_at timestamptz, approved_payload_hash text)
  RETURNS boolean
  LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
  broken text := CASE
    WHEN NOT (state IN ({STATES}))
      THEN 'ck_operations_state_known'
    WHEN NOT (char_length(intent_key) BETWEEN 1 AND 255)
      THEN 'ck_operations_intent_key_length'
    WHEN NOT (char_length(tool) BETWEEN 1 AND 128)
      THEN 'ck_operations_tool_length'
    WHEN NOT (target <> '')
      THEN 'ck_operations_target_not_empty'
    WHEN NOT (octet_length(payload_hash) = 64 AND ltrim(payload_hash, '0123456789abcdef') = '')
      THEN 'ck_operations_payload_hash_sha256'
    WHEN NOT (attempts >= 0 AND checks >= 0)
      THEN 'ck_operations_counters_not_negative'
    WHEN NOT (state <> 'confirmed' OR coalesce(remote_ref, '') <> '')
      THEN 'ck_operations_confirmed_has_remote_ref'
    WHEN NOT ((state IN ({TERMINAL})) = (resolved_at IS NOT NULL))
      THEN 'ck_operations_terminal_iff_resolved'
    WHEN NOT (state <> 'sent' OR (attempts > 0 AND sent_at IS NOT NULL))
      THEN 'ck_operations_sent_has_attempt'
    WHEN NOT ((attempts = 0) = (first_sent_at IS NULL)
              AND (first_sent_at IS NULL) = (sent_at IS NULL)
              AND (first_sent_at IS NULL OR first_sent_at <= sent_at))
      THEN 'ck_operations_sent_times_consistent'
    WHEN NOT (state <> 'cancelled' OR NOT maybe_applied)
      THEN 'ck_operations_cancelled_never_applied'
    WHEN NOT (attempt_budget_base BETWEEN 0 AND attempts)
      THEN 'ck_operations_budget_within_attempts'
    WHEN NOT (NOT approval_required OR approved_payload_hash IS NOT DISTINCT FROM payload_hash
              OR (state IN ('awaiting_approval', 'cancelled') AND attempts = 0))
      THEN 'ck_operations_approval_before_send'
    WHEN NOT (state <> 'awaiting_approval'
              OR (approval_required AND attempts = 0 AND approval_expires_at IS NOT NULL
                  AND decided_at IS NULL AND approved_payload_hash IS NULL))
      THEN 'ck_operations_awaiting_approval_unsent'
    WHEN NOT ((decided_by IS NULL) = (decided_at IS NULL)
              AND (approved_payload_hash IS NULL OR decided_at IS NOT NULL))
      THEN 'ck_operations_decision_recorded'
  END;
BEGIN
  IF broken IS NOT NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'check_violation', CONSTRAINT = broken,
      SCHEMA = 'outbox', TABLE = 'operations',
      MESSAGE = 'new row for relation "operations" violates check constraint "' || broken || '"';
  END IF;
  RETURN true;
END
$$
"""

INVARIANTS_CHECK = (
    "outbox.operation_invariants_hold(state, intent_key, tool, target, payload_hash, attempts,"
    " checks, attempt_budget_base, maybe_applied, remote_ref, first_sent_at, sent_at,"
    " resolved_at, approval_required, approval_expires_at, decided_by, decided_at,"
    " approved_payload_hash)"
)
NEW_SIGNATURE = (
    "outbox.operation_invariants_hold(text, text, text, text, text, integer, integer, integer,"
    " boolean, text, timestamptz, timestamptz, timestamptz, boolean, timestamptz, text,"
    " timestamptz, text)"
)
FORMER_SIGNATURE = (
    "outbox.operation_invariants_hold(text, text, text, text, text, integer, integer, integer,"
    " boolean, text, timestamptz, timestamptz, timestamptz)"
)
EVENTS = (
    "'approval_expired', 'approval_requested', 'confirmed', 'failed', 'needs_human', 'resolved'"
)
FORMER_EVENTS = "'confirmed', 'failed', 'needs_human', 'resolved'"

NEW_COLUMNS = (
    "approval_required",
    "approval_expires_at",
    "decided_by",
    "decided_at",
    "approved_payload_hash",
)


def _former() -> object:
    """Migration 0009, whose function and CHECK a downgrade puts back."""
    return importlib.import_module("outbox.migrations.versions.0009_invariants_function")


def _swap_event_check(events: str) -> None:
    op.drop_constraint(
        op.f("ck_webhook_deliveries_event_known"), "webhook_deliveries", "check", schema="outbox"
    )
    op.create_check_constraint(
        op.f("ck_webhook_deliveries_event_known"),
        "webhook_deliveries",
        f"event IN ({events})",
        schema="outbox",
    )


def upgrade() -> None:
    op.add_column(
        "operations",
        sa.Column("approval_required", sa.Boolean(), nullable=False, server_default=sa.false()),
        schema="outbox",
    )
    op.add_column(
        "operations",
        sa.Column("approval_expires_at", postgresql.TIMESTAMP(timezone=True)),
        schema="outbox",
    )
    op.add_column("operations", sa.Column("decided_by", sa.Text()), schema="outbox")
    op.add_column(
        "operations",
        sa.Column("decided_at", postgresql.TIMESTAMP(timezone=True)),
        schema="outbox",
    )
    op.add_column("operations", sa.Column("approved_payload_hash", sa.Text()), schema="outbox")
    op.execute(OPERATION_INVARIANTS)
    op.drop_constraint(op.f("ck_operations_invariants"), "operations", "check", schema="outbox")
    op.create_check_constraint(
        op.f("ck_operations_invariants"), "operations", INVARIANTS_CHECK, schema="outbox"
    )
    op.execute(f"DROP FUNCTION {FORMER_SIGNATURE}")
    op.create_index(
        op.f("ix_operations_awaiting_approval_expires"),
        "operations",
        ["approval_expires_at"],
        schema="outbox",
        postgresql_where=sa.text("state = 'awaiting_approval'"),
    )
    op.create_table(
        "tool_policies",
        sa.Column("tool", sa.Text(), nullable=False),
        sa.Column("approval_required", sa.Boolean(), nullable=False),
        sa.Column("approval_ttl_s", sa.Double(), nullable=False),
        sa.Column(
            "updated_at",
            postgresql.TIMESTAMP(timezone=True),
            nullable=False,
            server_default=sa.text("clock_timestamp()"),
        ),
        sa.PrimaryKeyConstraint("tool", name=op.f("pk_tool_policies")),
        sa.CheckConstraint("approval_ttl_s > 0", name=op.f("ck_tool_policies_ttl_positive")),
        schema="outbox",
    )
    _swap_event_check(EVENTS)


def downgrade() -> None:
    former = _former()
    _swap_event_check(FORMER_EVENTS)
    op.drop_table("tool_policies", schema="outbox")
    op.drop_index(op.f("ix_operations_awaiting_approval_expires"), "operations", schema="outbox")
    # Rows the former states cannot hold: an approval nobody gave can no longer be waited for.
    op.execute(
        "UPDATE outbox.operations SET state = 'cancelled', resolved_at = clock_timestamp(),"
        " updated_at = clock_timestamp() WHERE state = 'awaiting_approval'"
    )
    op.execute(former.OPERATION_INVARIANTS)  # type: ignore[attr-defined]
    op.drop_constraint(op.f("ck_operations_invariants"), "operations", "check", schema="outbox")
    op.create_check_constraint(
        op.f("ck_operations_invariants"),
        "operations",
        former.INVARIANTS_CHECK,  # type: ignore[attr-defined]
        schema="outbox",
    )
    op.execute(f"DROP FUNCTION {NEW_SIGNATURE}")
    for name in reversed(NEW_COLUMNS):
        op.drop_column("operations", name, schema="outbox")
