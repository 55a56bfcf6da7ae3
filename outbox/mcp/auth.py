"""Bearer tokens on ``outbox mcp --http``: the HTTP API's tokens (``outbox tokens create NAME
--scope agent``), checked by the MCP SDK's bearer middleware through :class:`TokenCheck`.

A request without a live token is refused with 401 before the MCP session sees it; an
operator's token with 403 (the MCP server is for agents). The token's name is the caller,
``requested_by`` of what it enqueues; its agent owns the intent keys and the only operations
it can read.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcp.server.auth.provider import AccessToken
from sqlalchemy.ext.asyncio import AsyncEngine

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
