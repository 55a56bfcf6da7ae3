"""A function that reads an operation with a snapshot taken after its caller's advisory lock.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-29
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The dispatcher takes the operation's advisory lock and reads the row in one statement (one
# round trip instead of two). A statement's own snapshot is taken before its lock call runs,
# so it could read the row as it was before the previous holder's last commit; a VOLATILE
# function's query takes a fresh snapshot (READ COMMITTED), after the lock was granted, and
# so sees every move the previous holder committed before releasing it. PL/pgSQL, so the
# query is never inlined into the caller's; `locked` makes the caller's lock an input, so
# it is evaluated first.
OPERATION_IF_LOCKED = """
CREATE FUNCTION outbox.operation_if_locked(op_id uuid, locked boolean)
  RETURNS SETOF outbox.operations
  LANGUAGE plpgsql VOLATILE AS $$
BEGIN
  IF locked THEN
    RETURN QUERY SELECT * FROM outbox.operations WHERE id = op_id;
  END IF;
END
$$
"""


def upgrade() -> None:
    op.execute(OPERATION_IF_LOCKED)


def downgrade() -> None:
    op.execute("DROP FUNCTION outbox.operation_if_locked(uuid, boolean)")
