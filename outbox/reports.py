"""An operation told to an agent: what happened, in words a model acts on correctly.

The MCP server (``outbox mcp``) and the framework adapters (``outbox.integrations``) answer a
tool call with the same :class:`OperationReport`, so every surface tells a model the same
thing. The wording matters more than it looks: a model that reads "timed out" calls the tool
again with a fresh key, which is the double charge this project exists to prevent. So a report
that is not settled says plainly that the action may already have happened, that calling
again with a *new* intent key would repeat it, and how to check instead.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from outbox.models import Operation
from outbox.states import State

#: What a report's ``outcome`` can say; ``in_progress`` covers ``planned`` and ``sent``.
Outcome = Literal[
    "confirmed",
    "failed",
    "cancelled",
    "in_progress",
    "unknown",
    "needs_human",
    "awaiting_approval",
]

_OUTCOMES: dict[State, Outcome] = {
    State.CONFIRMED: "confirmed",
    State.FAILED: "failed",
    State.CANCELLED: "cancelled",
    State.PLANNED: "in_progress",
    State.SENT: "in_progress",
    State.UNKNOWN: "unknown",
    State.NEEDS_HUMAN: "needs_human",
    State.AWAITING_APPROVAL: "awaiting_approval",
}

#: The advice every unsettled report ends with, where the model names the intent key itself
#: (MCP, the HTTP API): the one thing it must not do is mint a new key.
DO_NOT_RETRY_NEW_KEY = (
    "Do not call this tool again with a new intent_key: that would ask for the action a "
    "second time. Calling again with the same intent_key is safe (it returns this same "
    "operation)."
)
#: The same advice where the adapter derives the key from the run (the framework adapters):
#: the model cannot reuse a key, so any new call for the same purpose is a second request.
DO_NOT_RETRY_DERIVED_KEY = (
    "Do not call this tool again for the same purpose: a new call would be a second request "
    "and could do it twice."
)
#: How to check, unless the surface says better (the MCP server names its outbox_status tool).
DEFAULT_HOW_TO_CHECK = "To check on it later, look it up by its operation id {id}."


@dataclass(frozen=True, slots=True, kw_only=True)
class OperationReport:
    """One operation as an agent should see it (JSON-ready through :meth:`to_dict`)."""

    operation_id: str
    intent_key: str
    tool: str
    target: str
    #: The operation's state (``outbox.State``'s value).
    state: str
    #: The remote's own reference for the effect, once confirmed.
    remote_ref: str | None
    #: What the tool returned when it confirmed or failed (JSON), else ``None``.
    result: Any
    #: True when no component will move the operation on its own (terminal, or waiting for a
    #: person): waiting longer for it changes nothing.
    settled: bool
    outcome: Outcome
    #: In words, for a model: what happened, and when it is not done, what (not) to do next.
    message: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready mapping of every field."""
        return asdict(self)


def describe(
    op: Operation, *, keyed_by_model: bool = True, how_to_check: str = DEFAULT_HOW_TO_CHECK
) -> OperationReport:
    """The report of ``op`` as read (a snapshot: re-read the operation for a fresh one).

    ``keyed_by_model`` says whether the model passed the intent key itself (MCP, HTTP) or the
    surface derived it from the run (the framework adapters): the advice differs.
    ``how_to_check`` is the sentence telling the model how to check later; ``{id}`` in it is
    the operation id.
    """
    return OperationReport(
        operation_id=str(op.id),
        intent_key=op.intent_key,
        tool=op.tool,
        target=op.target,
        state=op.state.value,
        remote_ref=op.remote_ref,
        result=op.result if op.state in (State.CONFIRMED, State.FAILED) else None,
        settled=op.is_settled,
        outcome=_OUTCOMES[op.state],
        message=_message(op, _advice(op, keyed_by_model, how_to_check)),
    )


def _advice(op: Operation, keyed_by_model: bool, how_to_check: str) -> str:
    retry = DO_NOT_RETRY_NEW_KEY if keyed_by_model else DO_NOT_RETRY_DERIVED_KEY
    return f"{retry} {how_to_check.format(id=op.id)}"


#: Each state's words; ``{action}``, ``{id}``, ``{ref}``, ``{why}`` and ``{advice}`` are filled in.
_MESSAGES: dict[State, str] = {
    State.CONFIRMED: "Done: {action} happened exactly once{ref}. Operation {id}.",
    State.FAILED: (
        "Refused: {action} did not happen; the remote refused it{why}. Operation {id}. "
        "Retrying the same input will be refused again; change the input (with a new "
        "intent_key) only if the refusal says how."
    ),
    State.CANCELLED: "Cancelled: {action} did not happen and will not. Operation {id}.",
    State.AWAITING_APPROVAL: (
        "Waiting for approval: {action} will not happen until a person approves it (or it is "
        "cancelled if nobody does in time). Operation {id}. {advice}"
    ),
    State.NEEDS_HUMAN: (
        "Needs a person: whether {action} happened cannot be determined automatically; an "
        "operator has been asked to decide. It may already have happened. Operation {id}. "
        "{advice}"
    ),
    State.UNKNOWN: (
        "Outcome not known yet: {action} may already have happened; the outbox is finding "
        "out from the remote before doing anything again. Operation {id}. {advice}"
    ),
    State.PLANNED: (
        "In progress: {action} is queued or being sent and has not finished yet. "
        "Operation {id}. {advice}"
    ),
}
_MESSAGES[State.SENT] = _MESSAGES[State.PLANNED]


def _message(op: Operation, advice: str) -> str:
    return _MESSAGES[op.state].format(
        action=f"{op.tool} on {op.target!r}",
        id=op.id,
        ref=f" (remote reference {op.remote_ref})" if op.remote_ref else "",
        why=f": {op.last_error}" if op.last_error else "",
        advice=advice,
    )
