"""``outbox mcp``: the registered tools as MCP tools, for agents that call tools through MCP.

Every tool of the loaded registry becomes an MCP tool whose arguments are the intent
(``intent_key``, ``target``, ``payload``); a call records the intent in its own committed
transaction, waits a while for the outcome and answers :func:`outbox.reports.describe`'s
report, in words and as structured content. ``outbox_status`` and ``outbox_list`` read the
caller's own operations; ``outbox://operations/{id}`` is one of them as a resource. Served
over stdio (:func:`serve_stdio`) or streamable HTTP (:func:`http_app`, bearer tokens of the
``agent`` scope). Only the CLI imports this package; it runs on the core alone
(docs/mcp.md).
"""

from outbox.mcp.server import McpContext, create_server, http_app, serve_stdio

__all__ = ["McpContext", "create_server", "http_app", "serve_stdio"]
