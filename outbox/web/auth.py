"""Bearer tokens on every ``/v1`` request: who calls, and what its scope lets it do.

The credentials are read before anything else (no token: 401 before the body is even
parsed); the token is checked in the request's own transaction (:func:`authorize`), so a
request costs one connection, and a revoked token is refused from its next request on.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
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


async def authorize(
    conn: AsyncConnection, request: Request, token: str, *, operator_only: bool = False
) -> ApiToken:
    """The live token ``token`` is, in ``conn``'s transaction; 401 if none, 403 when
    ``operator_only`` and it is an agent's. Its name is kept for the access log."""
    caller = await conn.run_sync(lambda sync: tokens.authenticate(sync, token))
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
    """An operator reads every operation; an agent only those it enqueued (requested_by)."""
    return caller.scope is TokenScope.OPERATOR or operation.requested_by == caller.name
