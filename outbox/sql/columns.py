"""Column lists shared by statements that name an operation row's columns by position."""

from __future__ import annotations

from datetime import UTC, datetime

from outbox.schema import operations

#: The operation row's columns in declaration order: what driver statements that return an
#: operation select, and name their result columns by.
OPERATION_COLUMNS = tuple(column.name for column in operations.c)

#: The ``available_at`` of an operation a saga holds (a step not released yet): far enough in
#: the future that no relay publishes it and no dispatcher sends it, and still a date Python
#: can read (PostgreSQL's ``'infinity'`` is not: psycopg refuses to load it as a datetime).
#: A held step awaiting approval has this ``approval_expires_at`` too: it cannot expire before
#: anyone could see it. Released: ``available_at`` now, the approval's TTL restarted.
HELD_UNTIL = datetime(9999, 12, 31, tzinfo=UTC)
