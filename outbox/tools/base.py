"""What every tool is: a contract, a ``dispatch`` and (if the contract says so) a ``lookup``.

A tool does one request per call: no retries inside, because only the outbox may decide that
a second request is safe (DESIGN.md, "The dispatch protocol"). Either method may be a plain
function or ``async def``; :mod:`outbox.tools.invoke` runs both kinds under the call's total
deadline and turns every surprise into a conservative result.
"""

from __future__ import annotations

import abc
import inspect
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from outbox.api import MAX_TOOL_LENGTH, TOOL_NAME
from outbox.contracts import ToolContract
from outbox.errors import ConfigError, SendDeadlinePassed
from outbox.tools.results import DispatchResult, LookupResult
from outbox.trace_context import TraceContext


@dataclass(frozen=True)
class ToolCall:
    """One call of a tool for one attempt of one operation."""

    #: The outbox operation's id: the idempotency key the remote sees.
    operation_id: str
    #: The agent's name for the intended effect (the operation id unless the agent chose one).
    intent_key: str
    #: The registered tool name.
    tool: str
    #: What the tool acts on (a project, a customer…), as the agent gave it.
    target: str
    #: The operation's payload, as enqueued; the same on every attempt.
    payload: dict[str, Any]
    #: The attempt number (1 for the first send).
    attempt: int
    #: The total budget for this call, all phases together, in seconds.
    timeout_s: float
    #: The ``time.monotonic()`` instant after which no byte of the request may leave: the
    #: tool's ``send_deadline_s`` counted from the start of the ``sent`` commit (``None``
    #: for a lookup, which has no such deadline). Check it with :meth:`check_send_deadline`.
    send_by: float | None = None
    #: The operation's stored W3C trace context (the agent's trace, recorded at enqueue), or
    #: ``None``: what an HTTP tool sends the remote when no span of ours is current.
    trace: TraceContext | None = None

    def send_time_left(self) -> float | None:
        """Seconds left before the send deadline (negative once past; ``None``: none)."""
        return None if self.send_by is None else self.send_by - time.monotonic()

    def check_send_deadline(self) -> None:
        """Raise :class:`SendDeadlinePassed` if the send deadline has passed.

        Call it as the very last thing before the request's first byte is written (after
        connecting, after building the body): the dispatcher then records the attempt as
        "not sent" and moves it back to ``planned``, fenced on the attempt. What it cannot
        cover is a pause between this check and the write itself (docs/tools.md).
        """
        left = self.send_time_left()
        if left is not None and left < 0:
            raise SendDeadlinePassed(
                f"not sent: the send deadline of operation {self.operation_id} passed "
                f"{-left:.3f}s before the request could leave",
                late_by_s=-left,
            )


class Tool(abc.ABC):
    """A registered tool: its :class:`ToolContract`, ``dispatch`` and optional ``lookup``.

    ``dispatch(call)`` sends the request once and classifies the answer as a
    :data:`DispatchResult`; ``lookup(call)`` asks the remote whether the operation's effect
    exists and answers a :data:`LookupResult`. Both may be synchronous or ``async def``.
    Call them through :func:`outbox.tools.run_dispatch` / :func:`outbox.tools.run_lookup`,
    which enforce the deadline and never raise.
    """

    contract: ToolContract

    @property
    def name(self) -> str:
        """The tool's registered name."""
        return self.contract.name

    @property
    def module(self) -> str | None:
        """The Python module that defined the tool, if any (``load_tools`` re-registers
        the tools of an already imported module)."""
        return None

    @property
    def origin(self) -> str:
        """Where the tool was defined, for error messages."""
        return type(self).__name__

    def span_attributes(self, stage: str) -> dict[str, str]:
        """OpenTelemetry semantic-convention attributes of a call span (``stage``:
        ``dispatch`` or ``lookup``): none for a tool whose protocol the outbox does not know."""
        return {}

    @abc.abstractmethod
    def dispatch(self, call: ToolCall) -> DispatchResult | Awaitable[DispatchResult]:
        """Send the request for ``call`` once and classify the answer."""

    def lookup(self, call: ToolCall) -> LookupResult | Awaitable[LookupResult]:
        """Ask the remote whether ``call``'s operation was applied (only if ``has_lookup``)."""
        raise NotImplementedError(f"tool {self.name!r} has no lookup")

    @property
    def is_async_dispatch(self) -> bool:
        """Whether ``dispatch`` is a coroutine function (run on an event loop)."""
        return inspect.iscoroutinefunction(self.dispatch)

    @property
    def is_async_lookup(self) -> bool:
        """Whether ``lookup`` is a coroutine function (run on an event loop)."""
        return inspect.iscoroutinefunction(self.lookup)

    def same_definition(self, other: Tool) -> bool:
        """Whether ``other`` is this tool defined again (a reload), not a second tool."""
        return other is self


def check_tool_name(name: object) -> str:
    """Return ``name`` if ``enqueue`` would accept it as a tool name, else raise ConfigError."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name) or len(name) > MAX_TOOL_LENGTH:
        raise ConfigError(
            f"tool name {name!r} is invalid: dotted words of letters, digits, '_' or '-', "
            f"starting with a letter, at most {MAX_TOOL_LENGTH} characters"
        )
    return name
