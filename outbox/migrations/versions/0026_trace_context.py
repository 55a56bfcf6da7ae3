"""An operation carries its caller's W3C trace context, immutable like the payload.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-04

* ``operations.traceparent`` and ``operations.tracestate`` (nullable text): the W3C trace
  context of the caller that enqueued the operation (issue 34), so that every later stage
  (publish, dispatch attempts, lookups hours after, a person's approval) joins the agent's
  trace. ``NULL`` when the caller had no trace: nothing is recorded then.
* Both are written once at enqueue: the immutable columns' trigger (0010, 0023) guards them
  like the payload.

Nullable columns without a default: adding them rewrites nothing and takes the table's lock
only for the catalog change.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0026"
down_revision: str | None = "0025"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: 0023's immutable columns, and the caller's trace context.
IMMUTABLE_COLUMNS = (
    "id",
    "intent_key",
    "tool",
    "target",
    "payload",
    "payload_hash",
    "intent_hash",
    "requested_by",
    "metadata",
    "agent",
    "traceparent",
    "tracestate",
)


def _immutable(columns: Sequence[str]) -> str:
    # As 0023's: the payload is compared as text, so even 1 into 1.0 is refused.
    changed = "\n".join(
        f"  IF OLD.{name}{'::text' if name == 'payload' else ''} IS DISTINCT FROM "
        f"NEW.{name}{'::text' if name == 'payload' else ''} THEN changed := '{name}'; END IF;"
        for name in reversed(columns)
    )
    return f"""
CREATE OR REPLACE FUNCTION outbox.operations_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
  changed text;
BEGIN
{changed}
  IF changed IS NOT NULL THEN
    RAISE EXCEPTION USING ERRCODE = 'integrity_constraint_violation',
      SCHEMA = 'outbox', TABLE = 'operations', COLUMN = changed,
      MESSAGE = 'outbox.operations.' || changed || ' is immutable: an operation''s identity '
        || 'never changes after enqueue (operation ' || OLD.id || ')';
  END IF;
  RETURN NULL;
END
$$;
CREATE TRIGGER operations_immutable
  AFTER UPDATE OF {", ".join(columns)} ON outbox.operations
  FOR EACH ROW EXECUTE FUNCTION outbox.operations_immutable();
"""


IMMUTABLE = _immutable(IMMUTABLE_COLUMNS)

_SCHEMA = "outbox"


def upgrade() -> None:
    op.add_column("operations", sa.Column("traceparent", sa.Text()), schema=_SCHEMA)
    op.add_column("operations", sa.Column("tracestate", sa.Text()), schema=_SCHEMA)
    op.execute("DROP TRIGGER operations_immutable ON outbox.operations")
    op.execute(IMMUTABLE)


def downgrade() -> None:
    op.execute("DROP TRIGGER operations_immutable ON outbox.operations")
    op.execute(_immutable(IMMUTABLE_COLUMNS[:-2]))
    op.drop_column("operations", "tracestate", schema=_SCHEMA)
    op.drop_column("operations", "traceparent", schema=_SCHEMA)
