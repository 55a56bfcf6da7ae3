"""Column lists shared by statements that name an operation row's columns by position."""

from __future__ import annotations

from outbox.schema import operations

#: The operation row's columns in declaration order: what driver statements that return an
#: operation select, and name their result columns by.
OPERATION_COLUMNS = tuple(column.name for column in operations.c)
