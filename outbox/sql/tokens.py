"""The API tokens' statements: make, list, revoke, and find the live token of a request."""

from __future__ import annotations

from sqlalchemy import text

from outbox.models import ApiToken, Executor

# Every statement returns every column but the hash: it is only ever compared in a WHERE.
_INSERT_TOKEN = text(
    """
    INSERT INTO outbox.api_tokens (name, scope, agent, token_hash)
    VALUES (:name, :scope, :agent, :token_hash)
    ON CONFLICT (name) DO NOTHING
    RETURNING id, name, scope, agent, created_at, last_used_at, revoked_at
    """
)


def insert_token(
    executor: Executor, *, name: str, scope: str, agent: str, token_hash: str
) -> ApiToken | None:
    """Insert a token speaking for ``agent``; ``None`` when a token (live or revoked) has this
    name already."""
    row = executor.execute(
        _INSERT_TOKEN, {"name": name, "scope": scope, "agent": agent, "token_hash": token_hash}
    ).mappings()
    found = row.one_or_none()
    return ApiToken.from_row(found) if found is not None else None


_GET_TOKEN = text(
    "SELECT id, name, scope, agent, created_at, last_used_at, revoked_at "
    "FROM outbox.api_tokens WHERE name = :name"
)


def get_token(executor: Executor, name: str) -> ApiToken | None:
    """The token named ``name`` (revoked or not), or ``None``."""
    found = executor.execute(_GET_TOKEN, {"name": name}).mappings().one_or_none()
    return ApiToken.from_row(found) if found is not None else None


_LIST_TOKENS = text(
    "SELECT id, name, scope, agent, created_at, last_used_at, revoked_at "
    "FROM outbox.api_tokens ORDER BY name"
)


def list_tokens(executor: Executor) -> list[ApiToken]:
    """Every token, revoked ones too, by name; never a hash."""
    return [ApiToken.from_row(row) for row in executor.execute(_LIST_TOKENS).mappings()]


# Revoking twice keeps the first time: the answer is the same, and the trail is not rewritten.
_REVOKE_TOKEN = text(
    """
    UPDATE outbox.api_tokens SET revoked_at = coalesce(revoked_at, clock_timestamp())
    WHERE name = :name
    RETURNING id, name, scope, agent, created_at, last_used_at, revoked_at
    """
)


def revoke_token(executor: Executor, name: str) -> ApiToken | None:
    """Mark the token revoked (once); ``None`` when no token has this name."""
    found = executor.execute(_REVOKE_TOKEN, {"name": name}).mappings().one_or_none()
    return ApiToken.from_row(found) if found is not None else None


# One index probe on the hash; ``last_used_at`` is written only when it is older than
# :touch_every_s, so a busy token costs no write (and no row lock) on most requests.
_AUTHENTICATE = text(
    """
    WITH found AS (
        SELECT id, name, scope, agent, created_at, last_used_at, revoked_at
        FROM outbox.api_tokens WHERE token_hash = :token_hash AND revoked_at IS NULL
    ),
    touched AS (
        UPDATE outbox.api_tokens AS t SET last_used_at = clock_timestamp()
        FROM found
        WHERE t.id = found.id AND t.revoked_at IS NULL
          AND (found.last_used_at IS NULL
               OR found.last_used_at < clock_timestamp() - make_interval(secs => :touch_every_s))
    )
    SELECT id, name, scope, agent, created_at, last_used_at, revoked_at FROM found
    """
)


def authenticate(executor: Executor, *, token_hash: str, touch_every_s: float) -> ApiToken | None:
    """The live (unrevoked) token with this hash, its use recorded; ``None`` if there is none."""
    found = (
        executor.execute(_AUTHENTICATE, {"token_hash": token_hash, "touch_every_s": touch_every_s})
        .mappings()
        .one_or_none()
    )
    return ApiToken.from_row(found) if found is not None else None
