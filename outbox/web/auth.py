"""Bearer tokens on every ``/v1`` request: who calls, and what its scope lets it do.

The credentials are read before anything else (no token: 401 before the body is even
parsed); the token is checked in the request's own transaction (:func:`authorize`), so a
request costs one connection, and a revoked token is refused from its next request on.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox import tokens
from outbox.models import ApiToken, Operation, TokenScope
from outbox.web.problems import Problem

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="outbox"'}

_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="token",
    description="`outbox tokens create NAME --scope agent|operator` prints one.",
)


async def bearer_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The request's bearer token; 401 without one (the token itself is checked later)."""
    if credentials is None or not credentials.credentials:
        raise Problem(
            401,
            "this API needs a bearer token: Authorization: Bearer <token> "
            "(`outbox tokens create NAME --scope agent`)",
            slug="unauthenticated",
            headers=_CHALLENGE,
        )
    return credentials.credentials


Token = Annotated[str, Depends(bearer_token)]


class TokenCache:
    """Tokens checked lately, by their hash, each trusted for ``ttl_s`` seconds: an agent's
    request then costs no round trip for its token (the enqueue's own are the floor of its
    latency), and a revoked token is refused within ``ttl_s`` (OUTBOX_API_TOKEN_CACHE).
    Only live tokens are kept; an unknown token is looked up every time."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._found: dict[str, tuple[ApiToken, float]] = {}

    def get(self, digest: str) -> ApiToken | None:
        """The token with this hash, if it was found live less than ``ttl_s`` ago."""
        found = self._found.get(digest)
        if found is None:
            return None
        if time.monotonic() >= found[1]:
            del self._found[digest]
            return None
        return found[0]

    def put(self, digest: str, token: ApiToken) -> None:
        """Remember a token just found live (nothing when the cache is off)."""
        if self.ttl_s > 0:
            self._found[digest] = (token, time.monotonic() + self.ttl_s)


def authorize_sync(
    conn: Connection, request: Request, token: str, *, operator_only: bool = False
) -> ApiToken:
    """:func:`authorize` on a sync connection (in a worker thread)."""
    cache: TokenCache = request.app.state.tokens
    digest = tokens.hash_token(token)
    caller = cache.get(digest)
    if caller is None:
        caller = tokens.authenticate(conn, token)
        if caller is not None:
            cache.put(digest, caller)
    return _allowed(request, caller, operator_only=operator_only)


async def authorize(
    conn: AsyncConnection, request: Request, token: str, *, operator_only: bool = False
) -> ApiToken:
    """The live token ``token`` is (from the cache, else in ``conn``'s transaction); 401 if
    none, 403 when ``operator_only`` and it is an agent's. Its name goes to the access log."""
    cache: TokenCache = request.app.state.tokens
    digest = tokens.hash_token(token)
    caller = cache.get(digest)
    if caller is None:
        caller = await conn.run_sync(lambda sync: tokens.authenticate(sync, token))
        if caller is not None:
            cache.put(digest, caller)
    return _allowed(request, caller, operator_only=operator_only)


def _allowed(request: Request, caller: ApiToken | None, *, operator_only: bool) -> ApiToken:
    if caller is None:
        raise Problem(
            401,
            "the bearer token is unknown or revoked",
            slug="unauthenticated",
            headers=_CHALLENGE,
        )
    request.scope.setdefault("state", {})["caller"] = caller.name
    if operator_only and caller.scope is not TokenScope.OPERATOR:
        raise Problem(
            403,
            f"token {caller.name!r} has the agent scope; this needs an operator token",
            slug="forbidden",
            scope=caller.scope.value,
        )
    return caller


def may_read(caller: ApiToken, operation: Operation) -> bool:
    """An operator reads every operation; an agent only its own agent's (any of its tokens')."""
    return caller.scope is TokenScope.OPERATOR or operation.agent == caller.agent
