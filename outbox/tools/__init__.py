"""The tools a dispatch worker can call: Python functions and declarative HTTP tools.

.. code-block:: python

    from outbox.tools import Applied, Dedup, ToolCall, tool

    @tool("billing.charge", timeout=10, dedup=Dedup(window_s=86400))
    def charge(call: ToolCall) -> Applied: ...

Tools register their contracts in the core's table (:data:`outbox.contracts.CONTRACTS`);
:func:`load_tools` imports ``OUTBOX_TOOLS`` and reads ``OUTBOX_CONFIG``. :func:`budget`
declares a budget over some tools (docs/budgets.md), as ``[budgets."name"]`` does in the TOML.
Dispatchers and reconcilers call tools only through :func:`run_dispatch` and
:func:`run_lookup`, which enforce the total deadline and turn every surprise into a
conservative result.
"""

from outbox.budgets import Budget
from outbox.contracts import DedupContract as Dedup
from outbox.contracts import ToolContract
from outbox.guards import Breaker, Concurrency, Rate
from outbox.tools.base import Tool, ToolCall
from outbox.tools.budgets import budget
from outbox.tools.http import HttpTool, HttpToolSpec, load_http_tools
from outbox.tools.invoke import close_thread_loop, run_dispatch, run_lookup
from outbox.tools.python import PythonTool, tool
from outbox.tools.registry import REGISTRY, ToolRegistry, check_against_settings, load_tools
from outbox.tools.results import (
    Ambiguous,
    Applied,
    DispatchResult,
    FailedRemotely,
    Inconclusive,
    LookupResult,
    NotApplied,
    NotDelivered,
    Rejected,
)

__all__ = [
    "REGISTRY",
    "Ambiguous",
    "Applied",
    "Breaker",
    "Budget",
    "Concurrency",
    "Dedup",
    "DispatchResult",
    "FailedRemotely",
    "HttpTool",
    "HttpToolSpec",
    "Inconclusive",
    "LookupResult",
    "NotApplied",
    "NotDelivered",
    "PythonTool",
    "Rate",
    "Rejected",
    "Tool",
    "ToolCall",
    "ToolContract",
    "ToolRegistry",
    "budget",
    "check_against_settings",
    "close_thread_loop",
    "load_http_tools",
    "load_tools",
    "run_dispatch",
    "run_lookup",
    "tool",
]
