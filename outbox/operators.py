"""Operator accounts of the console: added, listed and removed by ``outbox operators``,
checked at each sign-in by :mod:`outbox.web.console`.

An account has a name, which is the identity the console records as the decider of what its
operator approves, rejects or resolves (no free-text identity), and a password, kept only as
its argon2id hash (argon2-cffi's defaults: RFC 9106's low-memory profile). A removed account
cannot sign in; its name stays taken, since audit trails name it.
"""

from __future__ import annotations

import contextlib
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any
from uuid import UUID

from outbox import sql
from outbox.errors import OperatorNotFound, OperatorRefused
from outbox.models import Executor, iso_utc, json_fields
from outbox.tokens import NAME_PATTERN

if TYPE_CHECKING:
    from argon2 import PasswordHasher

__all__ = [
    "MIN_PASSWORD_LENGTH",
    "SESSION_MAX_AGE_S",
    "Credentials",
    "Operator",
    "PasswordCheck",
    "add_operator",
    "authenticate",
    "check_password",
    "credentials",
    "dummy_hash",
    "end_session",
    "get_live_operator",
    "list_operators",
    "remove_operator",
    "session_operator",
    "set_password",
    "sign_out_all",
    "start_session",
    "store_new_hash",
]

#: The shortest password an account may have: the console is a door to every decision.
MIN_PASSWORD_LENGTH = 12
#: The longest: argon2 hashes any length, but a megabyte "password" is a denial of service.
MAX_PASSWORD_LENGTH = 1024


@dataclass(frozen=True, slots=True)
class Operator:
    """One operator account, never its password hash."""

    id: UUID
    #: The identity the console records as the decider; unique for good.
    name: str
    created_at: datetime
    removed_at: datetime | None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping, as ``outbox operators list --json`` prints it."""
        return json_fields(self)


def _public(row: sql.operators.OperatorRow) -> Operator:
    return Operator(id=row.id, name=row.name, created_at=row.created_at, removed_at=row.removed_at)


def _hasher() -> PasswordHasher:
    # Imported here: argon2-cffi comes with the [api] extra, and the core must import without it.
    from argon2 import PasswordHasher  # noqa: PLC0415

    return PasswordHasher()  # argon2id, RFC 9106's second recommended parameter set


def add_operator(session: Executor, *, name: str, password: str) -> Operator:
    """Add an account named ``name`` with ``password``, in the caller's transaction (no
    commit). Raises :class:`OperatorRefused` (``field``) for a malformed name, a name an
    account (even a removed one) has, or a password shorter than
    :data:`MIN_PASSWORD_LENGTH` characters."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise OperatorRefused(
            f"operator name {name!r} must be 1 to 128 letters, digits, '.', '_', '@' or '-', "
            "starting with a letter or a digit",
            field="name",
        )
    _check_password_length(password)
    made = sql.operators.insert_operator(session, name=name, password_hash=_hasher().hash(password))
    if made is None:
        taken = sql.operators.get_operator(session, name)
        when = f" (created {iso_utc(taken.created_at)})" if taken is not None else ""
        raise OperatorRefused(
            f"an operator named {name!r} exists already{when}; names are never reused, since "
            "audit trails record them: choose another name",
            field="name",
        )
    return _public(made)


def list_operators(session: Executor) -> list[Operator]:
    """Every account, removed ones too, by name (never a hash). Reads in the caller's txn."""
    return [_public(row) for row in sql.operators.list_operators(session)]


def remove_operator(session: Executor, name: str) -> Operator:
    """Remove the account named ``name``, in the caller's transaction (no commit): it cannot
    sign in any more, and its console sessions end with the commit. Removing it again
    changes nothing. Raises :class:`OperatorNotFound`."""
    removed = sql.operators.remove_operator(session, name)
    if removed is None:
        raise OperatorNotFound(f"no operator named {name!r} (`outbox operators list`)", name=name)
    sql.operators.end_sessions(session, name)
    return _public(removed)


def _check_password_length(password: str) -> None:
    if not MIN_PASSWORD_LENGTH <= len(password) <= MAX_PASSWORD_LENGTH:
        raise OperatorRefused(
            f"the password must have {MIN_PASSWORD_LENGTH} to {MAX_PASSWORD_LENGTH} characters",
            field="password",
        )


def set_password(session: Executor, *, name: str, password: str) -> Operator:
    """Give the live account ``name`` a new password, in the caller's transaction (no
    commit); every console session of it ends with the commit. Raises
    :class:`OperatorNotFound` (no live account of that name) or :class:`OperatorRefused`
    (``field="password"``: too short or too long)."""
    _check_password_length(password)
    changed = sql.operators.set_password(session, name=name, password_hash=_hasher().hash(password))
    if changed is None:
        raise OperatorNotFound(
            f"no live operator named {name!r} (`outbox operators list`)", name=name
        )
    sql.operators.end_sessions(session, name)
    return _public(changed)


def sign_out_all(session: Executor, name: str) -> int:
    """End every console session of the account ``name`` (removed or not), in the caller's
    transaction (no commit): how many there were. Raises :class:`OperatorNotFound`."""
    if sql.operators.get_operator(session, name) is None:
        raise OperatorNotFound(f"no operator named {name!r} (`outbox operators list`)", name=name)
    return sql.operators.end_sessions(session, name)


#: A console session lasts this long after sign-in, at most (then sign in again).
SESSION_MAX_AGE_S = 8 * 3600


def start_session(session: Executor, name: str) -> UUID | None:
    """A new console session of the live account ``name``, in the caller's transaction (no
    commit): its id, for the session cookie; ``None`` when the account is gone."""
    return sql.operators.start_session(session, name=name, max_age_s=SESSION_MAX_AGE_S)


def session_operator(session: Executor, session_id: UUID) -> Operator | None:
    """The live account signed in by console session ``session_id``, or ``None`` when that
    session ended (signed out, its operator signed out everywhere, changed password or was
    removed) or is older than :data:`SESSION_MAX_AGE_S`. Reads in the caller's txn."""
    row = sql.operators.session_operator(
        session, session_id=session_id, max_age_s=SESSION_MAX_AGE_S
    )
    return _public(row) if row is not None else None


def end_session(session: Executor, session_id: UUID) -> None:
    """End one console session (sign-out), in the caller's transaction (no commit)."""
    sql.operators.end_session(session, session_id)


@dataclass(frozen=True, slots=True)
class Credentials:
    """A live account and its stored hash, read to check a password against
    (:func:`check_password`); never shown or logged."""

    operator: Operator
    password_hash: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class PasswordCheck:
    """What :func:`check_password` found: the account if the password is right, and a new
    hash to store when argon2's parameters have been raised since the old one was made."""

    operator: Operator | None
    new_hash: str | None = field(default=None, repr=False)


def credentials(session: Executor, name: str) -> Credentials | None:
    """The live account ``name`` with its hash, or ``None`` (unknown, removed, malformed)."""
    row = sql.operators.get_operator(session, name) if NAME_PATTERN.fullmatch(name) else None
    if row is None or row.removed_at is not None:
        return None
    return Credentials(operator=_public(row), password_hash=row.password_hash)


_DUMMY_HASH: list[str] = []


def dummy_hash() -> str:
    """A hash of a random password, made once per process with the accounts' parameters: an
    unknown name's password is verified against it, at an account's cost."""
    if not _DUMMY_HASH:
        _DUMMY_HASH.append(_hasher().hash(secrets.token_urlsafe(24)))
    return _DUMMY_HASH[0]


def check_password(found: Credentials | None, password: str) -> PasswordCheck:
    """Check ``password`` against ``found`` (from :func:`credentials`): argon2id, about a
    tenth of a second of CPU and no database, so async code runs it in a thread.

    Without an account it verifies against :func:`dummy_hash`, so an unknown name costs what
    a wrong password does and a guesser cannot tell them apart.
    """
    from argon2.exceptions import InvalidHashError, VerificationError  # noqa: PLC0415

    hasher = _hasher()
    if found is None or len(password) > MAX_PASSWORD_LENGTH:
        with contextlib.suppress(VerificationError, InvalidHashError):
            hasher.verify(dummy_hash(), password[:MAX_PASSWORD_LENGTH])
        return PasswordCheck(operator=None)
    try:
        hasher.verify(found.password_hash, password)
    except (VerificationError, InvalidHashError):
        return PasswordCheck(operator=None)
    renewed = hasher.hash(password) if hasher.check_needs_rehash(found.password_hash) else None
    return PasswordCheck(operator=found.operator, new_hash=renewed)


def store_new_hash(session: Executor, check: PasswordCheck) -> None:
    """Store the new hash a right password was re-hashed with, if any, in the caller's
    transaction (no commit)."""
    if check.operator is not None and check.new_hash is not None:
        sql.operators.rehash_operator(
            session, name=check.operator.name, password_hash=check.new_hash
        )


def authenticate(session: Executor, name: str, password: str) -> Operator | None:
    """The live account ``name`` if ``password`` is its password, else ``None`` (unknown,
    removed, or a wrong password: the caller cannot tell which, nor can a guesser).

    Joins the caller's transaction (a renewed hash is stored with its commit). Hashing
    holds the CPU: async code reads :func:`credentials`, runs :func:`check_password` in a
    thread, and :func:`store_new_hash`, as the console does.
    """
    check = check_password(credentials(session, name), password)
    store_new_hash(session, check)
    return check.operator


def get_live_operator(session: Executor, name: str) -> Operator | None:
    """The account ``name`` if it exists and is not removed (a session's check on each
    request), else ``None``."""
    row = sql.operators.get_operator(session, name)
    return _public(row) if row is not None and row.removed_at is None else None
