"""The operation row's invariants in one PL/pgSQL function: the same guarantees, cheaper.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30

PostgreSQL prepares a table's CHECK expressions again for every INSERT or UPDATE statement
(it parses each stored expression and plans it), so twelve CHECKs on ``outbox.operations``
cost each move about as much server time as the rest of its UPDATE did (``pgbench``, 8
clients, prepared: 13,100 single-row updates/s with no CHECK, 6,900 with the twelve, 10,000
with this function; ``docs/performance.md``). One CHECK now calls a PL/pgSQL function, whose
expression PostgreSQL compiles once per session, holding the same twelve rules; a row that
breaks one is refused with SQLSTATE 23514 (check_violation) naming that rule's own
constraint, exactly as before (``tests/integration/test_states.py``). The payload hash's
shape is tested without a regular expression (64 characters, each a lowercase hex digit):
the regex engine built its automaton again on every row.

Adding the CHECK scans ``outbox.operations`` once, holding its ACCESS EXCLUSIVE lock (the
rows already satisfy the same rules).
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATES = "'cancelled', 'confirmed', 'failed', 'needs_human', 'planned', 'sent', 'unknown'"
TERMINAL = "'cancelled', 'confirmed', 'failed'"

# IMMUTABLE: a function of its arguments alone, as a CHECK must be. The CASE names the first
# rule the row breaks (NULL when none does: as with a CHECK, a NULL test passes).
OPERATION_INVARIANTS = f"""
CREATE FUNCTION outbox.operation_invariants_hold(
    state text, intent_key text, tool text, target text, payload_hash text,
    attempts integer, checks integer, attempt_budget_base integer, maybe_applied boolean,
    remote_ref text, first_sent_at timestamptz, sent_at timestamptz, resolved_at timestamptz)
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
    " resolved_at)"
)

# The twelve constraints this revision replaces, as revisions 0001 and 0004 made them.
FORMER_CHECKS = {
    "ck_operations_state_known": f"state IN ({STATES})",
    "ck_operations_intent_key_length": "char_length(intent_key) BETWEEN 1 AND 255",
    "ck_operations_tool_length": "char_length(tool) BETWEEN 1 AND 128",
    "ck_operations_target_not_empty": "target <> ''",
    "ck_operations_payload_hash_sha256": "payload_hash ~ '^[0-9a-f]{64}$'",
    "ck_operations_counters_not_negative": "attempts >= 0 AND checks >= 0",
    "ck_operations_confirmed_has_remote_ref": (
        "state <> 'confirmed' OR coalesce(remote_ref, '') <> ''"
    ),
    "ck_operations_terminal_iff_resolved": f"(state IN ({TERMINAL})) = (resolved_at IS NOT NULL)",
    "ck_operations_sent_has_attempt": "state <> 'sent' OR (attempts > 0 AND sent_at IS NOT NULL)",
    "ck_operations_sent_times_consistent": (
        "(attempts = 0) = (first_sent_at IS NULL) AND (first_sent_at IS NULL) = (sent_at IS NULL)"
        " AND (first_sent_at IS NULL OR first_sent_at <= sent_at)"
    ),
    "ck_operations_cancelled_never_applied": "state <> 'cancelled' OR NOT maybe_applied",
    "ck_operations_budget_within_attempts": "attempt_budget_base BETWEEN 0 AND attempts",
}


def upgrade() -> None:
    op.execute(OPERATION_INVARIANTS)
    for name in FORMER_CHECKS:
        op.drop_constraint(op.f(name), "operations", schema="outbox")
    op.create_check_constraint(
        op.f("ck_operations_invariants"), "operations", INVARIANTS_CHECK, schema="outbox"
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_operations_invariants"), "operations", schema="outbox")
    for name, condition in FORMER_CHECKS.items():
        op.create_check_constraint(op.f(name), "operations", condition, schema="outbox")
    op.execute(
        "DROP FUNCTION outbox.operation_invariants_hold(text, text, text, text, text, integer,"
        " integer, integer, boolean, text, timestamptz, timestamptz, timestamptz)"
    )
