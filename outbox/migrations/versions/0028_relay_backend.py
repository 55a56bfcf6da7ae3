"""A relay's or worker's flag names the database session that keeps it.

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-05

* ``relays.backend_pid`` (nullable integer): the ``pg_backend_pid()`` of the connection that
  wrote the flag (a relay's, or a worker's that takes due operations directly: each writes
  it on the one connection it keeps for its life). A flag whose session is gone (its process
  was killed: the kernel closed the socket, the server ended the session) no longer counts,
  without waiting for its heartbeat to age (issue 35): a relay stops deferring fresh rows to
  a RabbitMQ worker that died waiting for work. ``NULL`` on a flag written before this
  revision: its heartbeat alone decides, as before.

A nullable column without a default: adding it rewrites nothing.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0028"
down_revision: str | None = "0027"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SCHEMA = "outbox"


def upgrade() -> None:
    op.add_column("relays", sa.Column("backend_pid", sa.Integer()), schema=_SCHEMA)


def downgrade() -> None:
    op.drop_column("relays", "backend_pid", schema=_SCHEMA)
