"""Bearer tokens of the HTTP API: made, listed and revoked by ``outbox tokens``, checked on
every request by :mod:`outbox.web`.

A token is ``obx_`` and 256 random bits (``secrets``), shown once when it is made; the
database keeps only its sha256. A token has a name, which is the identity the API records
(``requested_by`` of what it enqueues, the decider of what it approves or resolves: no
free-text identity through the API), and a scope (:class:`~outbox.models.TokenScope`).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

from outbox import sql
from outbox.errors import TokenNotFound, TokenRefused
from outbox.models import ApiToken, Executor, TokenScope, iso_utc

__all__ = [
    "NAME_PATTERN",
    "NewToken",
    "authenticate",
    "create_token",
    "hash_token",
    "list_tokens",
    "revoke_token",
]

#: A token's name: recorded as ``requested_by`` and in audit trails, so one readable word.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
#: Marks our tokens, so secret scanners and people can tell one in a log or a repository.
PREFIX = "obx_"
#: Random bytes per token: 256 bits, beyond guessing (hence a fast hash suffices).
TOKEN_BYTES = 32
#: ``last_used_at`` is refreshed at most this often, so a busy token costs no write per request.
TOUCH_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class NewToken:
    """A token just made: the secret itself (shown once, never stored) and its row."""

    token: str
    info: ApiToken


def hash_token(token: str) -> str:
    """The sha256 (hex) the database keeps of ``token``.

    Not argon2 or bcrypt: those slow a guesser down, which matters for a person's password
    (a small space to search); a token is 256 random bits, which no guesser can search at
    any speed, and a fast hash lets every request find its token with one index probe.
    """
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(
    session: Executor, *, name: str, scope: TokenScope | str, agent: str | None = None
) -> NewToken:
    """Make a token named ``name`` with ``scope``, in the caller's transaction (no commit).

    ``agent`` (default: ``name``) is the agent the token speaks for: the scope of its intent
    keys and what it may read. Another token made for the same agent (a rotation: make the
    new one, move the agent to it, revoke the old one) finds the same operations under the
    same keys. Returns the token itself, which is not stored and cannot be shown again.
    Raises :class:`TokenRefused` (``field``) for a malformed name, agent or scope, or a name
    that a token (even a revoked one) has: a name in an audit trail names one token's
    holder, for good.
    """
    for value, field in ((name, "name"), (agent if agent is not None else name, "agent")):
        if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
            raise TokenRefused(
                f"token {field} {value!r} must be 1 to 128 letters, digits, '.', '_', '@' or "
                "'-', starting with a letter or a digit",
                field=field,
            )
    try:
        checked = TokenScope(scope)
    except ValueError:
        raise TokenRefused(
            f"scope {scope!r} is not one of {', '.join(s.value for s in TokenScope)}",
            field="scope",
        ) from None
    token = PREFIX + secrets.token_urlsafe(TOKEN_BYTES)
    made = sql.tokens.insert_token(
        session,
        name=name,
        scope=checked.value,
        agent=agent if agent is not None else name,
        token_hash=hash_token(token),
    )
    if made is None:
        taken = sql.tokens.get_token(session, name)
        when = f" (created {iso_utc(taken.created_at)})" if taken is not None else ""
        raise TokenRefused(
            f"a token named {name!r} exists already{when}; names are never reused, since "
            "audit trails record them: choose another name",
            field="name",
        )
    return NewToken(token=token, info=made)


def list_tokens(session: Executor) -> list[ApiToken]:
    """Every token, revoked ones too, by name (never a hash). Reads in the caller's txn."""
    return sql.tokens.list_tokens(session)


def revoke_token(session: Executor, name: str) -> ApiToken:
    """Revoke the token named ``name``, in the caller's transaction (no commit): refused at
    its next request. Revoking it again changes nothing. Raises :class:`TokenNotFound`."""
    revoked = sql.tokens.revoke_token(session, name)
    if revoked is None:
        raise TokenNotFound(f"no API token named {name!r} (`outbox tokens list`)", name=name)
    return revoked


def authenticate(session: Executor, token: str) -> ApiToken | None:
    """The live token ``token`` is, or ``None`` (unknown, malformed or revoked).

    Joins the caller's transaction: it refreshes the token's ``last_used_at`` at most once
    every :data:`TOUCH_EVERY_S` seconds, committed with the caller's transaction.
    """
    if not token.startswith(PREFIX) or len(token) > 128:
        return None  # not one of ours: no need to ask the database
    return sql.tokens.authenticate(
        session, token_hash=hash_token(token), touch_every_s=TOUCH_EVERY_S
    )
