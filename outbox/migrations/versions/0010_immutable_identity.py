"""The database enforces what the code promises: an operation's identity never changes, its
audit trail lives as long as it does, and only a finished operation can be deleted.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

* ``operations_immutable``: an ``AFTER UPDATE OF`` row trigger refusing a change to any
  column written once at enqueue (``IMMUTABLE_COLUMNS``) with SQLSTATE 23000
  (integrity_constraint_violation), the column named in the message and in the error's
  ``column`` field; the error aborts the statement, so nothing is written. ``UPDATE OF``
  queues the trigger only for statements that name one of those columns in their SET list,
  which no move does. AFTER, not BEFORE: PostgreSQL locks the row for *any* BEFORE UPDATE
  row trigger before it looks at the trigger's columns (a tuple lock and its WAL record on
  every move: -18% single-row updates/s with pgbench), while an AFTER trigger whose columns
  are not set costs a move nothing measurable (``docs/performance.md``). Setting a column
  to the value it holds is allowed (nothing changes); the payload is compared as text, so
  even ``1`` into ``1.0`` is refused. A new ``id`` is refused first by the events' foreign
  key (SQLSTATE 23503: its trigger sorts first, and every operation has an event).
* ``operations_delete_guard``: deleting a live operation (anything but ``confirmed``,
  ``failed`` or ``cancelled``) is refused: retention prunes finished operations only.
* ``events_kept``: an event can be deleted only once its operation is gone, which happens
  only through the cascade of a finished operation's deletion (``outbox db prune``): the
  audit trail of an operation that exists is never shortened. (``UPDATE`` of events was
  refused since 0001.)
* ``intent_hash``: the sha256 of (tool, target, payload hash), written at enqueue and checked
  by the dispatcher before every send, so a row whose tool or target was changed by someone
  who can drop the trigger (DDL rights) goes to a person instead of to the remote. Filled in
  here for existing rows by one UPDATE of every row (prune first if the table is large).

TRUNCATE is not covered: it needs the table owner's TRUNCATE privilege, and tests use it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Written once at enqueue, never by any move: the intent's identity and its provenance.
#: Not ``created_at``: a bookkeeping time like the others (tests age rows by moving it back),
#: and the id, a UUIDv7 from the database clock, already carries the creation time.
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
)

# The same digest as outbox.canonical.intent_hash: sha256 over the UTF-8 bytes of tool,
# target and payload hash separated by a NUL byte (PostgreSQL text cannot hold one, so the
# encoding is unambiguous). For existing rows and hand-written inserts; enqueue computes it
# in Python. STABLE: convert_to is.
INTENT_HASH = """
CREATE FUNCTION outbox.intent_hash(tool text, target text, payload_hash text) RETURNS text
  LANGUAGE sql STABLE PARALLEL SAFE AS $$
  SELECT encode(sha256(convert_to(tool, 'UTF8') || '\\x00'::bytea
                       || convert_to(target, 'UTF8') || '\\x00'::bytea
                       || convert_to(payload_hash, 'UTF8')), 'hex')
$$
"""

_CHANGED = "\n".join(
    f"  IF OLD.{name}{'::text' if name == 'payload' else ''} IS DISTINCT FROM "
    f"NEW.{name}{'::text' if name == 'payload' else ''} THEN changed := '{name}'; END IF;"
    for name in reversed(IMMUTABLE_COLUMNS)
)

IMMUTABLE = f"""
CREATE FUNCTION outbox.operations_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
  changed text;
BEGIN
{_CHANGED}
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
  AFTER UPDATE OF {", ".join(IMMUTABLE_COLUMNS)} ON outbox.operations
  FOR EACH ROW EXECUTE FUNCTION outbox.operations_immutable();
"""

DELETE_GUARD = """
CREATE FUNCTION outbox.operations_delete_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF OLD.state NOT IN ('cancelled', 'confirmed', 'failed') THEN
    RAISE EXCEPTION USING ERRCODE = 'integrity_constraint_violation',
      SCHEMA = 'outbox', TABLE = 'operations',
      MESSAGE = 'outbox.operations: operation ' || OLD.id || ' is ' || OLD.state
        || '; only a finished (confirmed, failed or cancelled) operation can be deleted';
  END IF;
  RETURN OLD;
END
$$;
CREATE TRIGGER operations_delete_guard BEFORE DELETE ON outbox.operations
  FOR EACH ROW EXECUTE FUNCTION outbox.operations_delete_guard();
"""

# VOLATILE (the default), so the query sees the operation's deletion by the statement whose
# cascade deletes the event.
EVENTS_KEPT = """
CREATE FUNCTION outbox.events_kept() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  IF EXISTS (SELECT FROM outbox.operations WHERE id = OLD.operation_id) THEN
    RAISE EXCEPTION USING ERRCODE = 'integrity_constraint_violation',
      SCHEMA = 'outbox', TABLE = 'events',
      MESSAGE = 'outbox.events is append-only: an event goes only with its operation, '
        || 'when a finished operation is pruned (operation ' || OLD.operation_id || ')';
  END IF;
  RETURN OLD;
END
$$;
CREATE TRIGGER events_kept BEFORE DELETE ON outbox.events
  FOR EACH ROW EXECUTE FUNCTION outbox.events_kept();
"""


def upgrade() -> None:
    op.execute(INTENT_HASH)
    op.add_column("operations", sa.Column("intent_hash", sa.Text()), schema="outbox")
    op.execute(
        "UPDATE outbox.operations SET intent_hash = outbox.intent_hash(tool, target, payload_hash)"
    )
    op.alter_column("operations", "intent_hash", nullable=False, schema="outbox")
    op.execute(IMMUTABLE)
    op.execute(DELETE_GUARD)
    op.execute(EVENTS_KEPT)


def downgrade() -> None:
    op.execute("DROP TRIGGER events_kept ON outbox.events")
    op.execute("DROP FUNCTION outbox.events_kept()")
    op.execute("DROP TRIGGER operations_delete_guard ON outbox.operations")
    op.execute("DROP FUNCTION outbox.operations_delete_guard()")
    op.execute("DROP TRIGGER operations_immutable ON outbox.operations")
    op.execute("DROP FUNCTION outbox.operations_immutable()")
    op.drop_column("operations", "intent_hash", schema="outbox")
    op.execute("DROP FUNCTION outbox.intent_hash(text, text, text)")
