"""A registered outbox tool as an OpenAI Agents SDK tool (extra ``agent-outbox[openai-agents]``).

    from outbox.integrations.openai_agents import OutboxRun, outbox_function_tool

    agent = Agent(name="ops", tools=[outbox_function_tool("deploy.create_release", engine=engine)])
    await Runner.run(agent, "Release 1.2.3", context=OutboxRun("ticket-4711", turn=3))

The model sees a ``FunctionTool`` ``deploy_create_release(target, payload)`` whose
``payload`` schema is the tool's ``input_schema``. The intent key comes from the run's durable
identity, an :class:`OutboxRun` passed as the run's context (or your ``identity`` function
finding it in yours): its ``run_id`` (a conversation or session id that a resumed run keeps),
its ``turn`` (the user turn this run serves), the tool, and the call's ordinal among this
tool's calls in the run. Never the SDK's ``tool_call_id``, which differs when a crashed run is
replayed. The ordinal is given out in the order the calls start, the same on a replay of the
same turn by a fresh :class:`OutboxRun`.

Each call commits its intent in a transaction of its own, waits up to ``wait_s`` and returns
the operation's report (``outbox.reports``) as JSON text: pending (``in_progress``,
``unknown``, ``needs_human``, ``awaiting_approval``) is a normal result that says "do not call
again for the same purpose; check with outbox_status".

**Approval.** A tool that requires approval (its contract's ``approval = "required"``, or
``approval=True``) gets the SDK's ``needs_approval``, as a function: it commits the intent
(the operation waits in ``awaiting_approval``, where nothing can send it) and interrupts the
run only while the operation still waits, so an operation an operator already decided in the
outbox does not ask again. A person then decides with :func:`approve` or :func:`reject`,
which record the decision in the outbox (``outbox.approve`` with ``by=`` and the hash of the
payload in the approval item: exactly the arguments the SDK will run) and in the SDK's
``RunState``. The SDK's own ``state.approve(item)`` records no approver and no payload, so it
alone never releases an outbox operation: the outbox stays authoritative, and a call the SDK
approved but the outbox did not answers ``awaiting_approval``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from agents import FunctionTool, RunContextWrapper, RunState, ToolApprovalItem
from agents.tool_context import ToolContext
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import api, approval
from outbox.canonical import canonical_json, payload_hash
from outbox.errors import (
    BudgetExceeded,
    IntentAlreadyDone,
    IntentConflict,
    InvalidIntent,
    OperationNotFound,
)
from outbox.integrations import _calls
from outbox.integrations._calls import DEFAULT_WAIT_S, BadArguments, KeyFunction
from outbox.integrations.keys import durable_intent_key
from outbox.models import Executor, Operation
from outbox.reports import OperationReport
from outbox.states import State

__all__ = ["OutboxRun", "approve", "outbox_function_tool", "outbox_status_tool", "reject"]


@dataclass
class OutboxRun:
    """The run's durable identity, passed to ``Runner.run(..., context=...)``.

    ``run_id`` is the conversation (session, thread) that a resumed run keeps; ``turn`` the
    user turn this run serves (the same when the turn is replayed after a crash, the next
    one for the next user message). The calls it has seen are kept here so that a call asked
    about twice (approval, then execution) keeps its ordinal and key.
    """

    run_id: str
    turn: int | str = 0
    #: The agent the run's intent keys belong to (``""``: the deployment's shared scope):
    #: give each agent sharing a database its own.
    agent: str = ""
    #: call id -> intent key, for the calls of this run seen so far.
    calls: dict[str, str] = field(default_factory=dict)
    #: (step, tool) -> how many calls have been given an ordinal.
    counts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping: ``state.to_json(context_serializer=OutboxRun.to_dict)``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OutboxRun:
        """Rebuild from :meth:`to_dict`:
        ``RunState.from_json(agent, saved, context_deserializer=OutboxRun.from_dict)``."""
        return cls(
            run_id=str(data["run_id"]),
            turn=data.get("turn", 0),
            agent=str(data.get("agent") or ""),
            calls={str(k): str(v) for k, v in dict(data.get("calls") or {}).items()},
            counts={str(k): int(v) for k, v in dict(data.get("counts") or {}).items()},
        )

    @property
    def step(self) -> str:
        """The step part of the intent keys: ``turn-<turn>``."""
        return f"turn-{self.turn}"

    def key_for(self, tool: str, call_id: str, intent_key: KeyFunction) -> str:
        """The intent key of the call ``call_id`` of ``tool``, given out once per call."""
        known = self.calls.get(call_id)
        if known is not None:
            return known
        counter = f"{self.step}\n{tool}"
        ordinal = self.counts.get(counter, 0)
        self.counts[counter] = ordinal + 1
        key = intent_key(run_id=self.run_id, step=self.step, tool=tool, ordinal=ordinal)
        self.calls[call_id] = key
        return key


#: ``RunContextWrapper -> OutboxRun``: where the durable identity is in your context.
IdentityFunction = Callable[[RunContextWrapper[Any]], OutboxRun]


def context_run(wrapper: RunContextWrapper[Any]) -> OutboxRun:
    """The :class:`OutboxRun` that is the run's context, or its ``outbox_run`` attribute."""
    context = wrapper.context
    found = context if isinstance(context, OutboxRun) else getattr(context, "outbox_run", None)
    if not isinstance(found, OutboxRun):
        raise TypeError(
            "an outbox tool needs the run's durable identity: pass context=OutboxRun(run_id, "
            "turn=...) to Runner.run (or a context with an outbox_run attribute)"
        )
    return found


def outbox_function_tool(
    tool: str,
    *,
    engine: Engine | AsyncEngine,
    name: str | None = None,
    description: str | None = None,
    input_schema: Mapping[str, Any] | None = None,
    wait_s: float = DEFAULT_WAIT_S,
    approval: bool | None = None,
    identity: IdentityFunction = context_run,
    intent_key: KeyFunction = durable_intent_key,
) -> FunctionTool:
    """The outbox tool ``tool`` as the SDK's :class:`~agents.FunctionTool`.

    ``name`` defaults to the tool's name with dots as underscores; ``input_schema`` to the
    loaded contract's (a free-form object when none; not strict, since a payload schema need
    not meet the strict mode's rules); ``approval`` to the contract's requirement;
    ``identity`` finds the :class:`OutboxRun` in the context; ``intent_key`` builds the key
    from ``run_id=, step=, tool=, ordinal=``. Raises ``ValueError`` for a tool this process
    knows not to exist.
    """
    _calls.check_tool(tool)
    approval_required = _calls.approval_of(tool, approval)
    call = _Call(tool, engine, wait_s, identity, intent_key, approval_required=approval_required)
    return FunctionTool(
        name=name or _calls.framework_name(tool),
        description=_calls.description_of(tool, description),
        params_json_schema=_calls.parameters_schema(_calls.input_schema_of(tool, input_schema)),
        on_invoke_tool=call.invoke,
        strict_json_schema=False,
        needs_approval=call.needs_approval if approval_required else False,
    )


def outbox_status_tool(
    *, engine: Engine | AsyncEngine, name: str = _calls.STATUS_TOOL, wait_s: float = DEFAULT_WAIT_S
) -> FunctionTool:
    """``outbox_status(operation_id)``: the report of an operation asked for earlier, once
    settled or after ``wait_s`` (what the reports tell a model to call instead of asking for
    the action again). Reads only."""

    async def invoke(ctx: ToolContext[Any], raw_arguments: str) -> str:
        try:
            parsed = json.loads(raw_arguments or "{}")
        except json.JSONDecodeError:
            parsed = {}
        operation_id = parsed.get("operation_id") if isinstance(parsed, dict) else None
        if isinstance(engine, AsyncEngine):
            return _answer(await _calls.status_async(engine, operation_id, wait_s))
        report = await asyncio.to_thread(_calls.status_committed, engine, operation_id, wait_s)
        return _answer(report)

    return FunctionTool(
        name=name,
        description=_calls.STATUS_DESCRIPTION,
        params_json_schema=_calls.STATUS_SCHEMA,
        on_invoke_tool=invoke,
        strict_json_schema=False,
    )


class _Call:
    def __init__(
        self,
        tool: str,
        engine: Engine | AsyncEngine,
        wait_s: float,
        identity: IdentityFunction,
        intent_key: KeyFunction,
        *,
        approval_required: bool,
    ) -> None:
        self.tool = tool
        self.engine = engine
        self.wait_s = wait_s
        self.identity = identity
        self.intent_key = intent_key
        self.approval_required = approval_required

    async def invoke(self, ctx: ToolContext[Any], raw_arguments: str) -> str:
        """The SDK's ``on_invoke_tool``: the report as JSON text, or why the input is wrong."""
        try:
            arguments = _parse(raw_arguments)
        except BadArguments as exc:
            return _answer({"outcome": "invalid_input", "field": exc.field, "message": str(exc)})
        run = self.identity(ctx)
        key = run.key_for(self.tool, ctx.tool_call_id, self.intent_key)
        try:
            report = await self._call(arguments, key, run)
        except (IntentConflict, IntentAlreadyDone, BudgetExceeded) as exc:
            return _answer(_calls.refusal(exc))
        except InvalidIntent as exc:
            if not _calls.model_can_fix(exc):
                raise
            return _answer({"outcome": "invalid_input", "field": exc.field, "message": str(exc)})
        return _answer(report.to_dict())

    async def needs_approval(
        self, wrapper: RunContextWrapper[Any], parameters: dict[str, Any], call_id: str
    ) -> bool:
        """Commit the intent, and interrupt the run while its operation awaits approval."""
        try:
            arguments = _calls.arguments_of(parameters)
        except BadArguments:
            return False  # the call itself answers that the input is wrong
        run = self.identity(wrapper)
        key = run.key_for(self.tool, call_id, self.intent_key)
        try:
            report = await self._call(arguments, key, run, wait_s=0)
        except (IntentConflict, IntentAlreadyDone, InvalidIntent, BudgetExceeded):
            return False  # the call itself answers the refusal
        return report.state == State.AWAITING_APPROVAL.value

    async def _call(
        self, arguments: _calls.Arguments, key: str, run: OutboxRun, *, wait_s: float | None = None
    ) -> OperationReport:
        metadata = {"framework": "openai_agents", "run_id": run.run_id}
        wait = self.wait_s if wait_s is None else wait_s
        if isinstance(self.engine, AsyncEngine):
            return await _calls.call_committed_async(
                self.engine,
                tool=self.tool,
                arguments=arguments,
                intent_key=key,
                metadata=metadata,
                wait_s=wait,
                require_approval=self.approval_required,
                agent=run.agent,
            )
        return await asyncio.to_thread(
            _calls.call_committed,
            self.engine,
            tool=self.tool,
            arguments=arguments,
            intent_key=key,
            metadata=metadata,
            wait_s=wait,
            require_approval=self.approval_required,
            agent=run.agent,
        )


def _parse(raw_arguments: str) -> _calls.Arguments:
    try:
        parsed = json.loads(raw_arguments or "{}")
    except json.JSONDecodeError as exc:
        raise BadArguments(f"the arguments are not JSON: {exc.msg}", field="arguments") from None
    if not isinstance(parsed, dict):
        raise BadArguments("the arguments must be a JSON object", field="arguments")
    return _calls.arguments_of(parsed)


def _answer(result: Mapping[str, Any]) -> str:
    return json.dumps(result, default=str)


def approve(
    session: Executor,
    state: RunState[Any, Any],
    item: ToolApprovalItem,
    *,
    by: str,
    note: str | None = None,
    run: OutboxRun | None = None,
) -> Operation:
    """Approve the interrupted call ``item`` in the outbox and in the SDK's ``state``.

    The outbox approval (``outbox.approve``) records ``by`` and binds to the hash of the
    payload in ``item``'s arguments, which are the ones the SDK runs when the run resumes: a
    different stored payload raises ``ApprovalMismatch``. It joins the transaction of
    ``session`` (commit it, then resume the run with ``state``); ``state.approve(item)`` is
    called after the outbox accepted. ``run`` is the run's :class:`OutboxRun` (default: the
    one in ``state``'s context, restored from JSON too when serialised with
    :meth:`OutboxRun.to_dict`).
    """
    op, digest = _operation_of(session, item, run or _state_run(state))
    approved = approval.approve(session, op.id, by=by, payload_hash=digest, note=note)
    state.approve(item)
    return approved


def reject(
    session: Executor,
    state: RunState[Any, Any],
    item: ToolApprovalItem,
    *,
    by: str,
    reason: str,
    run: OutboxRun | None = None,
) -> Operation:
    """Refuse the interrupted call ``item`` in the outbox (``outbox.reject``: cancelled,
    never sent) and in the SDK's ``state`` (the model is told ``reason``). Joins the
    transaction of ``session``."""
    op, _ = _operation_of(session, item, run or _state_run(state))
    rejected = approval.reject(session, op.id, by=by, reason=reason)
    state.reject(item, rejection_message=reason)
    return rejected


def _state_run(state: RunState[Any, Any]) -> OutboxRun:
    # The SDK (0.24) has no public accessor for a RunState's context wrapper.
    wrapper = getattr(state, "_context", None)
    if not isinstance(wrapper, RunContextWrapper):
        raise TypeError("this RunState has no context: pass run= (the run's OutboxRun)")
    return context_run(wrapper)


def _operation_of(
    session: Executor, item: ToolApprovalItem, run: OutboxRun
) -> tuple[Operation, str]:
    call_id = getattr(item.raw_item, "call_id", None)
    key = run.calls.get(call_id) if isinstance(call_id, str) else None
    if key is None:
        raise OperationNotFound(
            f"the call {call_id!r} was not asked about in this run (is this the run's OutboxRun?)",
            operation_id=None,
        )
    op = api.find(session, key, agent=run.agent)
    if op is None:
        raise OperationNotFound(f"no operation under intent key {key!r}", operation_id=None)
    arguments = _parse(str(getattr(item.raw_item, "arguments", "") or ""))
    return op, payload_hash(canonical_json(arguments.payload))
