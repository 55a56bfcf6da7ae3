"""One tool call through the outbox, as every adapter makes it.

The model's arguments (``target``, ``payload``) are checked, the intent is committed in a
transaction of its own (so the relay can see it while the call waits), the call waits up to a
bound for the outcome, and the answer is the operation's :class:`~outbox.reports.OperationReport`.
An adapter that joined the agent's own transaction instead could never see the outcome: the
intent is invisible to the relay until that transaction commits, after the tool has returned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from outbox import aio, api
from outbox.contracts import CONTRACTS
from outbox.errors import (
    BudgetExceeded,
    IntentAlreadyDone,
    IntentConflict,
    InvalidIntent,
    OperationNotFound,
    WaitTimeout,
)
from outbox.models import Operation
from outbox.reports import OperationReport, describe

#: How long a call waits for its outcome before it answers "in progress" (seconds).
DEFAULT_WAIT_S = 10.0

#: ``(run_id=, step=, tool=, ordinal=) -> intent key``: ``keys.durable_intent_key`` or the
#: user's own.
KeyFunction = Callable[..., str]

_TARGET_DESCRIPTION = (
    "What the action applies to (the tool's target: a project, an account, an address)."
)
_PAYLOAD_DESCRIPTION = "The action's input, a JSON object."


#: How a model checks on a pending operation here: the status tool both adapters offer.
HOW_TO_CHECK = "To check on it later, call outbox_status with operation_id {id}."


def report_of(op: Operation) -> OperationReport:
    """The report of ``op`` for a model that does not name the key: the adapter derives it."""
    return describe(op, keyed_by_model=False, how_to_check=HOW_TO_CHECK)


class BadArguments(ValueError):
    """The model's arguments are malformed; ``field`` names the argument (``target``,
    ``payload``). The model can fix them: adapters ask it to."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True, slots=True)
class Arguments:
    """The model's arguments for one call."""

    target: str
    payload: dict[str, Any]


def framework_name(tool: str) -> str:
    """The name a model calls ``tool`` by: providers allow only letters, digits, ``_`` and
    ``-``, so ``deploy.create_release`` becomes ``deploy_create_release``."""
    return tool.replace(".", "_")


def check_tool(tool: str) -> None:
    """Refuse a tool this process knows not to exist (its tools are loaded, this is not one)."""
    if CONTRACTS.loaded and CONTRACTS.get(tool) is None:
        known = ", ".join(CONTRACTS.names()) or "none"
        raise ValueError(f"tool {tool!r} is not registered in this process (known: {known})")


def input_schema_of(tool: str, given: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``given``, else the payload schema of the tool's loaded contract, else ``None``."""
    if given is not None:
        return given
    contract = CONTRACTS.get(tool)
    return contract.input_schema if contract is not None else None


def approval_of(tool: str, given: bool | None) -> bool:
    """``given``, else whether the tool's loaded contract requires approval."""
    if given is not None:
        return given
    contract = CONTRACTS.get(tool)
    return contract is not None and contract.approval_required


def parameters_schema(input_schema: Mapping[str, Any] | None) -> dict[str, Any]:
    """The JSON Schema of a call's arguments: ``target`` and ``payload`` (the tool's payload
    schema, or any object). No ``intent_key``: the adapter derives it, the model never
    invents one."""
    payload: dict[str, Any] = dict(input_schema) if input_schema is not None else {"type": "object"}
    payload.setdefault("description", _PAYLOAD_DESCRIPTION)
    return {
        "type": "object",
        "properties": {
            "target": {"type": "string", "description": _TARGET_DESCRIPTION},
            "payload": payload,
        },
        "required": ["target", "payload"],
        "additionalProperties": False,
    }


def description_of(tool: str, given: str | None) -> str:
    """``given``, else what the model is told about an outbox tool and its answers, after the
    tool's own ``description`` when its loaded contract has one."""
    if given is not None:
        return given
    contract = CONTRACTS.get(tool)
    what = f"{contract.description.strip()} " if contract and contract.description else ""
    return (
        f"{what}Request the action {tool} on a target. It is recorded once and carried out at most "
        "once, even if this call is repeated. The answer says what happened: 'confirmed' "
        "(done), 'failed' (refused), or, when it is not finished (in_progress, unknown, "
        "needs_human, awaiting_approval), that it is pending: then do not call this tool "
        "again for the same action; check on it with outbox_status, or tell the user it is "
        "pending."
    )


def arguments_of(raw: Mapping[str, Any]) -> Arguments:
    """The checked arguments, or :class:`BadArguments` naming the first wrong one."""
    unexpected = sorted(set(raw) - {"target", "payload"})
    if unexpected:
        raise BadArguments(
            f"unexpected argument {unexpected[0]!r}: give only target and payload",
            field=unexpected[0],
        )
    target = raw.get("target")
    if not isinstance(target, str) or not target:
        raise BadArguments("target is required: a non-empty string", field="target")
    payload = raw.get("payload")
    if not isinstance(payload, dict):
        raise BadArguments("payload is required: a JSON object", field="payload")
    return Arguments(target, payload)


def call_committed(
    engine: Engine,
    *,
    tool: str,
    arguments: Arguments,
    intent_key: str,
    metadata: Mapping[str, Any],
    wait_s: float,
    require_approval: bool = False,
    agent: str | None = None,
) -> OperationReport:
    """Commit the intent (the key ``agent``'s) in its own transaction, wait up to ``wait_s``
    for its outcome and report it. Raises :class:`~outbox.InvalidIntent` (nothing written) and lets
    :class:`~outbox.IntentConflict` / :class:`~outbox.IntentAlreadyDone` /
    :class:`~outbox.BudgetExceeded` through."""
    op = enqueue_committed(
        engine,
        tool=tool,
        arguments=arguments,
        intent_key=intent_key,
        metadata=metadata,
        require_approval=require_approval,
        agent=agent,
    )
    return settle(engine, op, wait_s)


def enqueue_committed(
    engine: Engine,
    *,
    tool: str,
    arguments: Arguments,
    intent_key: str,
    metadata: Mapping[str, Any] | None,
    require_approval: bool = False,
    requested_by: str | None = None,
    agent: str | None = None,
) -> Operation:
    """:func:`outbox.enqueue` in a transaction of its own, committed when this returns."""
    with Session(engine) as session, session.begin():
        return api.enqueue(
            session,
            tool=tool,
            target=arguments.target,
            payload=arguments.payload,
            intent_key=intent_key,
            metadata=metadata,
            requested_by=requested_by,
            require_approval=require_approval,
            agent=agent,
        )


async def enqueue_committed_async(
    engine: AsyncEngine,
    *,
    tool: str,
    arguments: Arguments,
    intent_key: str,
    metadata: Mapping[str, Any] | None,
    require_approval: bool = False,
    requested_by: str | None = None,
    agent: str | None = None,
) -> Operation:
    """:func:`enqueue_committed` on an ``AsyncEngine`` (:func:`outbox.aio.enqueue`)."""
    async with AsyncSession(engine) as session, session.begin():
        return await aio.enqueue(
            session,
            tool=tool,
            target=arguments.target,
            payload=arguments.payload,
            intent_key=intent_key,
            metadata=metadata,
            requested_by=requested_by,
            require_approval=require_approval,
            agent=agent,
        )


def wait_for(engine: Engine, op: Operation, wait_s: float) -> Operation:
    """``op`` read again: once settled, or as it stands after waiting up to ``wait_s``."""
    try:
        return api.wait(op.id, wait_s, engine=engine)
    except WaitTimeout as exc:
        last = exc.operation
        return last if isinstance(last, Operation) else op


async def wait_for_async(engine: AsyncEngine, op: Operation, wait_s: float) -> Operation:
    """:func:`wait_for` without blocking the event loop (:func:`outbox.aio.wait`)."""
    try:
        return await aio.wait(op.id, wait_s, engine=engine)
    except WaitTimeout as exc:
        last = exc.operation
        return last if isinstance(last, Operation) else op


def settle(engine: Engine, op: Operation, wait_s: float) -> OperationReport:
    """The report of ``op`` once settled, or as it stands after ``wait_s``."""
    if op.is_settled or wait_s <= 0:
        return report_of(op)
    return report_of(wait_for(engine, op, wait_s))


async def call_committed_async(
    engine: AsyncEngine,
    *,
    tool: str,
    arguments: Arguments,
    intent_key: str,
    metadata: Mapping[str, Any],
    wait_s: float,
    require_approval: bool = False,
    agent: str | None = None,
) -> OperationReport:
    """:func:`call_committed` on an ``AsyncEngine``, without blocking the event loop."""
    op = await enqueue_committed_async(
        engine,
        tool=tool,
        arguments=arguments,
        intent_key=intent_key,
        metadata=metadata,
        require_approval=require_approval,
        agent=agent,
    )
    if op.is_settled or wait_s <= 0:
        return report_of(op)
    return report_of(await wait_for_async(engine, op, wait_s))


def refusal(exc: IntentConflict | IntentAlreadyDone | BudgetExceeded) -> dict[str, Any]:
    """The answer to a call whose key names another or an already finished intent, or that a
    budget refused: settled, so that the model does not call again, in the core's own words
    (a budget's refusal names the budget, its window and what is left)."""
    if isinstance(exc, BudgetExceeded):
        return {
            "outcome": "refused",
            "settled": True,
            "budget": exc.budget,
            "window_s": exc.window_s,
            "remaining": exc.remaining,
            "message": str(exc),
        }
    return {
        "outcome": "refused",
        "settled": True,
        "intent_key": exc.intent_key,
        "message": str(exc),
    }


def model_can_fix(exc: InvalidIntent | BadArguments) -> bool:
    """Whether the model can fix the refused input (its target or payload), so that asking
    it to correct the call is right; otherwise the refusal is the answer."""
    field = exc.field or ""
    return field in ("target", "payload") or field.startswith("payload.")


#: The status tool's name: the one the reports' words tell a model to call.
STATUS_TOOL = "outbox_status"
STATUS_DESCRIPTION = (
    "Check on an action requested earlier, by the operation_id its answer gave: the same "
    "answer, as it stands now. Use this instead of requesting the action again."
)
STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "operation_id": {"type": "string", "description": "The operation_id of the action."}
    },
    "required": ["operation_id"],
    "additionalProperties": False,
}


def status_committed(engine: Engine, operation_id: object, wait_s: float) -> dict[str, Any]:
    """The report of the operation ``operation_id`` once settled or after ``wait_s``; an
    unknown id answers ``not_found``. Reads only."""
    try:
        with Session(engine) as session:
            op = api.get(session, _operation_id(operation_id))
    except OperationNotFound as exc:
        return _not_found(str(exc))
    if op is None:
        return _not_found(f"no operation {operation_id}")
    return settle(engine, op, wait_s).to_dict()


async def status_async(engine: AsyncEngine, operation_id: object, wait_s: float) -> dict[str, Any]:
    """:func:`status_committed` on an ``AsyncEngine``."""
    try:
        async with AsyncSession(engine) as session:
            op = await aio.get(session, _operation_id(operation_id))
    except OperationNotFound as exc:
        return _not_found(str(exc))
    if op is None:
        return _not_found(f"no operation {operation_id}")
    if op.is_settled or wait_s <= 0:
        return report_of(op).to_dict()
    return report_of(await wait_for_async(engine, op, wait_s)).to_dict()


def _operation_id(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise OperationNotFound("operation_id is required: the id an earlier answer gave")
    return value


def _not_found(message: str) -> dict[str, Any]:
    return {"outcome": "not_found", "settled": True, "message": message}
