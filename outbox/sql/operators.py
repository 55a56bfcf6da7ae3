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


_SET_PASSWORD = text(
    """
    UPDATE outbox.operators SET password_hash = :password_hash
    WHERE name = :name AND removed_at IS NULL
    RETURNING id, name, password_hash, created_at, removed_at
    """
)


def set_password(executor: Executor, *, name: str, password_hash: str) -> OperatorRow | None:
    """Replace a live account's hash (a new password); ``None`` when no live account has
    this name."""
    found = (
        executor.execute(_SET_PASSWORD, {"name": name, "password_hash": password_hash})
        .mappings()
        .one_or_none()
    )
    return OperatorRow.from_row(found) if found is not None else None


# --- console sessions ------------------------------------------------------------------------

# One statement: the session of a live account, and the sessions past their longest life go.
_START_SESSION = text(
    """
    WITH expired AS (
        DELETE FROM outbox.console_sessions
        WHERE started_at < clock_timestamp() - make_interval(secs => :max_age_s)
    )
    INSERT INTO outbox.console_sessions (operator_id)
    SELECT id FROM outbox.operators WHERE name = :name AND removed_at IS NULL
    RETURNING id
    """
)


def start_session(executor: Executor, *, name: str, max_age_s: float) -> UUID | None:
    """A new session of the live account ``name`` (``None`` without one); sessions older than
    ``max_age_s`` are deleted."""
    found = executor.execute(_START_SESSION, {"name": name, "max_age_s": max_age_s})
    session_id: UUID | None = found.scalar_one_or_none()
    return session_id


_SESSION_OPERATOR = text(
    """
    SELECT o.id, o.name, o.password_hash, o.created_at, o.removed_at
    FROM outbox.console_sessions AS s JOIN outbox.operators AS o ON o.id = s.operator_id
    WHERE s.id = :session_id AND o.removed_at IS NULL
      AND s.started_at > clock_timestamp() - make_interval(secs => :max_age_s)
    """
)


def session_operator(
    executor: Executor, *, session_id: UUID, max_age_s: float
) -> OperatorRow | None:
    """The live account whose session ``session_id`` is, if it has not ended and is younger
    than ``max_age_s``."""
    found = (
        executor.execute(_SESSION_OPERATOR, {"session_id": session_id, "max_age_s": max_age_s})
        .mappings()
        .one_or_none()
    )
    return OperatorRow.from_row(found) if found is not None else None


_END_SESSION = text("DELETE FROM outbox.console_sessions WHERE id = :session_id")


def end_session(executor: Executor, session_id: UUID) -> None:
    """End one session (no row: nothing to do)."""
    executor.execute(_END_SESSION, {"session_id": session_id})


_END_SESSIONS = text(
    """
    WITH ended AS (
        DELETE FROM outbox.console_sessions AS s USING outbox.operators AS o
        WHERE s.operator_id = o.id AND o.name = :name
        RETURNING s.id
    )
    SELECT count(*) FROM ended
    """
)


def end_sessions(executor: Executor, name: str) -> int:
    """End every session of the account ``name``: how many there were."""
    ended: int = executor.execute(_END_SESSIONS, {"name": name}).scalar_one()
    return ended
