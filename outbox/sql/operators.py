"""The operator accounts' statements: add, list, remove, and find one to sign in."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import text

from outbox.models import Executor


@dataclass(frozen=True, slots=True)
class OperatorRow:
    """One operator account as ``outbox.operators`` holds it, its password hash included
    (only :mod:`outbox.operators` sees it, to verify a password)."""

    id: UUID
    name: str
    password_hash: str
    created_at: datetime
    removed_at: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> OperatorRow:
        """Build one from a mapping holding the table's columns."""
        return cls(
            id=row["id"],
            name=row["name"],
            password_hash=row["password_hash"],
            created_at=row["created_at"],
            removed_at=row["removed_at"],
        )


_INSERT_OPERATOR = text(
    """
    INSERT INTO outbox.operators (name, password_hash) VALUES (:name, :password_hash)
    ON CONFLICT (name) DO NOTHING
    RETURNING id, name, password_hash, created_at, removed_at
    """
)


def insert_operator(executor: Executor, *, name: str, password_hash: str) -> OperatorRow | None:
    """Insert an account; ``None`` when one (live or removed) has this name already."""
    found = (
        executor.execute(_INSERT_OPERATOR, {"name": name, "password_hash": password_hash})
        .mappings()
        .one_or_none()
    )
    return OperatorRow.from_row(found) if found is not None else None


_GET_OPERATOR = text(
    "SELECT id, name, password_hash, created_at, removed_at FROM outbox.operators "
    "WHERE name = :name"
)


def get_operator(executor: Executor, name: str) -> OperatorRow | None:
    """The account named ``name`` (removed or not), or ``None``."""
    found = executor.execute(_GET_OPERATOR, {"name": name}).mappings().one_or_none()
    return OperatorRow.from_row(found) if found is not None else None


_LIST_OPERATORS = text(
    "SELECT id, name, password_hash, created_at, removed_at FROM outbox.operators ORDER BY name"
)


def list_operators(executor: Executor) -> list[OperatorRow]:
    """Every account, removed ones too, by name."""
    return [OperatorRow.from_row(row) for row in executor.execute(_LIST_OPERATORS).mappings()]


# Removing twice keeps the first time: the trail is not rewritten.
_REMOVE_OPERATOR = text(
    """
    UPDATE outbox.operators SET removed_at = coalesce(removed_at, clock_timestamp())
    WHERE name = :name
    RETURNING id, name, password_hash, created_at, removed_at
    """
)


def remove_operator(executor: Executor, name: str) -> OperatorRow | None:
    """Mark the account removed (once); ``None`` when no account has this name."""
    found = executor.execute(_REMOVE_OPERATOR, {"name": name}).mappings().one_or_none()
    return OperatorRow.from_row(found) if found is not None else None


_REHASH_OPERATOR = text(
    "UPDATE outbox.operators SET password_hash = :password_hash "
    "WHERE name = :name AND removed_at IS NULL"
)


def rehash_operator(executor: Executor, *, name: str, password_hash: str) -> None:
    """Store a new hash of the same password (argon2's parameters were raised)."""
    executor.execute(_REHASH_OPERATOR, {"name": name, "password_hash": password_hash})
