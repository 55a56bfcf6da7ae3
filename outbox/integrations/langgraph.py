"""Outbox tools as LangChain tools for LangGraph: ``ToolNode`` or a node of your own.

:func:`outbox_tool` turns a registered outbox tool into a LangChain tool. Its call records
the intent in its own committed transaction, waits up to ``wait_s`` for the outcome, and
answers with the operation's report (:mod:`outbox.reports`) as the ``ToolMessage``: the
report as JSON for content (its ``message`` says in words what happened and what not to do),
the same mapping as the message's ``artifact``.
An operation that has not settled, or waits for a person (``unknown``, ``needs_human``,
``awaiting_approval``), is a normal answer that says so and says not to call again with a
new key, never an exception a graph's retry policy would turn into a second call.

The intent key comes from the checkpointed run, never from the model's tool-call id (which
is new each time a model is asked again, as it is when a node re-runs after a crash):
the ``thread_id`` of ``config["configurable"]``, the node and its step (the superstep a
resumed run gives the same task again; inside a subgraph, after the enclosing graphs' tasks),
the outbox tool, and the call's ordinal among this tool's calls in that node's
execution. So a node that re-runs after a crash asks for the same operation and gets the
first one back, whatever ids the model gave its tool calls this time.

That holds when the thread is *resumed*. Run a thread with :func:`invoke_thread` (or
:func:`ainvoke_thread`), never with ``graph.invoke(None if graph.get_state(config).next else
input, config)``: a crash can leave a turn whose tasks' writes were saved and whose step was
not checkpointed, ``next`` is then empty, and given its input again the thread starts a new
turn whose calls come at later steps, under new keys, for a second effect. The step stays in
the key: it is what tells the next turn's request, the same words asked again, from a replay
of this one (docs/integrations.md, "Resuming a thread").

The ordinal: under ``ToolNode``, the call's position among the same tool's calls in the
model message that asked for it; called from a node of your own, the order of this
tool's calls in that node's execution (as LangGraph numbers a node's ``interrupt()`` calls),
which is stable when the node makes its calls in the order the model gave them, one at a
time.

``interrupt_on_approval=True`` maps ``awaiting_approval`` onto LangGraph's ``interrupt()``:
the graph pauses with the report as the interrupt's value; resumed (``Command(resume=...)``,
after an operator approved or rejected it), the node re-runs, finds the same operation, and
waits for its outcome. The outbox row is the truth, not the resume value.

Sync and async: ``invoke`` (``graph.invoke``, ``PostgresSaver``) records and waits with
:mod:`outbox.api` on an ``Engine``; ``ainvoke`` (``graph.ainvoke``/``astream``,
``AsyncPostgresSaver``) with :mod:`outbox.aio` on an ``AsyncEngine``, blocking no event loop
and holding no thread while it waits. The key, the answers and the refusals are the same.
Given a sync ``Engine``, ``ainvoke`` runs the sync call in a worker thread (as LangChain runs
any sync tool); given an ``AsyncEngine``, ``invoke`` refuses; given none, each path uses the
configured database.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForToolRun, CallbackManagerForToolRun
from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.runnables.config import run_in_executor
from langchain_core.tools import StructuredTool, ToolException
from langgraph.prebuilt import ToolRuntime
from langgraph.types import interrupt
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox import aio
from outbox.api import find
from outbox.contracts import CONTRACTS, ToolContract
from outbox.db import create_async_engine, database_url, get_engine
from outbox.errors import BudgetExceeded, IntentAlreadyDone, IntentConflict, InvalidIntent
from outbox.integrations import _calls
from outbox.integrations._langgraph_threads import (
    ainvoke_thread,
    athread_pending,
    invoke_thread,
    thread_pending,
)
from outbox.integrations.keys import durable_intent_key
from outbox.models import Operation
from outbox.reports import describe
from outbox.states import State

__all__ = [
    "CallIdentity",
    "OutboxTool",
    "ainvoke_thread",
    "athread_pending",
    "default_intent_key",
    "invoke_thread",
    "outbox_tool",
    "thread_pending",
]

#: How long a call waits for the outcome before it answers with the operation as it is.
DEFAULT_WAIT_S = 10.0
#: The payload's schema when the tool declares none: any JSON object.
FREE_FORM_PAYLOAD: Mapping[str, Any] = {"type": "object"}

# LangGraph's names in a task's config (langgraph.pregel._algo, langgraph._internal.
# _constants): the task's metadata, and the per-execution scratchpad a retry or a resumed
# run replaces, which scopes the ordinal counter of calls made from a node of your own.
_STEP, _NODE, _PATH, _NAMESPACE = (
    "langgraph_step",
    "langgraph_node",
    "langgraph_path",
    "langgraph_checkpoint_ns",
)
_SCRATCHPAD = "__pregel_scratchpad"
_PUSH = "__pregel_push"
_NS_SEP = "|"


@dataclass(frozen=True, slots=True, kw_only=True)
class CallIdentity:
    """What identifies one tool call across re-runs of its graph (the parts of its key)."""

    #: The checkpointer's ``thread_id`` (``config["configurable"]``); ``None`` without one.
    thread_id: str | None
    #: The enclosing graphs' tasks (``outer:<task id>``) for a subgraph's node, else ``""``.
    namespace: str
    #: The superstep (``langgraph_step``) and node (``langgraph_node``) of the task.
    step: int
    node: str
    #: A ``Send`` task's position (``[0]``), else ``""``.
    path: str
    #: The outbox tool's name (``deploy.create_release``).
    tool: str
    #: This call's position among the tool's calls in the node's execution (0 first).
    ordinal: int

    @property
    def step_label(self) -> str:
        """The step part of the key: ``[namespace/]node@step[path]``."""
        prefix = f"{self.namespace}/" if self.namespace else ""
        return f"{prefix}{self.node}@{self.step}{self.path}"


def default_intent_key(identity: CallIdentity) -> str:
    """The key ``thread_id:node@step:tool:ordinal`` (``durable_intent_key``)."""
    if not identity.thread_id:
        raise ValueError(
            "no thread_id in config['configurable']: compile the graph with a checkpointer "
            "and invoke it with config={'configurable': {'thread_id': ...}}, or give "
            "outbox_tool(intent_key=...) a function that builds the key"
        )
    return durable_intent_key(
        run_id=identity.thread_id,
        step=identity.step_label,
        tool=identity.tool,
        ordinal=identity.ordinal,
    )


class OutboxTool(StructuredTool):
    """A LangChain tool whose call is an outbox operation (built by :func:`outbox_tool`).

    Its fields are :func:`outbox_tool`'s arguments; a copy with other values
    (``model_copy(update=...)``) behaves by its own.
    """

    outbox_tool: str
    target: str | None = None
    wait_s: float = DEFAULT_WAIT_S
    engine: Engine | AsyncEngine | None = None
    require_approval: bool = False
    interrupt_on_approval: bool = False
    intent_key: Callable[[CallIdentity], str] = default_intent_key
    metadata_for_operation: Mapping[str, Any] | None = None
    requested_by: str | None = None

    def _run(
        self,
        *args: Any,
        config: RunnableConfig,
        run_manager: CallbackManagerForToolRun | None = None,
        **kwargs: Any,
    ) -> tuple[str, dict[str, Any]]:
        del args, run_manager  # the arguments are keywords; nothing is reported to callbacks
        if isinstance(self.engine, AsyncEngine):
            raise TypeError(
                f"tool {self.name!r} was given an AsyncEngine: call it with ainvoke "
                "(graph.ainvoke or astream), or give it a sync Engine"
            )
        runtime = kwargs.pop("runtime", None)
        return _call(self, config, runtime if isinstance(runtime, ToolRuntime) else None, kwargs)

    async def _arun(
        self,
        *args: Any,
        config: RunnableConfig,
        run_manager: AsyncCallbackManagerForToolRun | None = None,
        **kwargs: Any,
    ) -> tuple[str, dict[str, Any]]:
        del run_manager  # nothing is reported to callbacks
        if isinstance(self.engine, Engine):
            # A sync engine: the sync call, in a worker thread with this context (LangGraph's
            # config, for interrupt()), as LangChain runs any sync tool.
            result: tuple[str, dict[str, Any]] = await run_in_executor(
                None, self._run, *args, config=config, **kwargs
            )
            return result
        runtime = kwargs.pop("runtime", None)
        return await _call_async(
            self, config, runtime if isinstance(runtime, ToolRuntime) else None, kwargs
        )


def _injected(config: RunnableConfig, runtime: ToolRuntime | None = None, **args: Any) -> Any:
    """Never called: ``ToolNode`` reads a tool's ``func`` signature to know what to inject
    (here its ``ToolRuntime``: the model message and the call's id, for the ordinal)."""
    raise NotImplementedError


async def _injected_async(
    config: RunnableConfig, runtime: ToolRuntime | None = None, **args: Any
) -> Any:
    """Never called either (``OutboxTool._arun`` is the async call): the tool's ``coroutine``,
    without which ``StructuredTool.ainvoke`` would run the sync ``invoke`` in a thread."""
    raise NotImplementedError


def outbox_tool(
    tool: str,
    *,
    name: str | None = None,
    description: str | None = None,
    target: str | None = None,
    input_schema: Mapping[str, Any] | None = None,
    wait_s: float = DEFAULT_WAIT_S,
    engine: Engine | AsyncEngine | None = None,
    require_approval: bool = False,
    interrupt_on_approval: bool = False,
    intent_key: Callable[[CallIdentity], str] | None = None,
    metadata: Mapping[str, Any] | None = None,
    requested_by: str | None = None,
) -> OutboxTool:
    """The outbox tool ``tool`` as a LangChain tool for ``ToolNode`` or a node's own calls.

    The model gives ``target`` (unless fixed here) and ``payload``, whose JSON Schema is
    ``input_schema``, else the tool's declared one (``outbox.contracts.CONTRACTS``, filled
    when this process loaded its tools: ``outbox.tools.load_tools()``), else any object.
    ``name`` defaults to the tool's name with ``.`` as ``_`` (model providers refuse dots).
    ``wait_s``: how long a call waits for the outcome; ``engine``: the outbox's database, an
    ``Engine`` for ``invoke`` or an ``AsyncEngine`` for ``ainvoke`` (default: the configured
    one, either way). ``intent_key`` replaces :func:`default_intent_key`;
    ``metadata`` and ``requested_by`` are stored with each operation.
    """
    if wait_s < 0:
        raise ValueError(f"wait_s must not be negative, not {wait_s}")
    contract = CONTRACTS.get(tool)
    schema = input_schema or (contract.input_schema if contract else None) or FREE_FORM_PAYLOAD
    return OutboxTool(
        name=name or tool.replace(".", "_"),
        description=description or _description(tool, target, contract),
        args_schema=_args_schema(schema, fixed_target=target is not None),
        func=_injected,
        coroutine=_injected_async,
        response_format="content_and_artifact",
        handle_tool_error=True,
        outbox_tool=tool,
        target=target,
        wait_s=wait_s,
        engine=engine,
        require_approval=require_approval,
        interrupt_on_approval=interrupt_on_approval,
        intent_key=intent_key or default_intent_key,
        metadata_for_operation=metadata,
        requested_by=requested_by,
    )


def _description(tool: str, target: str | None, contract: ToolContract | None) -> str:
    where = f" on {target!r}" if target else " on `target`"
    what = f"{contract.description.strip()} " if contract and contract.description else ""
    return (
        f"{what}Ask for {tool}{where} with `payload`. The action happens at most once per call, "
        "even if this run is retried; the answer says whether it happened, is still in "
        "progress, or waits for a person."
    )


def _args_schema(payload: Mapping[str, Any], *, fixed_target: bool) -> dict[str, Any]:
    properties: dict[str, Any] = {"payload": dict(payload)}
    required = ["payload"]
    if not fixed_target:
        properties = {
            "target": {"type": "string", "description": "What the action is applied to."},
            **properties,
        }
        required.insert(0, "target")
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


def _call(
    tool: OutboxTool, config: RunnableConfig, runtime: ToolRuntime | None, args: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    key, arguments = _request(tool, config, runtime, args)
    engine = tool.engine if isinstance(tool.engine, Engine) else get_engine()
    op = _wait(engine, tool, _enqueue_committed(engine, tool, key, arguments))
    if _interrupted(tool, op):
        op = _wait(engine, tool, op)
    return _answer(op)


async def _call_async(
    tool: OutboxTool, config: RunnableConfig, runtime: ToolRuntime | None, args: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """:func:`_call` on :mod:`outbox.aio`: the same key, answers and refusals."""
    key, arguments = _request(tool, config, runtime, args)
    engine = await _async_engine(tool)
    op = await _wait_async(
        engine, tool, await _enqueue_committed_async(engine, tool, key, arguments)
    )
    if _interrupted(tool, op):
        op = await _wait_async(engine, tool, op)
    return _answer(op)


def _request(
    tool: OutboxTool, config: RunnableConfig, runtime: ToolRuntime | None, args: dict[str, Any]
) -> tuple[str, _calls.Arguments]:
    """The call's intent key and its checked arguments (before anything is written)."""
    target, payload = _arguments(tool, args)
    return tool.intent_key(_identity(tool, config, runtime)), _calls.Arguments(target, payload)


def _interrupted(tool: OutboxTool, op: Operation) -> bool:
    """Whether the call paused for approval: LangGraph's ``interrupt()`` raises until the
    thread is resumed, then returns (and the operation is to be read again)."""
    if op.state is not State.AWAITING_APPROVAL or not tool.interrupt_on_approval:
        return False
    interrupt(describe(op, keyed_by_model=False).to_dict())
    return True


def _answer(op: Operation) -> tuple[str, dict[str, Any]]:
    """The ``ToolMessage``'s content (the report as JSON) and artifact (the report)."""
    report = describe(op, keyed_by_model=False).to_dict()
    return json.dumps(report), report


def _arguments(tool: OutboxTool, args: Mapping[str, Any]) -> tuple[Any, Any]:
    expected = {"payload"} if tool.target is not None else {"target", "payload"}
    unexpected = sorted(set(args) - expected)
    if unexpected:
        raise ToolException(
            f"unexpected argument(s) {', '.join(unexpected)}: give only "
            f"{' and '.join(sorted(expected))}"
        )
    missing = sorted(expected - set(args))
    if missing:
        raise ToolException(f"missing argument(s): {', '.join(missing)}")
    target = tool.target if tool.target is not None else args["target"]
    return target, args["payload"]


def _enqueue_committed(
    engine: Engine, tool: OutboxTool, key: str, arguments: _calls.Arguments
) -> Operation:
    """Record the intent in a transaction of its own, committed before anything waits."""
    try:
        return _calls.enqueue_committed(engine, **_intent(tool, key, arguments))
    except IntentConflict as exc:
        with Session(engine) as session:
            existing = find(session, exc.intent_key, agent=exc.agent)
        raise ToolException(_conflict(exc, existing)) from exc
    except (InvalidIntent, BudgetExceeded, IntentAlreadyDone) as exc:
        raise _refused(exc) from exc


async def _enqueue_committed_async(
    engine: AsyncEngine, tool: OutboxTool, key: str, arguments: _calls.Arguments
) -> Operation:
    """:func:`_enqueue_committed` on :mod:`outbox.aio`."""
    try:
        return await _calls.enqueue_committed_async(engine, **_intent(tool, key, arguments))
    except IntentConflict as exc:
        async with AsyncSession(engine) as session:
            existing = await aio.find(session, exc.intent_key, agent=exc.agent)
        raise ToolException(_conflict(exc, existing)) from exc
    except (InvalidIntent, BudgetExceeded, IntentAlreadyDone) as exc:
        raise _refused(exc) from exc


def _intent(tool: OutboxTool, key: str, arguments: _calls.Arguments) -> dict[str, Any]:
    return {
        "tool": tool.outbox_tool,
        "arguments": arguments,
        "intent_key": key,
        "metadata": tool.metadata_for_operation,
        "requested_by": tool.requested_by,
        "require_approval": tool.require_approval,
    }


def _refused(exc: InvalidIntent | BudgetExceeded | IntentAlreadyDone) -> ToolException:
    if isinstance(exc, IntentAlreadyDone):
        return ToolException(
            f"this call was already made and finished ({exc.state}) as operation "
            f"{exc.operation_id}; it will not be done again."
        )
    return ToolException(f"refused, nothing was done: {exc}")


def _conflict(exc: IntentConflict, existing: Operation | None) -> str:
    """A re-run whose model asked for something else at the same place: say what exists."""
    said = (
        f"refused: this step of the run already asked for an action with a different "
        f"{', '.join(exc.differences)} (intent key {exc.intent_key})."
    )
    return f"{said} {describe(existing, keyed_by_model=False).message}" if existing else said


def _wait(engine: Engine, tool: OutboxTool, op: Operation) -> Operation:
    if op.is_settled and op.state is not State.AWAITING_APPROVAL:
        return op
    return _calls.wait_for(engine, op, tool.wait_s)


async def _wait_async(engine: AsyncEngine, tool: OutboxTool, op: Operation) -> Operation:
    if op.is_settled and op.state is not State.AWAITING_APPROVAL:
        return op
    return await _calls.wait_for_async(engine, op, tool.wait_s)


async def _async_engine(tool: OutboxTool) -> AsyncEngine:
    if isinstance(tool.engine, AsyncEngine):
        return tool.engine
    # The configured database may be the embedded one, which may have to start.
    return _configured_async_engine(await asyncio.to_thread(database_url))


@functools.cache
def _configured_async_engine(url: str) -> AsyncEngine:
    """The configured database for calls given no engine: without a pool (a connection per
    enqueue), since a pooled async connection belongs to the event loop that opened it and
    a tool may be called from several loops (each ``asyncio.run``)."""
    return create_async_engine(url, poolclass=NullPool)


def _identity(
    tool: OutboxTool,
    config: RunnableConfig,
    runtime: ToolRuntime | None,
) -> CallIdentity:
    configurable = config.get("configurable") or {}
    metadata = config.get("metadata") or {}
    if _STEP not in metadata or _NODE not in metadata:
        raise ValueError(
            f"tool {tool.name!r} was called outside a LangGraph node: its intent key comes "
            "from the graph's thread, step and node"
        )
    thread_id = configurable.get("thread_id")
    return CallIdentity(
        thread_id=str(thread_id) if thread_id is not None else None,
        namespace=_namespace(str(metadata.get(_NAMESPACE, ""))),
        step=int(metadata[_STEP]),
        node=str(metadata[_NODE]),
        path=_push_path(metadata.get(_PATH)),
        tool=tool.outbox_tool,
        ordinal=_ordinal(tool, configurable, runtime),
    )


def _namespace(checkpoint_ns: str) -> str:
    """``outer:<task id>|tools:<task id>`` → ``outer:<task id>``: the enclosing graphs' tasks.

    The current node's task id is left out (its step and name say which task it is, and
    stay the same when an earlier step is run again, which gives the task a new id); the
    enclosing tasks' ids are kept, because a subgraph's own steps start again at every
    invocation: without them, a subgraph run in two steps of its parent would share keys.
    LangGraph gives a task the same id when a run resumes from its checkpoint.
    """
    return checkpoint_ns.rpartition(_NS_SEP)[0]


def _push_path(path: object) -> str:
    """A ``Send`` task's index (``[2]``), so two sends to one node in a step differ."""
    if not isinstance(path, Sequence) or isinstance(path, str) or not path or path[0] != _PUSH:
        return ""
    return "[" + ",".join(str(i) for i in _ints(path[1:])) + "]"


def _ints(items: Sequence[Any]) -> list[int]:
    found: list[int] = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            found.append(item)
        elif isinstance(item, Sequence) and not isinstance(item, str):
            found.extend(_ints(item))
    return found


def _ordinal(
    tool: OutboxTool,
    configurable: Mapping[str, Any],
    runtime: ToolRuntime | None,
) -> int:
    if runtime is not None:
        position = _position_in_message(tool.name, runtime.tool_call_id, runtime.state)
        if position is not None:
            return position
    scratchpad = configurable.get(_SCRATCHPAD)
    if scratchpad is None:
        raise ValueError(
            f"tool {tool.name!r}: no LangGraph task around this call to number it by; call "
            "it from a graph's node (ToolNode or your own)"
        )
    return _ORDINALS.next(scratchpad, tool.outbox_tool)


def _position_in_message(name: str, call_id: str | None, state: Any) -> int | None:
    """This call's index among ``name``'s calls in the model message that asked for it,
    looked for in the state's lists of messages (whatever ``ToolNode``'s ``messages_key``)."""
    if call_id is None:
        return None
    for messages in _message_lists(state):
        for message in reversed(messages):
            if isinstance(message, AIMessage):
                same_tool = [c.get("id") for c in message.tool_calls if c["name"] == name]
                if call_id in same_tool:
                    return same_tool.index(call_id)
    return None


def _message_lists(state: Any) -> list[Sequence[Any]]:
    if isinstance(state, Sequence) and not isinstance(state, str):
        return [state]
    fields = state if isinstance(state, Mapping) else getattr(state, "__dict__", {})
    return [v for v in fields.values() if isinstance(v, Sequence) and not isinstance(v, str)]


class _Ordinals:
    """Per node execution, how many calls of each tool it made: LangGraph gives every
    execution (a first run, a retry, a resumed run) a new scratchpad, which scopes it.
    The last :data:`KEPT` executions are remembered (holding the scratchpad keeps its id
    from being reused)."""

    KEPT = 1024

    def __init__(self) -> None:
        self._counts: OrderedDict[int, tuple[object, Counter[str]]] = OrderedDict()
        self._lock = threading.Lock()

    def next(self, scratchpad: object, tool: str) -> int:
        with self._lock:
            entry = self._counts.get(id(scratchpad))
            if entry is None or entry[0] is not scratchpad:
                entry = (scratchpad, Counter())
                self._counts[id(scratchpad)] = entry
                while len(self._counts) > self.KEPT:
                    self._counts.popitem(last=False)
            self._counts.move_to_end(id(scratchpad))
            counts = entry[1]
            ordinal = counts[tool]
            counts[tool] += 1
            return ordinal


_ORDINALS = _Ordinals()
