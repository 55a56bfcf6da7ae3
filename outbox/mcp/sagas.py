"""Sagas over MCP: ``outbox_saga`` declares several actions that succeed together or are
undone together (:func:`outbox.declare_saga`, committed), ``outbox_saga_status`` reads one.

The answer is a saga report: as text, a message a model reads (what happened, what was
undone, what to do next); as structured content, the saga's state and each step's. A saga
not settled yet is not an error (its steps may well have happened); one undone or cancelled
is (nothing of it remains).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mcp_types as types
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import aio
from outbox.errors import BudgetExceeded, DatabaseUnavailable, IntentConflict, OutboxError
from outbox.mcp.auth import Caller
from outbox.mcp.calls import refused, unreachable
from outbox.mcp.tools import ArgumentRefused
from outbox.saga_rules import FINAL_SAGA_STATES, SagaState
from outbox.sagas import (
    MAX_DECLARED_STEPS,
    MAX_SAGA_KEY_LENGTH,
    Compensate,
    SagaStep,
    SagaView,
    StepSpec,
)

SAGA_TOOL = "outbox_saga"
SAGA_STATUS_TOOL = "outbox_saga_status"
#: How often a call re-reads a saga while it waits for it to settle. Sagas have no bell of
#: their own (their steps' operations do): a read every half second for at most the
#: server's wait is a handful of index lookups.
POLL_S = 0.5

SAGA_KEY_ADVICE = (
    "Names this whole multi-step action so that it can never happen twice. Build it from "
    "what stays the same when it is retried, e.g. '<conversation id>/release-2.4.0': NEVER a "
    "fresh random value per call. Send the SAME saga_key with the same steps to retry or "
    "re-check it: you get the same saga back, never a second effect."
)

_SAGA_ADVICE = (
    "Runs several actions as one saga: each step is recorded before it is sent and sent at "
    "most once; a step runs when the one before it is confirmed (steps sharing a group run "
    "together); if a step is refused, the steps already done are undone in reverse order by "
    "their compensate action (a string '{remote_ref}' in its payload stands for the "
    "step's remote reference). Steps marked pivot cannot be undone. The answer says whether "
    "the saga completed, was undone, or is not settled yet; then check with "
    "outbox_saga_status and do not declare it again with a new saga_key."
)
#: Where a model is told to look when a saga is not settled.
HOW_TO_CHECK = "To check on it, call outbox_saga_status with saga_key {key!r}."
DO_NOT_REDECLARE = "Do not declare it again with a new saga_key."


def saga_tool(tools: list[str]) -> types.Tool:
    """``outbox_saga``: declare a saga whose steps call ``tools`` (registered names)."""
    call: dict[str, Any] = {
        "type": "object",
        "properties": {
            "tool": {"type": "string", "enum": tools, "description": "The action to run."},
            "target": {"type": "string", "minLength": 1, "description": "What it acts on."},
            "payload": {"type": "object", "description": "Its input, as the tool takes it."},
        },
        "required": ["tool", "target", "payload"],
        "additionalProperties": False,
    }
    step = {
        "type": "object",
        "properties": {
            "name": {
                "type": "string",
                "minLength": 1,
                "maxLength": 64,
                "description": "Unique in the saga, e.g. 'release-web'.",
            },
            **call["properties"],
            "compensate": {
                **call,
                "description": "The action that undoes this step if a later one is refused.",
            },
            "pivot": {
                "type": "boolean",
                "description": "This step cannot be undone (give no compensate).",
            },
            "group": {
                "type": "string",
                "description": "Steps of one group, one after another, run in parallel.",
            },
        },
        "required": ["name", "tool", "target", "payload"],
        "additionalProperties": False,
    }
    return types.Tool(
        name=SAGA_TOOL,
        title="Outbox: several actions, done together or undone together",
        description=_SAGA_ADVICE,
        input_schema={
            "type": "object",
            "properties": {
                "saga_key": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": MAX_SAGA_KEY_LENGTH,
                    "description": SAGA_KEY_ADVICE,
                },
                "steps": {
                    "type": "array",
                    "items": step,
                    "minItems": 1,
                    "maxItems": MAX_DECLARED_STEPS,
                    "description": "The steps, in the order they run.",
                },
            },
            "required": ["saga_key", "steps"],
            "additionalProperties": False,
        },
        annotations=types.ToolAnnotations(
            title="Outbox: a saga",
            read_only_hint=False,
            destructive_hint=True,
            idempotent_hint=True,
            open_world_hint=True,
        ),
    )


def saga_status_tool() -> types.Tool:
    """``outbox_saga_status``: one of the caller's sagas by key."""
    return types.Tool(
        name=SAGA_STATUS_TOOL,
        title="Outbox: status of a saga",
        description=(
            "Where one of your sagas stands: completed, undone, or still being settled, with "
            "each step's outcome. Use it to check on a saga that was not settled, instead of "
            "declaring it again."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "saga_key": {"type": "string", "description": "The saga's key."},
                "wait_s": {
                    "type": "number",
                    "minimum": 0,
                    "description": "Wait up to this many seconds for it to settle (default 0).",
                },
            },
            "required": ["saga_key"],
            "additionalProperties": False,
        },
        annotations=types.ToolAnnotations(
            title="Outbox: status of a saga",
            read_only_hint=True,
            idempotent_hint=True,
            open_world_hint=False,
        ),
    )


@dataclass(frozen=True, slots=True)
class SagaDeclaration:
    """``outbox_saga``'s arguments, checked: the key and the steps."""

    saga_key: str
    steps: list[StepSpec]


def saga_declaration(
    arguments: Mapping[str, Any] | None, tools: Mapping[str, str]
) -> SagaDeclaration:
    """``outbox_saga``'s arguments, or :class:`ArgumentRefused` naming the field
    (``steps[1].compensate.tool``). ``tools`` maps each name a step may give (registered or
    MCP) to the registered one."""
    given = dict(arguments or {})
    _refuse_unknown(given, ("saga_key", "steps"), "")
    key = given.get("saga_key")
    if not isinstance(key, str) or not key.strip():
        raise ArgumentRefused(
            "saga_key is required: a non-empty string that names this saga across retries",
            field="saga_key",
        )
    steps = given.get("steps")
    if not isinstance(steps, list) or not steps:
        raise ArgumentRefused("steps is required: a non-empty list of steps", field="steps")
    return SagaDeclaration(key, [_step(step, index, tools) for index, step in enumerate(steps)])


def _step(step: Any, index: int, tools: Mapping[str, str]) -> StepSpec:
    where = f"steps[{index}]"
    if not isinstance(step, dict):
        raise ArgumentRefused(f"{where} must be an object", field=where)
    _refuse_unknown(
        step, ("name", "tool", "target", "payload", "compensate", "pivot", "group"), where
    )
    name = step.get("name")
    if not isinstance(name, str):
        raise ArgumentRefused(f"{where}.name is required: a string", field=f"{where}.name")
    tool, target, payload = _call(step, where, tools)
    compensate = step.get("compensate")
    undo = None
    if compensate is not None:
        if not isinstance(compensate, dict):
            raise ArgumentRefused(
                f"{where}.compensate must be an object", field=f"{where}.compensate"
            )
        _refuse_unknown(compensate, ("tool", "target", "payload"), f"{where}.compensate")
        undo = Compensate(*_call(compensate, f"{where}.compensate", tools))
    pivot = step.get("pivot", False)
    if not isinstance(pivot, bool):
        raise ArgumentRefused(f"{where}.pivot must be true or false", field=f"{where}.pivot")
    group = step.get("group")
    if group is not None and not isinstance(group, str):
        raise ArgumentRefused(f"{where}.group must be a string", field=f"{where}.group")
    return StepSpec(name, tool, target, payload, undo, pivot, group)


def _call(given: Mapping[str, Any], where: str, tools: Mapping[str, str]) -> tuple[str, str, Any]:
    tool = given.get("tool")
    if not isinstance(tool, str) or tool not in tools:
        known = ", ".join(sorted(set(tools.values()))) or "none"
        raise ArgumentRefused(
            f"{where}.tool {tool!r} is not a tool of this server; its tools: {known}",
            field=f"{where}.tool",
        )
    target = given.get("target")
    if not isinstance(target, str):
        raise ArgumentRefused(f"{where}.target is required: a string", field=f"{where}.target")
    if "payload" not in given:
        raise ArgumentRefused(
            f"{where}.payload is required: a JSON object", field=f"{where}.payload"
        )
    return tools[tool], target, given["payload"]


def _refuse_unknown(given: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(given) - set(known), key=str)
    if unknown:
        field = f"{where}.{unknown[0]}" if where else str(unknown[0])
        raise ArgumentRefused(
            f"unknown argument {field!r}; the arguments are {', '.join(known)}", field=field
        )


@dataclass(frozen=True, slots=True)
class SagaStatusQuery:
    """``outbox_saga_status``'s arguments."""

    saga_key: str
    wait_s: float


def saga_status_query(arguments: Mapping[str, Any] | None) -> SagaStatusQuery:
    """``outbox_saga_status``'s arguments, or :class:`ArgumentRefused` naming the field."""
    given = dict(arguments or {})
    _refuse_unknown(given, ("saga_key", "wait_s"), "")
    key = given.get("saga_key")
    if not isinstance(key, str) or not key:
        raise ArgumentRefused("saga_key is required: a non-empty string", field="saga_key")
    wait_s = given.get("wait_s", 0)
    if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or not wait_s >= 0:
        raise ArgumentRefused("wait_s must be a number of seconds >= 0", field="wait_s")
    return SagaStatusQuery(key, float(wait_s))


@dataclass(frozen=True)
class SagaCalls:
    """The saga calls of one server: its database, how long a call waits for an outcome,
    and the names a step may give its tools."""

    engine: AsyncEngine
    wait_s: float
    #: Each name a step may give (registered or MCP), to the registered one.
    tools: Mapping[str, str]

    async def declare(
        self, arguments: Mapping[str, Any] | None, caller: Caller
    ) -> types.CallToolResult:
        """``outbox_saga``: declare ``caller``'s saga in a committed transaction of its own
        (the same declaration again is the same saga), then wait for it to settle."""
        try:
            declaration = saga_declaration(arguments, self.tools)
        except ArgumentRefused as exc:
            return refused(str(exc), field=exc.field)
        try:
            async with self.engine.begin() as conn:
                done = await aio.declare_saga(
                    conn,
                    declaration.saga_key,
                    declaration.steps,
                    requested_by=caller.name,
                    agent=caller.agent,
                )
        except (OperationalError, InterfaceError, DatabaseUnavailable):
            return unreachable()
        except OutboxError as exc:  # refused: nothing was written
            return _refusal(exc, declaration.saga_key)
        return saga_result(await self._settled(done.saga, self.wait_s))

    async def status(
        self, arguments: Mapping[str, Any] | None, caller: Caller
    ) -> types.CallToolResult:
        """``outbox_saga_status``: one of ``caller``'s sagas, waiting up to ``wait_s`` (at
        most the server's own wait) for it to settle."""
        try:
            query = saga_status_query(arguments)
        except ArgumentRefused as exc:
            return refused(str(exc), field=exc.field)
        try:
            found = await self._read(query.saga_key, caller.agent)
            if found is None:
                return refused(
                    f"none of your sagas has saga_key {query.saga_key!r}", field="saga_key"
                )
            found = await self._settled(found, min(query.wait_s, self.wait_s))
        except (OperationalError, InterfaceError, DatabaseUnavailable):
            return unreachable()
        return saga_result(found)

    async def _read(self, key: str, agent: str) -> SagaView | None:
        async with self.engine.connect() as conn:
            return await aio.get_saga(conn, key, agent=agent)

    async def _settled(self, view: SagaView, wait_s: float) -> SagaView:
        """``view`` once settled (final, or waiting for a person), or as last read after
        ``wait_s`` seconds (also when the database goes away meanwhile)."""
        deadline = time.monotonic() + wait_s
        while not _settled(view) and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(POLL_S, left))
            try:
                view = await self._read(view.key, view.agent) or view
            except (OperationalError, InterfaceError, DatabaseUnavailable):
                return view  # recorded already: its report says how to check on it later
        return view


def _refusal(exc: OutboxError, saga_key: str) -> types.CallToolResult:
    """The core's refusal of a declaration in words for a model, naming the field."""
    if isinstance(exc, IntentConflict):
        return refused(
            f"{exc} The same saga_key must always carry the same steps. If this is a new, "
            "different saga, use a new saga_key; if it is the same one, send exactly the same "
            "steps again.",
            field=exc.differences[0] if exc.differences else "steps",
        )
    if isinstance(exc, BudgetExceeded):
        return refused(str(exc), field="budget")
    return refused(str(exc), field=getattr(exc, "field", None) or "steps")


def _settled(view: SagaView) -> bool:
    return view.state in FINAL_SAGA_STATES or view.state is SagaState.NEEDS_HUMAN


def saga_result(view: SagaView) -> types.CallToolResult:
    """A call's answer about one saga: its message as text, the saga structured."""
    message = saga_message(view)
    body = {
        "saga_key": view.key,
        "state": view.state.value,
        "settled": _settled(view),
        "reason": view.reason,
        "steps": [
            {
                "name": step.name,
                "tool": step.tool,
                "target": step.target,
                "operation_id": str(step.operation_id) if step.operation_id else None,
                "state": step.state.value if step.state else None,
                "remote_ref": step.remote_ref,
                "compensation_state": (
                    step.compensation_state.value if step.compensation_state else None
                ),
            }
            for step in view.steps
        ],
        "message": message,
    }
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=message)],
        structured_content=body,
        is_error=view.state in (SagaState.COMPENSATED, SagaState.CANCELLED),
    )


def saga_message(view: SagaView) -> str:
    """What a model reads of a saga: what happened, what was undone, what to do next."""
    key = view.key
    why = f" ({view.reason})" if view.reason else ""
    steps = "; ".join(_step_line(step) for step in view.steps)
    check = f"{DO_NOT_REDECLARE} {HOW_TO_CHECK.format(key=key)}"
    if view.state is SagaState.COMPLETED:
        return f"Done: saga {key!r} completed; every step happened exactly once: {steps}."
    if view.state is SagaState.COMPENSATED:
        return (
            f"Undone: saga {key!r} did not complete{why}; the steps that had happened were "
            f"undone in reverse order, and nothing of it remains: {steps}."
        )
    if view.state is SagaState.CANCELLED:
        return f"Cancelled: saga {key!r} did not happen and will not{why}: {steps}."
    if view.state is SagaState.NEEDS_HUMAN:
        return (
            f"Needs a person: saga {key!r} cannot go on by itself{why}; an operator decides. "
            f"Some steps may have happened: {steps}. {check}"
        )
    return f"In progress: saga {key!r} is {view.state.value}{why}: {steps}. {check}"


def _step_line(step: SagaStep) -> str:
    state = step.state.value if step.state is not None else "pruned"
    line = f"{step.name} {state}"
    if step.remote_ref:
        line += f" (remote reference {step.remote_ref})"
    if step.compensation_state is not None:
        line += f", undo {step.compensation_state.value}"
    elif step.held:
        line += ", not started"
    return line
