"""Alembic migrations of the ``outbox`` schema, shipped inside the package."""
