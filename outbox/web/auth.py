"""Bearer tokens on every ``/v1`` request: who calls, and what its scope lets it do.

The credentials are checked before anything else of the request is read: every ``/v1`` route
is a :class:`CallerRoute` (an :class:`OperatorRoute` where only an operator may call), whose
handler authenticates the caller before FastAPI parses or validates the body, the query, the
path or the headers. So a request without a live token is a 401 (an agent token on an
operator's route a 403) whatever else is wrong with it, and nothing of an unauthenticated
request is parsed. The token is looked up in the :class:`TokenCache` (no round trip), else in
a short transaction of its own on the sync pool the enqueue uses (which also refreshes its
``last_used_at``), before the handler's own transaction: a revoked token is refused within
``OUTBOX_API_TOKEN_CACHE`` seconds, from its next request on with 0. The handler then gets the
caller as a parameter (:data:`Caller`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, ClassVar

from fastapi import Depends, Request, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine
from starlette.concurrency import run_in_threadpool

from outbox import tokens
from outbox.models import ApiToken, Operation, TokenScope
from outbox.web.context import context
from outbox.web.problems import Problem

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="outbox"'}

#: Where a request's authenticated token waits for its handler (the request's state).
_AUTHENTICATED = "authenticated"

_bearer = HTTPBearer(
    auto_error=False,
    scheme_name="token",
    description="`outbox tokens create NAME --scope agent|operator` prints one.",
)


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


class CallerRoute(APIRoute):
    """A ``/v1`` route whose caller is authenticated first, before FastAPI reads the
    request's parameters and body: 401 without a live bearer token, 403 for an agent's on an
    :class:`OperatorRoute`, whatever the rest of the request holds."""

    #: Only an operator token may call it.
    operator_only: ClassVar[bool] = False

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        """FastAPI's handler (parameters, body, dependencies, the endpoint), after the
        credentials are checked."""
        answer = super().get_route_handler()
        operator_only = self.operator_only

        async def authenticated_first(request: Request) -> Response:
            await authenticate(request, operator_only=operator_only)
            return await answer(request)

        return authenticated_first


class OperatorRoute(CallerRoute):
    """A ``/v1`` route only an operator token may call (decisions): an agent's gets 403."""

    operator_only = True


async def authenticate(request: Request, *, operator_only: bool = False) -> ApiToken:
    """The live token of the request's bearer credentials (from the cache, else from the
    database in a transaction of its own: :func:`_look_up`), kept for its handler
    (:data:`Caller`), its name for the access log; 401 if there is none or it is unknown or
    revoked, 403 when ``operator_only`` and it is an agent's."""
    credentials = await _bearer(request)
    if credentials is None or not credentials.credentials:
        raise Problem(
            401,
            "this API needs a bearer token: Authorization: Bearer <token> "
            "(`outbox tokens create NAME --scope agent`)",
            slug="unauthenticated",
            headers=_CHALLENGE,
        )
    token = credentials.credentials
    cache: TokenCache = request.app.state.tokens
    digest = tokens.hash_token(token)
    caller = cache.get(digest)
    if caller is None:
        caller = await run_in_threadpool(_look_up, context(request).sync_engine, token)
        if caller is not None:
            cache.put(digest, caller)
    return _allowed(request, caller, operator_only=operator_only)


def _look_up(engine: Engine, token: str) -> ApiToken | None:
    """The live token ``token`` is, in a transaction of its own on the enqueue's pool (sync,
    in a worker thread: the connections an agent's enqueue uses next, as before)."""
    with engine.begin() as conn:
        return tokens.authenticate(conn, token)


async def current_caller(
    request: Request,
    # Not read: declares the bearer scheme on every route in the OpenAPI document.
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> ApiToken:
    """The token its :class:`CallerRoute` authenticated for this request."""
    caller = request.scope.get("state", {}).get(_AUTHENTICATED)
    if not isinstance(caller, ApiToken):
        # A programming error, not a request's: the route must be a CallerRoute.
        raise TypeError(f"{request.url.path} is not served by a CallerRoute")
    return caller


#: The authenticated caller, as a handler's parameter.
Caller = Annotated[ApiToken, Depends(current_caller)]


def _allowed(request: Request, caller: ApiToken | None, *, operator_only: bool) -> ApiToken:
    if caller is None:
        raise Problem(
            401,
            "the bearer token is unknown or revoked",
            slug="unauthenticated",
            headers=_CHALLENGE,
        )
    state = request.scope.setdefault("state", {})
    state["caller"] = caller.name
    if operator_only and caller.scope is not TokenScope.OPERATOR:
        raise Problem(
            403,
            f"token {caller.name!r} has the agent scope; this needs an operator token",
            slug="forbidden",
            scope=caller.scope.value,
        )
    state[_AUTHENTICATED] = caller
    return caller


def may_read(caller: ApiToken, operation: Operation) -> bool:
    """An operator reads every operation; an agent only its own agent's (any of its tokens')."""
    return caller.scope is TokenScope.OPERATOR or operation.agent == caller.agent
