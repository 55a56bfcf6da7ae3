"""An operation carries its advisory-lock key, so a statement can take its lock.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-05

* ``operations.lock_key`` (nullable bigint): the operation's advisory-lock key
  (:func:`outbox.locks.operation_lock_key`, BLAKE2b of its id, which SQL cannot compute),
  written at enqueue. A worker taking due operations directly claims, locks and reads one
  in a single statement with it (issue 35, :mod:`outbox.workers.handoff`), and checks the
  key it locked against the id before trusting it.
* ``NULL`` on rows enqueued before this revision (or by a version without it): such a row is
  locked by its dispatcher as before, one statement later.

A nullable column without a default: adding it rewrites nothing and takes the table's lock
only for the catalog change.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0027"
down_revision: str | None = "0026"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SCHEMA = "outbox"


def upgrade() -> None:
    op.add_column("operations", sa.Column("lock_key", sa.BigInteger()), schema=_SCHEMA)


def downgrade() -> None:
    op.drop_column("operations", "lock_key", schema=_SCHEMA)
