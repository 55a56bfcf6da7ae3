"""A registered outbox tool as a PydanticAI tool (extra ``agent-outbox[pydantic-ai]``).

    from outbox.integrations.pydantic_ai import outbox_tool

    agent = Agent(model, tools=[outbox_tool("deploy.create_release", engine=engine)])
    agent.run_sync("Release 1.2.3 of project-a", conversation_id="ticket-4711")

The model sees a tool ``deploy_create_release(target, payload)`` whose ``payload`` schema is
the tool's ``input_schema``. It never sees or invents an intent key: the adapter derives it
from the run's durable identity (:func:`~outbox.integrations.keys.durable_intent_key`):

- ``run_id``: the run's ``conversation_id`` (PydanticAI keeps it on ``message_history``, or
  you pass it to ``agent.run``; a resumed run must have the same one), or your function;
- ``step``: which model response asked for the call, counted over the conversation's
  messages (``response-3``), so a replay of that response is the same step and the next turn
  is another; or your function;
- the tool, and ``ordinal``: the call's position among this tool's calls in that response
  (or your function).

Never the provider's tool-call id, which differs when a crashed run is replayed.

Each call commits its intent in a transaction of its own (it must, to see the outcome),
waits up to ``wait_s`` and returns the operation's report (``outbox.reports``) as the tool's
result. Pending (``in_progress``, ``unknown``, ``needs_human``, ``awaiting_approval``) is a
normal result that says "do not call again for the same purpose; check with outbox_status",
never an exception that would make the framework retry. A payload that does not match the
schema, or a missing target, raises ``ModelRetry`` naming the field: the model can fix that.

Given an ``Engine`` the tool is a sync function (PydanticAI runs it in a worker thread, under
``run_sync`` and ``run`` alike); given an ``AsyncEngine`` it is a coroutine on
``outbox.aio``, which blocks no event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic_ai import ModelRetry, RunContext, Tool
from pydantic_ai.messages import ModelResponse, ToolCallPart
from pydantic_ai.toolsets import FunctionToolset
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.errors import BudgetExceeded, IntentAlreadyDone, IntentConflict, InvalidIntent
from outbox.integrations import _calls
from outbox.integrations._calls import DEFAULT_WAIT_S, BadArguments, KeyFunction
from outbox.integrations.keys import durable_intent_key

__all__ = [
    "call_ordinal",
    "call_step",
    "conversation_run_id",
    "outbox_status_tool",
    "outbox_tool",
    "outbox_toolset",
]

#: ``RunContext -> str``: a part of the run's durable identity.
IdentityFunction = Callable[[RunContext[Any]], str]
#: ``RunContext -> int``: the call's position among its tool's calls in the step.
OrdinalFunction = Callable[[RunContext[Any]], int]


def conversation_run_id(ctx: RunContext[Any]) -> str:
    """The run's ``conversation_id``: what a resumed conversation keeps (the default)."""
    if not ctx.conversation_id:
        raise RuntimeError("this run has no conversation_id; pass conversation_id= to the run")
    return ctx.conversation_id


def call_step(ctx: RunContext[Any]) -> str:
    """``response-N``: the position, among the conversation's model responses, of the
    response that asked for this call (the default step). A replayed response has the same
    position; the next turn's responses come later."""
    return f"response-{_response_index(ctx)}"


def call_ordinal(ctx: RunContext[Any]) -> int:
    """This call's position among the calls of the same tool in its model response."""
    response = [m for m in ctx.messages if isinstance(m, ModelResponse)][_response_index(ctx)]
    same_tool = [
        part
        for part in response.parts
        if isinstance(part, ToolCallPart) and part.tool_name == ctx.tool_name
    ]
    found = [n for n, part in enumerate(same_tool) if part.tool_call_id == ctx.tool_call_id]
    if not found:
        raise LookupError(f"the tool call {ctx.tool_call_id!r} is not a call of {ctx.tool_name!r}")
    return found[0]


def _response_index(ctx: RunContext[Any]) -> int:
    """Where the response that made this call is; a context without it cannot say which call
    this is, and a guess could merge two calls into one operation, so it refuses."""
    responses = [m for m in ctx.messages if isinstance(m, ModelResponse)]
    # From the end: a provider (or a test model) may reuse ids across a conversation.
    for index in range(len(responses) - 1, -1, -1):
        if any(_is_this_call(part, ctx) for part in responses[index].parts):
            return index
    raise LookupError(
        f"the tool call {ctx.tool_call_id!r} is not among this run's messages (a context "
        "without them?): pass step= and ordinal= to outbox_tool"
    )


def _is_this_call(part: object, ctx: RunContext[Any]) -> bool:
    return isinstance(part, ToolCallPart) and part.tool_call_id == ctx.tool_call_id


def outbox_tool(
    tool: str,
    *,
    engine: Engine | AsyncEngine,
    name: str | None = None,
    description: str | None = None,
    input_schema: Mapping[str, Any] | None = None,
    wait_s: float = DEFAULT_WAIT_S,
    run_id: IdentityFunction = conversation_run_id,
    step: IdentityFunction = call_step,
    ordinal: OrdinalFunction = call_ordinal,
    intent_key: KeyFunction = durable_intent_key,
    max_retries: int | None = None,
    agent: str | None = None,
) -> Tool[Any]:
    """The outbox tool ``tool`` as a PydanticAI :class:`~pydantic_ai.Tool`.

    ``name`` defaults to the tool's name with dots as underscores; ``input_schema`` to the
    loaded contract's (a free-form object when none); ``run_id``, ``step`` and ``ordinal`` are
    functions of the ``RunContext`` (defaults: :func:`conversation_run_id`, :func:`call_step`,
    :func:`call_ordinal`); ``intent_key`` builds the key from ``run_id=, step=, tool=,
    ordinal=``. ``agent`` is the agent the keys belong to (default: the deployment's shared
    scope): give each agent sharing a database its own. Raises ``ValueError`` for a tool this
    process knows not to exist.
    """
    _calls.check_tool(tool)
    schema = _calls.parameters_schema(_calls.input_schema_of(tool, input_schema))
    call = _Call(
        tool,
        engine,
        wait_s,
        run_id=run_id,
        step=step,
        ordinal=ordinal,
        intent_key=intent_key,
        agent=agent,
    )
    function: Callable[..., Any] = (
        call.run_async if isinstance(engine, AsyncEngine) else call.run_sync
    )
    made: Tool[Any] = Tool.from_schema(
        function,
        name=name or _calls.framework_name(tool),
        description=_calls.description_of(tool, description),
        json_schema=schema,
        takes_ctx=True,
    )
    made.max_retries = max_retries
    return made


def outbox_status_tool(
    *, engine: Engine | AsyncEngine, name: str = _calls.STATUS_TOOL, wait_s: float = DEFAULT_WAIT_S
) -> Tool[Any]:
    """``outbox_status(operation_id)``: the report of an operation asked for earlier, once
    settled or after ``wait_s`` (what the reports tell a model to call instead of asking for
    the action again). Reads only."""
    if isinstance(engine, AsyncEngine):
        async_engine = engine

        async def status_async(operation_id: str) -> dict[str, Any]:
            return await _calls.status_async(async_engine, operation_id, wait_s)

        function: Callable[..., Any] = status_async
    else:
        sync_engine = engine

        def status(operation_id: str) -> dict[str, Any]:
            return _calls.status_committed(sync_engine, operation_id, wait_s)

        function = status
    return Tool.from_schema(
        function,
        name=name,
        description=_calls.STATUS_DESCRIPTION,
        json_schema=_calls.STATUS_SCHEMA,
    )


def outbox_toolset(
    *tools: str, engine: Engine | AsyncEngine, status: bool = True, **options: Any
) -> FunctionToolset[Any]:
    """A PydanticAI toolset of outbox tools (each as :func:`outbox_tool` with ``options``),
    with :func:`outbox_status_tool` unless ``status=False``."""
    made = [outbox_tool(tool, engine=engine, **options) for tool in tools]
    if status:
        made.append(outbox_status_tool(engine=engine))
    return FunctionToolset(made)


class _Call:
    """What one call of the tool does, sync or async."""

    def __init__(
        self,
        tool: str,
        engine: Engine | AsyncEngine,
        wait_s: float,
        *,
        run_id: IdentityFunction,
        step: IdentityFunction,
        ordinal: OrdinalFunction,
        intent_key: KeyFunction,
        agent: str | None = None,
    ) -> None:
        self.tool = tool
        self.agent = agent
        self.engine = engine
        self.wait_s = wait_s
        self.run_id = run_id
        self.step = step
        self.ordinal = ordinal
        self.intent_key = intent_key

    def _prepare(
        self, ctx: RunContext[Any], raw: Mapping[str, Any]
    ) -> tuple[_calls.Arguments, str, dict[str, Any]]:
        try:
            arguments = _calls.arguments_of(raw)
        except BadArguments as exc:
            raise ModelRetry(str(exc)) from None
        run_id = self.run_id(ctx)
        key = self.intent_key(
            run_id=run_id, step=self.step(ctx), tool=self.tool, ordinal=self.ordinal(ctx)
        )
        return arguments, key, {"framework": "pydantic_ai", "run_id": run_id}

    def run_sync(self, ctx: RunContext[Any], **raw: Any) -> dict[str, Any]:
        """The tool on a sync ``Engine``."""
        arguments, key, metadata = self._prepare(ctx, raw)
        assert isinstance(self.engine, Engine)  # noqa: S101 -- chosen by outbox_tool
        try:
            report = _calls.call_committed(
                self.engine,
                tool=self.tool,
                arguments=arguments,
                intent_key=key,
                metadata=metadata,
                wait_s=self.wait_s,
                agent=self.agent,
            )
        except (IntentConflict, IntentAlreadyDone, BudgetExceeded) as exc:
            return _calls.refusal(exc)
        except InvalidIntent as exc:
            raise _retry_or_raise(exc) from None
        return report.to_dict()

    async def run_async(self, ctx: RunContext[Any], **raw: Any) -> dict[str, Any]:
        """The tool on an ``AsyncEngine``."""
        arguments, key, metadata = self._prepare(ctx, raw)
        assert isinstance(self.engine, AsyncEngine)  # noqa: S101 -- chosen by outbox_tool
        try:
            report = await _calls.call_committed_async(
                self.engine,
                tool=self.tool,
                arguments=arguments,
                intent_key=key,
                metadata=metadata,
                wait_s=self.wait_s,
                agent=self.agent,
            )
        except (IntentConflict, IntentAlreadyDone, BudgetExceeded) as exc:
            return _calls.refusal(exc)
        except InvalidIntent as exc:
            raise _retry_or_raise(exc) from None
        return report.to_dict()


def _retry_or_raise(exc: InvalidIntent) -> Exception:
    """``ModelRetry`` (the model fixes its target or payload), else the refusal itself."""
    return ModelRetry(str(exc)) if _calls.model_can_fix(exc) else exc
