"""Run a tool's dispatch or lookup under the call's total deadline, never raising.

A timeout tells what the caller saw, not what the remote did, so everything this module
cannot vouch for is reported conservatively: a dispatch that raised, overran its deadline
or answered something that is not a :data:`DispatchResult` is :class:`Ambiguous`; a lookup
in the same situation is :class:`Inconclusive`. Nothing here retries.

``async def`` tools run on this thread's event loop (one :class:`asyncio.Runner` per thread,
reused so that HTTP connections can be reused too) under ``asyncio.timeout``; an async tool
that blocks the loop instead of awaiting cannot be interrupted until it yields. Synchronous
tools run on a small shared thread pool; after the deadline the caller stops waiting and the
call is abandoned (a thread cannot be stopped): its eventual answer is discarded. A sync call
that never got a thread before the deadline was provably not made: :class:`NotDelivered`.

A dispatch call carries its send deadline (``ToolCall.send_by``): a call that starts after it
(its thread came too late, its loop was paused) is not made, and a tool that raises
:class:`SendDeadlinePassed` (``call.check_send_deadline()``, right before its first byte)
gives :class:`NotSent`: the dispatcher moves the attempt back to ``planned``.

Call these functions from synchronous code (a Celery task), not from inside an event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from outbox.errors import SendDeadlinePassed
from outbox.logs import Action
from outbox.tools.base import Tool, ToolCall
from outbox.tools.results import (
    Ambiguous,
    Applied,
    DispatchResult,
    FailedRemotely,
    Inconclusive,
    LookupResult,
    NotApplied,
    NotDelivered,
    NotSent,
    Rejected,
)

log = logging.getLogger(__name__)

#: Threads for synchronous tools: a dispatch worker makes one call at a time per worker
#: thread, so a few are plenty; more only helps abandoned (hung) calls pile up unnoticed.
POOL_THREADS = 8

_DISPATCH_TYPES = (Applied, Rejected, Ambiguous, NotDelivered)
_LOOKUP_TYPES = (Applied, NotApplied, FailedRemotely, Inconclusive)


def run_dispatch(tool: Tool, call: ToolCall) -> DispatchResult:
    """Call ``tool.dispatch(call)`` once under ``call.timeout_s`` and return its result.

    Overrunning the deadline, raising, or returning something other than a
    :data:`DispatchResult` gives :class:`Ambiguous` (the request may have been applied); a
    synchronous call that never got a thread gives :class:`NotDelivered`; a call whose send
    deadline passed before it could send (see ``ToolCall.check_send_deadline``) gives
    :class:`NotSent`. The tool's own
    exceptions never escape. Raises ``RuntimeError`` (before calling the tool) when called
    from inside a running event loop.
    """
    outcome = _invoke(tool.dispatch, call, is_async=tool.is_async_dispatch, kind="dispatch")
    if isinstance(outcome, _Failure):
        if outcome.not_sent:
            return NotSent(outcome.reason)
        if outcome.never_started:
            return NotDelivered(outcome.reason)
        return Ambiguous(outcome.reason)
    if isinstance(outcome, _DISPATCH_TYPES):
        return outcome
    return Ambiguous(f"dispatch returned {_describe(outcome)}, not a DispatchResult")


def run_lookup(tool: Tool, call: ToolCall) -> LookupResult:
    """Call ``tool.lookup(call)`` once under ``call.timeout_s`` and return its result.

    A tool without a lookup, overrunning the deadline, raising, or returning something other
    than a :data:`LookupResult` gives :class:`Inconclusive`. The tool's own exceptions never
    escape; like :func:`run_dispatch`, refuses to run inside a running event loop.
    """
    if not tool.contract.has_lookup:
        return Inconclusive(f"tool {tool.name!r} has no lookup")
    outcome = _invoke(tool.lookup, call, is_async=tool.is_async_lookup, kind="lookup")
    if isinstance(outcome, _Failure):
        return Inconclusive(outcome.reason)
    if isinstance(outcome, _LOOKUP_TYPES):
        return outcome
    return Inconclusive(f"lookup returned {_describe(outcome)}, not a LookupResult")


def close_thread_loop() -> None:
    """Close this thread's event loop, after closing what tools bound to it (HTTP clients).

    For worker shutdown and tests; the next async call opens a new loop.
    """
    runner: asyncio.Runner | None = getattr(_local, "runner", None)
    _local.runner = None
    if runner is None:
        return
    try:
        for finalizer in _LOOP_FINALIZERS:
            runner.run(finalizer())
    finally:
        runner.close()


def is_thread_loop() -> bool:
    """Whether the running event loop is this thread's own (closed by close_thread_loop)."""
    runner: asyncio.Runner | None = getattr(_local, "runner", None)
    if runner is None or not _loop_is_running():
        return False
    return runner.get_loop() is asyncio.get_running_loop()


def on_loop_close(finalizer: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``finalizer()`` on a thread's event loop when :func:`close_thread_loop` closes it."""
    if finalizer not in _LOOP_FINALIZERS:
        _LOOP_FINALIZERS.append(finalizer)


@dataclass(frozen=True)
class _Failure:
    """The callable gave no answer: why, and whether it provably never started."""

    reason: str
    never_started: bool = False
    #: The tool refused to send past the call's send deadline: nothing left.
    not_sent: bool = False


_LOOP_FINALIZERS: list[Callable[[], Coroutine[Any, Any, None]]] = []
_local = threading.local()
_pool_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _invoke(
    method: Callable[[ToolCall], object], call: ToolCall, *, is_async: bool, kind: str
) -> object:
    if _loop_is_running():
        raise RuntimeError(
            f"run_{kind} blocks until the call ends: call it from synchronous code, "
            "not from inside a running event loop"
        )
    if is_async:
        return _invoke_async(method, call)
    return _invoke_sync(method, call, kind=kind)


def _loop_is_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _invoke_async(method: Callable[[ToolCall], object], call: ToolCall) -> object:
    try:
        # In the caller's context (its current span: the call's): the runner's own, copied
        # once when it was made, would hand every later call the first caller's.
        return _thread_runner().run(
            _within_deadline(method, call), context=contextvars.copy_context()
        )
    except SendDeadlinePassed as exc:
        return _Failure(str(exc), not_sent=True)
    except Exception as exc:  # noqa: BLE001 - any failure of the tool is an answer, not a crash
        return _Failure(_exception_reason(exc))


async def _within_deadline(method: Callable[[ToolCall], object], call: ToolCall) -> object:
    deadline = asyncio.timeout(call.timeout_s)
    try:
        async with deadline:
            call.check_send_deadline()  # the loop may have been paused since the dispatcher's
            answer = method(call)
            if inspect.isawaitable(answer):
                answer = await answer
    except TimeoutError as exc:
        if deadline.expired():
            return _Failure(_deadline_reason(call))
        return _Failure(_exception_reason(exc))
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # we are being cancelled (Ctrl-C): not the tool's answer
        return _Failure(_exception_reason(exc))
    return answer


def _invoke_sync(method: Callable[[ToolCall], object], call: ToolCall, *, kind: str) -> object:
    future = _shared_pool().submit(_if_still_in_time, method, call)
    done, _ = concurrent.futures.wait([future], timeout=max(call.timeout_s, 0.0))
    if not done:
        if future.cancel():
            return _Failure(
                f"the {kind} never started: every tool thread was busy for the whole "
                f"deadline of {call.timeout_s:g}s",
                never_started=True,
            )
        log.warning(
            "%s of tool %s abandoned after %gs; it may still complete",
            kind,
            call.tool,
            call.timeout_s,
            extra={"action": Action.TOOL_CALL_ABANDONED, "operation_id": call.operation_id},
        )
        return _Failure(_deadline_reason(call))
    exc = future.exception()
    if isinstance(exc, SendDeadlinePassed):
        return _Failure(str(exc), not_sent=True)
    if exc is not None:
        return _Failure(_exception_reason(exc))
    answer = future.result()
    if inspect.iscoroutine(answer):
        # Declared synchronous but returned a coroutine: it never ran. Close it so it does not
        # warn "never awaited"; the answer is still junk (the caller cannot know what ran).
        answer.close()
        return _Failure(f"{kind} returned a coroutine from a function not declared async def")
    return answer


def _if_still_in_time(method: Callable[[ToolCall], object], call: ToolCall) -> object:
    # A saturated pool may hand the call a thread after its send deadline: then not at all.
    call.check_send_deadline()
    return method(call)


def _thread_runner() -> asyncio.Runner:
    runner: asyncio.Runner | None = getattr(_local, "runner", None)
    if runner is None:
        runner = asyncio.Runner()
        _local.runner = runner
    return runner


def _shared_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool  # noqa: PLW0603 - one lazily created pool per process
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=POOL_THREADS, thread_name_prefix="outbox-tool"
            )
        return _pool


def _reset_after_fork() -> None:
    # A forked child (Celery prefork) inherits the parent's pool bookkeeping without its
    # threads and the parent's event loop selector: start afresh instead of sharing them.
    global _pool, _local, _pool_lock  # noqa: PLW0603
    _pool = None
    _pool_lock = threading.Lock()
    _local = threading.local()


os.register_at_fork(after_in_child=_reset_after_fork)


def _deadline_reason(call: ToolCall) -> str:
    return f"exceeded the total deadline of {call.timeout_s:g}s"


def _exception_reason(exc: BaseException) -> str:
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
