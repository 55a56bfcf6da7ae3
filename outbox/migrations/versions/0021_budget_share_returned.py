"""A cancelled operation's budget share is given back by deleting its usage rows.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-02

Until now a budget key's count joined every usage row of its window to ``outbox.operations``
to leave the ``cancelled`` ones out (a pruned operation, with no row, still counted): a
budgeted ``enqueue`` read one operation per use of its key (8.4 ms at 5,000 uses). Here the
share is given back when the operation becomes ``cancelled``: the trigger
``operations_return_budget_share`` deletes its ``outbox.budget_usage`` rows in the statement
that cancels it, so a key's count reads the key's window of ``budget_usage`` alone (an
index-only scan of ``ix_budget_usage_budget_key_used_at_cost``, which carries ``cost``).

A trigger, not a statement in ``outbox.transitions`` (the one module that writes ``state``):
every way into ``cancelled`` (the agent's cancel, an approver's reject, the sweep's approval
expiry, a saga's cancel, a person in psql, and the code of an older release still running
next to this one during a rolling upgrade) returns the share, with nothing to remember in the
code. ``cancelled`` is terminal, so a row is cancelled once. ``AFTER UPDATE OF state ... WHEN``:
an update that does not set ``state`` (the relay's ``published_at``, a saga's hold) does not
look at it, and a move to any other state evaluates the WHEN and queues nothing
(docs/performance.md measures the moves with and without it).

The delete skips usage rows another transaction has locked: the only other writers are the
counts, which delete a key's rows that left the window (never counted again), so it never
waits on an enqueuer's transaction, nor deadlocks with one deleting the same operation's rows
of two budgets in the other order.

The usage rows of operations cancelled already are deleted here, after the trigger is made
(its lock on ``outbox.operations`` holds cancels back until the commit, so none is missed).
``budget_usage`` holds about what the windows hold: its indexes are built in place (CREATE
INDEX locks the table against writes for the moment it takes: budgeted enqueues wait).
Downgrading drops the trigger and the index on ``operation_id`` and restores the old index;
the deleted rows stay deleted, which the old count reads the same (a cancelled operation's
rows were left out of it).
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0021"
down_revision: str | None = "0020"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RETURN_SHARE = """
CREATE FUNCTION outbox.return_budget_share() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM outbox.budget_usage WHERE id IN (
    SELECT u.id FROM outbox.budget_usage AS u WHERE u.operation_id = NEW.id
    FOR UPDATE SKIP LOCKED);
  RETURN NULL;
END
$$;
CREATE TRIGGER operations_return_budget_share AFTER UPDATE OF state ON outbox.operations
  FOR EACH ROW WHEN (NEW.state = 'cancelled' AND OLD.state IS DISTINCT FROM 'cancelled')
  EXECUTE FUNCTION outbox.return_budget_share();
"""


def upgrade() -> None:
    op.create_index(
        "ix_budget_usage_budget_key_used_at_cost",
        "budget_usage",
        ["budget", "key", "used_at"],
        schema="outbox",
        postgresql_include=["cost"],
    )
    op.drop_index("ix_budget_usage_budget_key_used_at", table_name="budget_usage", schema="outbox")
    op.create_index(
        "ix_budget_usage_operation_id", "budget_usage", ["operation_id"], schema="outbox"
    )
    op.execute(RETURN_SHARE)
    op.execute(
        "DELETE FROM outbox.budget_usage AS u USING outbox.operations AS o "
        "WHERE o.id = u.operation_id AND o.state = 'cancelled'"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER operations_return_budget_share ON outbox.operations")
    op.execute("DROP FUNCTION outbox.return_budget_share()")
    op.drop_index("ix_budget_usage_operation_id", table_name="budget_usage", schema="outbox")
    op.create_index(
        "ix_budget_usage_budget_key_used_at",
        "budget_usage",
        ["budget", "key", "used_at"],
        schema="outbox",
    )
    op.drop_index(
        "ix_budget_usage_budget_key_used_at_cost", table_name="budget_usage", schema="outbox"
    )
