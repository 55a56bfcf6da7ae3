"""What each MCP call does: record the intent (committed), wait a while, tell the outcome.

Every answer about an operation is :func:`outbox.reports.describe`'s report, as text (its
message, which a model reads) and as structured content (every field). ``isError`` is true
when the call was refused (its arguments, a key naming another intent) and when the action
settled without happening (``failed``, ``cancelled``); an action not settled yet (in
progress, outcome unknown, waiting for a person or an approval) is not an error: its report
says so plainly and says not to call again with a new key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mcp_types as types
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import aio, sql
from outbox.errors import (
    BudgetExceeded,
    DatabaseUnavailable,
    IntentAlreadyDone,
    IntentConflict,
    InvalidIntent,
    OperationNotFound,
    WaitTimeout,
)
from outbox.mcp.auth import Caller
from outbox.mcp.tools import (
    ArgumentRefused,
    ToolIntent,
    list_query,
    status_query,
    tool_intent,
)
from outbox.models import Operation
from outbox.reports import OperationReport, describe
from outbox.states import State

#: How a model checks on an operation here: this server's own tool.
HOW_TO_CHECK = "To check on it, call outbox_status with operation_id {id}."
#: Outcomes that settled without the action happening: the call ended in an error.
_ERROR_OUTCOMES = frozenset({"failed", "cancelled"})


@dataclass(frozen=True)
class Calls:
    """The calls of one server: its database and how long a call waits for an outcome."""

    engine: AsyncEngine
    #: Seconds a tool call waits for its operation to settle before answering.
    wait_s: float

    async def call_registered(
        self, tool: str, arguments: Mapping[str, Any] | None, caller: Caller
    ) -> types.CallToolResult:
        """Enqueue ``caller``'s intent for ``tool`` in a committed transaction of its own
        (the same intent again is the same operation), then wait for its outcome."""
        try:
            intent = tool_intent(arguments)
            op = await self._enqueue_committed(tool, intent, caller)
        except ArgumentRefused as exc:
            return refused(str(exc), field=exc.field)
        except InvalidIntent as exc:  # PayloadInvalid and PayloadTooLarge too: field named
            return refused(str(exc), field=exc.field)
        except IntentAlreadyDone as exc:
            return _already_done(exc)
        except BudgetExceeded as exc:  # nothing written; the budget, window and what is left
            return refused(str(exc), field="budget")
        except (OperationalError, InterfaceError, DatabaseUnavailable):
            # The commit's outcome may be unknown: the same key again is the safe retry.
            return unreachable()
        return report_result(report_of(await self._settled(op, self.wait_s)))

    async def status(
        self, arguments: Mapping[str, Any] | None, caller: Caller
    ) -> types.CallToolResult:
        """``outbox_status``: one of ``caller``'s operations, waiting up to ``wait_s`` (at
        most the server's own wait) for it to settle."""
        try:
            query = status_query(arguments)
        except ArgumentRefused as exc:
            return refused(str(exc), field=exc.field)
        try:
            if query.operation_id is not None:
                field, named = "operation_id", f"operation {query.operation_id}"
                op = await self.own_operation(query.operation_id, caller)
            else:
                field, named = "intent_key", f"intent_key {query.intent_key!r}"
                async with self.engine.connect() as conn:
                    op = await aio.find(conn, str(query.intent_key), agent=caller.agent)
            if op is None:
                return refused(f"none of your operations has {named}", field=field)
            op = await self._settled(op, min(query.wait_s, self.wait_s), through_approval=True)
        except (OperationalError, InterfaceError, DatabaseUnavailable):
            return unreachable()
        return report_result(report_of(op))

    async def list_own(
        self, arguments: Mapping[str, Any] | None, caller: Caller
    ) -> types.CallToolResult:
        """``outbox_list``: ``caller``'s operations, newest first."""
        try:
            query = list_query(arguments)
        except ArgumentRefused as exc:
            return refused(str(exc), field=exc.field)
        try:
            found = await self.own_operations(caller, state=query.state, limit=query.limit)
        except (OperationalError, InterfaceError, DatabaseUnavailable):
            return unreachable()
        reports = [report_of(op).to_dict() for op in found]
        lines = [
            f"{r['operation_id']} {r['tool']} {r['target']!r} key {r['intent_key']!r}: "
            f"{r['outcome']}"
            + (f" (remote reference {r['remote_ref']})" if r["remote_ref"] else "")
            for r in reports
        ]
        text = "\n".join(lines) if lines else "No operations of yours match."
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)],
            structured_content={"operations": reports},
        )

    async def own_operations(
        self, caller: Caller, *, state: State | None = None, limit: int = 20
    ) -> list[Operation]:
        """``caller``'s agent's operations, newest first (ids are UUIDv7: creation order)."""
        async with self.engine.connect() as conn:
            return await conn.run_sync(
                lambda sync: sql.web.page_operations(
                    sync, limit=limit, state=state, agent=caller.agent
                )
            )

    async def own_operation(self, operation_id: str, caller: Caller) -> Operation | None:
        """One of ``caller``'s agent's operations by id; ``None`` if there is none (or
        another agent's)."""
        async with self.engine.connect() as conn:
            try:
                op = await aio.get(conn, operation_id)
            except OperationNotFound:  # not an operation id at all
                return None
        return op if op is not None and op.agent == caller.agent else None

    async def _enqueue_committed(self, tool: str, intent: ToolIntent, caller: Caller) -> Operation:
        """The operation of ``intent``, recorded and committed (or found: the same intent),
        the key ``caller``'s agent's own."""
        key = intent.intent_key
        async with self.engine.begin() as conn:
            try:
                return await aio.enqueue(
                    conn,
                    tool=tool,
                    target=intent.target,
                    payload=intent.payload,
                    intent_key=key,
                    requested_by=caller.name,
                    agent=caller.agent,
                )
            except IntentConflict as exc:
                # Nothing was written; the existing operation tells which fields differ.
                existing = await aio.find(conn, key, agent=caller.agent)
                raise _conflict(exc, existing, intent) from exc

    async def _settled(
        self, op: Operation, wait_s: float, *, through_approval: bool = False
    ) -> Operation:
        """``op`` once settled, or as last seen after ``wait_s`` seconds. A call answers at
        once that its operation waits for approval (a person takes minutes, not seconds);
        ``outbox_status`` asked to wait waits on through the approval to the outcome."""
        pending = through_approval and op.state is State.AWAITING_APPROVAL
        if (op.is_settled and not pending) or wait_s <= 0:
            return op
        try:
            return await aio.wait(
                op.id, timeout=wait_s, engine=self.engine, through_approval=through_approval
            )
        except WaitTimeout as exc:
            last = exc.operation
            return last if isinstance(last, Operation) else op
        except (OperationalError, InterfaceError, DatabaseUnavailable):
            return op  # recorded already: its report says how to check on it later


def _conflict(
    exc: IntentConflict, existing: Operation | None, intent: ToolIntent
) -> ArgumentRefused:
    """The conflict in words for a model, naming each field (down to the payload's own
    fields) that differs from what the key was first used for (the caller's own key: no
    other agent's operation is ever compared)."""
    # The core names the payload's own fields (payload.amount) when it had both payloads.
    fields = list(exc.fields or exc.differences)
    named = ", ".join(fields) or "the input"
    verb = "differs" if len(fields) <= 1 else "differ"
    return ArgumentRefused(
        f"intent_key {intent.intent_key!r} was already used for a different action "
        f"(operation {exc.operation_id}): {named} {verb}. The same key must always carry "
        "the same tool, target and payload. If this is a new, different action, use a new "
        "intent_key; if it is the same action, send exactly the same input again.",
        field=fields[0] if fields else "intent_key",
    )


def report_of(op: Operation) -> OperationReport:
    """``op``'s report as this server words it (the model names the key; outbox_status)."""
    return describe(op, keyed_by_model=True, how_to_check=HOW_TO_CHECK)


def report_result(report: OperationReport) -> types.CallToolResult:
    """A call's answer about one operation: its message as text, every field structured."""
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=report.message)],
        structured_content=report.to_dict(),
        is_error=report.outcome in _ERROR_OUTCOMES,
    )


def unreachable() -> types.CallToolResult:
    """The database could not be reached: whether the intent was recorded is not known."""
    message = (
        "The outbox's database could not be reached, so whether this action was recorded is "
        "not known. Call again with the same intent_key in a moment: that is safe (it can "
        "never do the action twice). Do not use a new intent_key."
    )
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=message)],
        structured_content={"error": "unavailable", "message": message},
        is_error=True,
    )


def refused(message: str, *, field: str) -> types.CallToolResult:
    """A call refused before anything was written: the reason, naming the field."""
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=f"Refused ({field}): {message}")],
        structured_content={"error": "refused", "field": field, "message": message},
        is_error=True,
    )


def _already_done(exc: IntentAlreadyDone) -> types.CallToolResult:
    """The same intent as one that finished and was pruned: it is not done again."""
    state = getattr(exc.state, "value", str(exc.state))
    body = {
        "operation_id": str(exc.operation_id),
        "intent_key": exc.intent_key,
        "state": state,
        "remote_ref": exc.remote_ref,
        "settled": True,
        "outcome": state,
        "message": str(exc),
    }
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=str(exc))],
        structured_content=body,
        is_error=state in _ERROR_OUTCOMES,
    )
