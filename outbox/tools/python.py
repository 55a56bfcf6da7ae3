"""Python tools: a function decorated with :func:`tool` becomes a registered :class:`Tool`.

.. code-block:: python

    @tool("billing.charge", timeout=10, send_deadline=2, inflight_horizon=600,
          dedup=Dedup(window_s=86400, margin_s=300))
    def charge(call: ToolCall) -> DispatchResult: ...

    @charge.lookup
    def find_charge(call: ToolCall) -> LookupResult: ...

The contract is validated at decoration time, so a contradictory tool fails its module's
import with a :class:`ConfigError` naming the tool and the field.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar, overload

from outbox.contracts import DedupContract, ToolContract, approval_required
from outbox.errors import ConfigError
from outbox.guards import Breaker, Concurrency, Rate
from outbox.tools.base import Tool, ToolCall, check_tool_name
from outbox.tools.registry import REGISTRY, ToolRegistry
from outbox.tools.results import DispatchResult, LookupResult

DispatchFn = Callable[[ToolCall], DispatchResult | Awaitable[DispatchResult]]
LookupFn = Callable[[ToolCall], LookupResult | Awaitable[LookupResult]]
LookupFnT = TypeVar("LookupFnT", bound=LookupFn)


class PythonTool(Tool):
    """A tool whose dispatch (and lookup) are Python functions, sync or ``async def``.

    ``tool.dispatch(call)`` and ``tool(call)`` call the function directly (no deadline);
    ``@tool.lookup`` attaches a lookup function and ``tool.lookup(call)`` calls it.
    """

    def __init__(self, contract: ToolContract, function: DispatchFn, registry: ToolRegistry):
        if not callable(function):
            raise ConfigError(f"tool {contract.name!r}: @tool decorates a function")
        self.contract = contract
        #: The dispatch function, undecorated.
        self.function = function
        #: The lookup function, once attached.
        self.lookup_function: LookupFn | None = None
        self.registry = registry
        self.__doc__ = function.__doc__
        self.__wrapped__ = function

    def dispatch(self, call: ToolCall) -> DispatchResult | Awaitable[DispatchResult]:
        """Call the dispatch function (returns a coroutine if it is ``async def``)."""
        return self.function(call)

    def __call__(self, call: ToolCall) -> DispatchResult | Awaitable[DispatchResult]:
        """Same as :meth:`dispatch`: the decorated name stays callable."""
        return self.function(call)

    @overload
    def lookup(self, call: ToolCall) -> LookupResult | Awaitable[LookupResult]: ...

    @overload
    def lookup(self, call: LookupFnT) -> LookupFnT: ...

    def lookup(
        self, call: ToolCall | LookupFnT
    ) -> LookupResult | Awaitable[LookupResult] | LookupFnT:
        """Given a :class:`ToolCall`, call the lookup; given a function, attach it.

        As a decorator (``@charge.lookup``) it returns the function unchanged and registers
        the contract again with ``has_lookup=True``. A second lookup is refused.
        """
        if isinstance(call, ToolCall):
            if self.lookup_function is None:
                raise NotImplementedError(f"tool {self.name!r} has no lookup")
            return self.lookup_function(call)
        self._attach_lookup(call)
        return call

    def _attach_lookup(self, function: LookupFn) -> None:
        if not callable(function):
            raise ConfigError(f"tool {self.name!r}: @{self.name}.lookup decorates a function")
        if self.lookup_function is not None and not _same_function(self.lookup_function, function):
            raise ConfigError(
                f"tool {self.name!r} already has a lookup ({_qualified(self.lookup_function)})"
            )
        self.lookup_function = function
        self.contract = dataclasses.replace(self.contract, has_lookup=True)
        self.registry.register(self)

    @property
    def is_async_dispatch(self) -> bool:
        """Whether the dispatch function is ``async def``."""
        return _is_async(self.function)

    @property
    def is_async_lookup(self) -> bool:
        """Whether the lookup function is ``async def``."""
        return _is_async(self.lookup_function)

    @property
    def module(self) -> str | None:
        """The module that defined the dispatch function."""
        return getattr(self.function, "__module__", None)

    @property
    def origin(self) -> str:
        """``python function module.qualname``."""
        return f"python function {_qualified(self.function)}"

    def same_definition(self, other: Tool) -> bool:
        """The same function (a module reloaded) defines the same tool."""
        return isinstance(other, PythonTool) and _same_function(self.function, other.function)

    def __repr__(self) -> str:
        return f"<PythonTool {self.name!r} {_qualified(self.function)}>"


def tool(
    name: str,
    *,
    timeout: float = ToolContract.timeout_s,
    send_deadline: float = ToolContract.send_deadline_s,
    inflight_horizon: float = ToolContract.inflight_horizon_s,
    max_checks: int = ToolContract.max_checks,
    max_attempts: int = ToolContract.max_attempts,
    dedup: DedupContract | None = None,
    approval: str = "none",
    approval_ttl_s: float = ToolContract.approval_ttl_s,
    input_schema: Mapping[str, Any] | None = None,
    description: str | None = None,
    breaker: Breaker | None = None,
    rate: Rate | None = None,
    concurrency: Concurrency | None = None,
    registry: ToolRegistry | None = None,
) -> Callable[[DispatchFn], PythonTool]:
    """Register the decorated function as the dispatch of tool ``name``.

    The keywords are the :class:`ToolContract` fields (seconds, without the ``_s``):
    ``timeout`` is the total deadline of one call, ``send_deadline`` the longest wait from the
    ``sent`` commit to the first byte, ``inflight_horizon`` the time after which a request can
    no longer land, ``max_checks`` the inconclusive lookups before falling back to ``dedup``
    or a human, ``max_attempts`` the sends before a human. ``dedup`` states the remote's
    deduplication contract, if any. ``approval="required"`` makes every operation of the tool
    wait in ``awaiting_approval`` for a person (``outbox ops approve``) before any send, for
    at most ``approval_ttl_s`` seconds (then it is cancelled). ``input_schema`` is the JSON
    Schema every payload must match (checked at enqueue where the tool is known; shown to
    models as the payload's parameters). ``description`` tells models what the action does
    (default: the function's docstring). ``breaker``, ``rate`` and ``concurrency`` are the
    tool's guards (:mod:`outbox.guards`, docs/guards.md). The function receives a
    :class:`ToolCall`, sends one request with ``call.operation_id`` as idempotency key, and
    returns a :data:`DispatchResult`; it may be ``async def``.

    Raises :class:`ConfigError` at decoration time for an invalid name, contradictory
    values (naming the field), or a name another definition already holds.
    """
    contract = ToolContract(
        name=check_tool_name(name),
        timeout_s=timeout,
        send_deadline_s=send_deadline,
        inflight_horizon_s=inflight_horizon,
        max_checks=max_checks,
        max_attempts=max_attempts,
        dedup=dedup,
        approval_required=approval_required(approval, name),
        approval_ttl_s=approval_ttl_s,
        input_schema=input_schema,
        description=description,
        breaker=breaker,
        rate=rate,
        concurrency=concurrency,
    )
    target = registry if registry is not None else REGISTRY

    def decorate(function: DispatchFn) -> PythonTool:
        described = contract
        if description is None and inspect.getdoc(function):
            described = dataclasses.replace(contract, description=inspect.getdoc(function))
        python_tool = PythonTool(described, function, target)
        target.register(python_tool)
        return python_tool

    return decorate


def _is_async(function: object) -> bool:
    # A callable object with an `async def __call__` is async too (inspect says no in 3.11).
    call_method = inspect.getattr_static(type(function), "__call__", None)
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call_method)


def _qualified(function: object) -> str:
    module = getattr(function, "__module__", None) or "?"
    qualname = getattr(function, "__qualname__", None) or repr(function)
    return f"{module}.{qualname}"


def _same_function(a: object, b: object) -> bool:
    return a is b or _qualified(a) == _qualified(b)
