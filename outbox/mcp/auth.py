"""Bearer tokens on ``outbox mcp --http``: the HTTP API's tokens (``outbox tokens create NAME
--scope agent``), checked by the MCP SDK's bearer middleware through :class:`TokenCheck`.

A request without a live token is refused with 401 before the MCP session sees it; an
operator's token with 403 (the MCP server is for agents). The token's name is the caller,
``requested_by`` of what it enqueues; its agent owns the intent keys and the only operations
it can read. Both refusals carry a JSON-RPC error as their body (:class:`ReadableRefusals`),
which the SDK's client raises with its message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mcp.server.auth.provider import AccessToken
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox import tokens
from outbox.models import TokenScope

#: The scope a token needs (``AccessToken.scopes`` carries the token's own).
REQUIRED_SCOPE = TokenScope.AGENT.value


@dataclass(frozen=True, slots=True)
class Caller:
    """Who calls: the name recorded as ``requested_by`` (a token's, or ``OUTBOX_MCP_AGENT``
    over stdio), and the agent whose intent keys and operations are its own (the token's
    agent: every token of one agent shares them)."""

    name: str
    agent: str


class AgentAccessToken(AccessToken):
    """The SDK's access token, with the agent the token speaks for."""

    agent: str


class TokenCheck:
    """An MCP ``TokenVerifier`` over ``outbox.api_tokens``: one indexed read per request
    (committed: it refreshes the token's ``last_used_at`` now and then)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def verify_token(self, token: str) -> AccessToken | None:
        """The live token ``token`` is, as the SDK's access token; ``None`` if none."""
        async with self.engine.begin() as conn:
            found = await conn.run_sync(lambda sync: tokens.authenticate(sync, token))
        if found is None:
            return None
        # The secret is not kept on the request: the SDK compares the principal (the name).
        return AgentAccessToken(
            token="-",  # noqa: S106 -- a placeholder, not a secret
            client_id=found.name,
            scopes=[found.scope.value],
            agent=found.agent,
        )


#: The JSON-RPC error code of a refused token (the implementation-defined server errors are
#: -32000 to -32099; MCP names none for authentication).
REFUSED_CODE = -32001

#: Where a token comes from (named in every refusal).
TOKEN_HINT = "an agent's token from `outbox tokens create NAME --scope agent`"  # noqa: S105 -- advice, not a secret


def _refusal_message(status: int, *, token_given: bool) -> str:
    if status == 403:  # the SDK's answer to a token without the scope
        return (
            "Forbidden (403): this token is not an agent's (an operator's decides in the "
            f"console, the CLI or the HTTP API); outbox mcp takes {TOKEN_HINT}"
        )
    why = "the bearer token is unknown or revoked" if token_given else "no bearer token was sent"
    return f"Unauthorized (401): {why}; send `Authorization: Bearer obx_...` with {TOKEN_HINT}"


class ReadableRefusals:
    """The MCP endpoint with its 401 and 403 answers readable by an MCP client: the SDK's
    bearer middleware answers them with ``WWW-Authenticate: Bearer error=...`` (kept) and an
    OAuth error body (``{"error": "invalid_token", ...}``), which the SDK's client reports as
    only "Server returned an error response"; this body is a JSON-RPC error instead (code
    :data:`REFUSED_CODE`, the OAuth fields and the status in its ``data``), which the client
    raises as an ``MCPError`` carrying the message (``docs/mcp.md``).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve ``scope``, rewriting the body of a 401 or 403 answer."""
        token_given = "authorization" in Headers(scope=scope)
        refused: list[Message] = []

        async def send_readable(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] in {401, 403}:
                refused.append(message)
                return
            if not refused:
                await send(message)
                return
            refused.append(message)
            if message.get("more_body", False):
                return
            start, *parts = refused
            oauth = b"".join(part.get("body", b"") for part in parts)
            body = _json_rpc_error(start["status"], oauth, token_given=token_given)
            headers = [
                (name, value)
                for name, value in start["headers"]
                if name.lower() not in {b"content-length", b"content-type"}
            ]
            headers += [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ]
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, send_readable)


def _json_rpc_error(status: int, oauth: bytes, *, token_given: bool) -> bytes:
    """A JSON-RPC error answering no request in particular (``id`` null: the request was
    not read), the OAuth error the SDK wrote in its ``data``."""
    try:
        fields = json.loads(oauth) if oauth else {}
    except ValueError:
        fields = {}
    data = {"status": status, **(fields if isinstance(fields, dict) else {})}
    error = {
        "code": REFUSED_CODE,
        "message": _refusal_message(status, token_given=token_given),
        "data": data,
    }
    return json.dumps({"jsonrpc": "2.0", "id": None, "error": error}).encode()
