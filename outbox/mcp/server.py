"""The MCP server: the loaded tools, two reading tools, sagas (``outbox_saga``,
``outbox_saga_status``), operations as resources; on stdio or streamable HTTP.

Built on the MCP SDK's low-level ``Server`` (each tool's input schema is the outbox's own,
not one derived from a Python signature). The caller is the bearer token's name over HTTP,
``OUTBOX_MCP_AGENT`` over stdio: ``requested_by`` of what it enqueues, and the only
operations it can read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import mcp_types as types
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.settings import AuthSettings
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from outbox import __version__, trace_context
from outbox.contracts import ContractTable
from outbox.mcp.auth import (
    REQUIRED_SCOPE,
    AgentAccessToken,
    Caller,
    ReadableRefusals,
    TokenCheck,
)
from outbox.mcp.calls import Calls, report_of
from outbox.mcp.sagas import (
    SAGA_STATUS_TOOL,
    SAGA_TOOL,
    SagaCalls,
    saga_status_tool,
    saga_tool,
)
from outbox.mcp.tools import (
    LIST_TOOL,
    OWN_TOOLS,
    STATUS_TOOL,
    list_tool,
    mcp_names,
    registered_tool,
    status_tool,
)

#: The resource template of one operation.
OPERATION_URI = "outbox://operations/{id}"
_OPERATION_URI = re.compile(r"outbox://operations/(?P<id>[^/?#]+)")
#: The path the streamable HTTP endpoint is served at.
MCP_PATH = "/mcp"
#: JSON-RPC's "invalid params", which MCP uses for an unknown tool or resource.
_INVALID_PARAMS = -32602

INSTRUCTIONS = """\
Each tool here is a consequential action (a release, a charge, an email) run through an \
outbox: it is recorded before it is sent and sent at most once per intent_key. Give every \
call an intent_key that names the action and stays the same when you retry it (e.g. your \
conversation id and the step), never a fresh random one. If an answer is not settled (in \
progress, outcome unknown, waiting for a person or an approval), do not call the tool again \
with a new intent_key: check with outbox_status instead."""


@dataclass(frozen=True)
class McpContext:
    """What one server needs: its database, the tools it serves, how long a call waits,
    and who calls when no token says so (stdio)."""

    engine: AsyncEngine
    #: The loaded tools' contracts (the registry's core table).
    contracts: ContractTable
    #: Seconds a tool call waits for the outcome (OUTBOX_MCP_WAIT_S).
    wait_s: float
    #: ``requested_by`` without a bearer token (OUTBOX_MCP_AGENT): the stdio transport.
    agent: str


def create_server(context: McpContext) -> Server[Any]:
    """The MCP server over ``context``: every loaded tool, ``outbox_status``,
    ``outbox_list``, ``outbox_saga``, ``outbox_saga_status`` and the
    ``outbox://operations/{id}`` resources."""
    calls = Calls(engine=context.engine, wait_s=context.wait_s)
    registered = context.contracts.names()
    # A step names its tool by its registered name or by its MCP name.
    step_tools = {name: name for name in registered} | mcp_names(registered)
    saga_calls = SagaCalls(engine=context.engine, wait_s=context.wait_s, tools=step_tools)

    def caller() -> Caller:
        token = get_access_token()
        if token is None:  # stdio: the one agent this process serves
            return Caller(name=context.agent, agent=context.agent)
        agent = token.agent if isinstance(token, AgentAccessToken) else token.client_id
        return Caller(name=token.client_id, agent=agent)

    async def list_tools(
        _ctx: ServerRequestContext[Any], _params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        tools = [
            registered_tool(contract, mcp_name)
            for mcp_name, name in mcp_names(context.contracts.names()).items()
            if (contract := context.contracts.get(name)) is not None
        ]
        own = [status_tool(), list_tool(), saga_tool(sorted(registered)), saga_status_tool()]
        return types.ListToolsResult(tools=[*tools, *own])

    async def call_tool(
        _ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        # The client's W3C trace context, when it sends one in the request's _meta (as
        # OpenTelemetry's MCP instrumentation does), recorded with the operation. With tracing
        # on, the MCP SDK's own middleware has made this call a SERVER span, child of that
        # context and current here: the enqueue span's parent (trace_context.current).
        meta = params.meta or {}
        trace = trace_context.parse(_text(meta.get("traceparent")), _text(meta.get("tracestate")))
        with trace_context.passed(trace):
            return await handle_call(params)

    async def handle_call(params: types.CallToolRequestParams) -> types.CallToolResult:
        if params.name == STATUS_TOOL:
            return await calls.status(params.arguments, caller())
        if params.name == LIST_TOOL:
            return await calls.list_own(params.arguments, caller())
        if params.name == SAGA_TOOL:
            return await saga_calls.declare(params.arguments, caller())
        if params.name == SAGA_STATUS_TOOL:
            return await saga_calls.status(params.arguments, caller())
        names = mcp_names(context.contracts.names())
        # Its MCP name, or (a client that knows the registry) the registered name itself.
        tool = names.get(params.name)
        if tool is None and context.contracts.get(params.name) is not None:
            tool = params.name
        if tool is None:
            known = ", ".join([*names, *OWN_TOOLS])
            raise MCPError(_INVALID_PARAMS, f"unknown tool {params.name!r}; tools: {known}")
        return await calls.call_registered(tool, params.arguments, caller())

    async def list_templates(
        _ctx: ServerRequestContext[Any], _params: types.PaginatedRequestParams | None
    ) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(
            resource_templates=[
                types.ResourceTemplate(
                    name="operation",
                    title="An operation of yours",
                    uri_template=OPERATION_URI,
                    description="One of your actions: its outcome, remote reference and state.",
                    mime_type="application/json",
                )
            ]
        )

    async def list_resources(
        _ctx: ServerRequestContext[Any], _params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        latest = await calls.own_operations(caller(), limit=50)
        return types.ListResourcesResult(
            resources=[
                types.Resource(
                    name=str(op.id),
                    title=f"{op.tool} on {op.target} ({op.state.value})",
                    uri=OPERATION_URI.format(id=op.id),
                    mime_type="application/json",
                )
                for op in latest
            ]
        )

    async def read_resource(
        _ctx: ServerRequestContext[Any], params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        uri = str(params.uri)
        found = _OPERATION_URI.fullmatch(uri)
        op = await calls.own_operation(found.group("id"), caller()) if found else None
        if op is None:
            raise MCPError(_INVALID_PARAMS, f"no operation of yours at {uri}")
        return types.ReadResourceResult(
            contents=[
                types.TextResourceContents(
                    uri=uri,
                    mime_type="application/json",
                    text=json.dumps(report_of(op).to_dict()),
                )
            ]
        )

    return Server(
        "agent-outbox",
        version=__version__,
        title="agent-outbox",
        description="Consequential actions, each done at most once per intent key.",
        instructions=INSTRUCTIONS,
        on_list_tools=list_tools,
        on_call_tool=call_tool,
        on_list_resources=list_resources,
        on_list_resource_templates=list_templates,
        on_read_resource=read_resource,
    )


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


async def serve_stdio(context: McpContext) -> None:
    """Serve one client on this process's stdin and stdout until it closes them."""
    server = create_server(context)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


def http_app(context: McpContext, *, host: str, behind_proxy: bool = False) -> Starlette:
    """The streamable HTTP app: MCP at ``/mcp`` behind bearer tokens of the ``agent`` scope
    (401 without a live one, 403 for an operator's, each with a JSON-RPC error the SDK's
    client raises: :class:`~outbox.mcp.auth.ReadableRefusals`), and ``/healthz``.

    ``host`` is the address it binds: on a loopback one the SDK also refuses requests whose
    ``Host`` or ``Origin`` is not local (DNS rebinding), unless ``behind_proxy``: a reverse
    proxy on this host forwards the public name, and is where such checks belong.
    """

    async def healthz(_request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = create_server(context).streamable_http_app(
        streamable_http_path=MCP_PATH,
        host=host,
        transport_security=(
            TransportSecuritySettings(enable_dns_rebinding_protection=False)
            if behind_proxy
            else None  # the SDK's default: protected on a loopback address
        ),
        # No authorization server: the tokens are ours (`outbox tokens create`), so no
        # OAuth metadata is served; the issuer URL is a required field that nothing reads.
        auth=AuthSettings(
            issuer_url="http://127.0.0.1/",  # type: ignore[arg-type]  # pydantic parses it
            resource_server_url=None,
            required_scopes=[REQUIRED_SCOPE],
        ),
        token_verifier=TokenCheck(context.engine),
        custom_starlette_routes=[Route("/healthz", healthz)],
    )
    for route in app.routes:
        if isinstance(route, Route) and route.path == MCP_PATH:
            route.app = ReadableRefusals(route.app)  # the SDK's auth middleware, wrapped
    return app
