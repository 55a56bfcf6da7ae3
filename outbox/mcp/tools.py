"""What the model sees of each tool: its MCP definition, and the arguments a call must carry.

A registered tool's MCP input is the intent: ``intent_key`` (required, and described so that
a model makes a key that stays the same across retries of one action), ``target`` and
``payload`` (the tool's ``input_schema``, or any object). ``outbox_status`` and
``outbox_list`` read the caller's own operations.
"""

from __future__ import annotations

import copy
import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import mcp_types as types

from outbox.api import MAX_INTENT_KEY_LENGTH, MAX_TARGET_LENGTH
from outbox.contracts import ToolContract
from outbox.states import State

STATUS_TOOL = "outbox_status"
LIST_TOOL = "outbox_list"
#: The server's own tools' names, which no registered tool's MCP name may take.
OWN_TOOLS = (STATUS_TOOL, LIST_TOOL, "outbox_saga", "outbox_saga_status")
#: The longest MCP tool name clients accept: Claude's and OpenAI's APIs take
#: ``^[a-zA-Z0-9_-]{1,64}$`` (no dots, although MCP allows them).
MAX_MCP_NAME = 64
#: The longest page ``outbox_list`` answers.
MAX_LIST_LIMIT = 100

INTENT_KEY_ADVICE = (
    "Names this one intended action so that it can never happen twice. Build it from what "
    "stays the same when this same step is retried, e.g. '<conversation id>/<step>' or "
    "'<ticket id>/refund': NEVER a fresh random value or timestamp per call. Send the SAME "
    "key again to retry or re-check this action (after an error, a timeout, a restart): you "
    "get the same operation back, never a second effect. Use a new key only for a new, "
    "different action."
)

TARGET_ADVICE = (
    "What the action acts on, as the tool expects it (a project, an account, a customer id)."
)

_FREE_PAYLOAD: dict[str, Any] = {
    "type": "object",
    "description": "The action's input: a JSON object (this tool declares no schema for it).",
}

#: What every registered tool's call is, for a model deciding how to use it.
_CALL_ADVICE = (
    "Runs through the outbox: recorded before it is sent, sent at most once per intent_key, "
    "and looked up (never guessed) when its outcome is lost. The answer says whether it "
    "happened (confirmed), did not (failed, cancelled), or is not settled yet; then check "
    "with outbox_status and do not call again with a new intent_key."
)


@dataclass(frozen=True, slots=True)
class ToolIntent:
    """The arguments of one call of a registered tool (types checked; the rest is enqueue's)."""

    intent_key: str
    target: str
    payload: Any


class ArgumentRefused(Exception):
    """A call's arguments are not what the tool's input schema says; ``field`` names which."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


def mcp_names(tools: Iterable[str]) -> dict[str, str]:
    """Each registered tool's MCP name, by MCP name: dots become underscores
    (``deploy.create_release`` → ``deploy_create_release``), since clients refuse dotted
    names. A name that would be longer than :data:`MAX_MCP_NAME`, or the same as another's
    (or as one of the server's own, :data:`OWN_TOOLS`), keeps a prefix and gains a hash of the full
    name instead: deterministic, so a client's cached list stays valid across restarts."""
    registered = sorted(set(tools))
    plain = {name: name.replace(".", "_") for name in registered}
    taken = Counter([*plain.values(), *OWN_TOOLS])
    named: dict[str, str] = {}
    for name, simple in plain.items():
        if len(simple) > MAX_MCP_NAME or taken[simple] > 1:
            digest = hashlib.sha256(name.encode()).hexdigest()[:8]
            named[f"{simple[: MAX_MCP_NAME - 9]}_{digest}"] = name
        else:
            named[simple] = name
    return named


def registered_tool(contract: ToolContract, mcp_name: str) -> types.Tool:
    """The MCP definition of a registered tool, under its MCP name (:func:`mcp_names`)."""
    payload = _payload_schema(contract)
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "intent_key": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_INTENT_KEY_LENGTH,
                "description": INTENT_KEY_ADVICE,
            },
            "target": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_TARGET_LENGTH,
                "description": TARGET_ADVICE,
            },
            "payload": payload,
        },
        "required": ["intent_key", "target", "payload"],
        "additionalProperties": False,
    }
    # The payload schema's dialect and definitions move to the root, where its "#/$defs/..."
    # point (the keywords around it mean the same in every draft since 4).
    for key in ("$schema", "$defs", "definitions"):
        if key in payload:
            schema[key] = payload.pop(key)
    approval = (
        " Each call waits for a person's approval before anything is sent."
        if contract.approval_required
        else ""
    )
    return types.Tool(
        name=mcp_name,
        title=contract.name,
        description=f"{_what(contract)} {_CALL_ADVICE}{approval}",
        input_schema=schema,
        annotations=types.ToolAnnotations(
            title=contract.name,
            read_only_hint=False,
            destructive_hint=True,  # a consequential action: the reason it is in an outbox
            idempotent_hint=True,  # the intent key makes a repeated call the same operation
            open_world_hint=True,  # it acts on a remote service
        ),
    )


def _what(contract: ToolContract) -> str:
    """The tool's own description (TOML ``description``, the ``@tool`` docstring), else its name."""
    if contract.description:
        return contract.description.strip()
    return f"The {contract.name} action."


def _payload_schema(contract: ToolContract) -> dict[str, Any]:
    if contract.input_schema is None:
        return dict(_FREE_PAYLOAD)
    payload = copy.deepcopy(dict(contract.input_schema))
    payload.setdefault("description", f"The {contract.name} action's input.")
    return payload


def status_tool() -> types.Tool:
    """``outbox_status``: one of the caller's operations, by id or by intent key."""
    return types.Tool(
        name=STATUS_TOOL,
        title="Outbox: status of an action",
        description=(
            "The current outcome of one of your actions, by operation_id or by intent_key "
            "(give one): whether it happened, did not, or is still being settled. Use it to "
            "check on an action that was not settled, instead of calling the tool again."
        ),
        input_schema={
            "type": "object",
            "properties": {
                "operation_id": {"type": "string", "description": "The operation's id."},
                "intent_key": {
                    "type": "string",
                    "description": "The intent_key the action was called with.",
                },
                "wait_s": {
                    "type": "number",
                    "minimum": 0,
                    "description": "Wait up to this many seconds for it to settle (default 0).",
                },
            },
            "additionalProperties": False,
        },
        annotations=types.ToolAnnotations(
            title="Outbox: status of an action",
            read_only_hint=True,
            idempotent_hint=True,
            open_world_hint=False,
        ),
    )


def list_tool() -> types.Tool:
    """``outbox_list``: the caller's operations, newest first."""
    return types.Tool(
        name=LIST_TOOL,
        title="Outbox: your actions",
        description="Your actions, newest first, optionally only those in one state.",
        input_schema={
            "type": "object",
            "properties": {
                "state": {"type": "string", "enum": [state.value for state in State]},
                "limit": {"type": "integer", "minimum": 1, "maximum": MAX_LIST_LIMIT},
            },
            "additionalProperties": False,
        },
        annotations=types.ToolAnnotations(
            title="Outbox: your actions",
            read_only_hint=True,
            idempotent_hint=True,
            open_world_hint=False,
        ),
    )


def tool_intent(arguments: Mapping[str, Any] | None) -> ToolIntent:
    """The intent a registered tool's call carries; :class:`ArgumentRefused` names the field
    that is missing, of the wrong type or not one of the tool's arguments."""
    given = dict(arguments or {})
    _refuse_unknown(given, ("intent_key", "target", "payload"))
    key = given.get("intent_key")
    if not isinstance(key, str) or not key.strip():
        raise ArgumentRefused(
            "intent_key is required: a non-empty string that names this action across "
            "retries (e.g. '<conversation id>/<step>')",
            field="intent_key",
        )
    target = given.get("target")
    if not isinstance(target, str):
        raise ArgumentRefused("target is required: a non-empty string", field="target")
    if "payload" not in given:
        raise ArgumentRefused("payload is required: a JSON object", field="payload")
    return ToolIntent(intent_key=key, target=target, payload=given["payload"])


@dataclass(frozen=True, slots=True)
class StatusQuery:
    """``outbox_status``'s arguments: exactly one of the id and the key."""

    operation_id: str | None
    intent_key: str | None
    wait_s: float


def status_query(arguments: Mapping[str, Any] | None) -> StatusQuery:
    """``outbox_status``'s arguments, or :class:`ArgumentRefused` naming the field."""
    given = dict(arguments or {})
    _refuse_unknown(given, ("operation_id", "intent_key", "wait_s"))
    operation_id, key = given.get("operation_id"), given.get("intent_key")
    if (operation_id is None) == (key is None):
        raise ArgumentRefused(
            "give exactly one of operation_id and intent_key", field="operation_id"
        )
    for name, value in (("operation_id", operation_id), ("intent_key", key)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ArgumentRefused(f"{name} must be a non-empty string", field=name)
    wait_s = given.get("wait_s", 0)
    if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or not wait_s >= 0:
        raise ArgumentRefused("wait_s must be a number of seconds >= 0", field="wait_s")
    return StatusQuery(operation_id=operation_id, intent_key=key, wait_s=float(wait_s))


@dataclass(frozen=True, slots=True)
class ListQuery:
    """``outbox_list``'s arguments."""

    state: State | None
    limit: int


def list_query(arguments: Mapping[str, Any] | None) -> ListQuery:
    """``outbox_list``'s arguments, or :class:`ArgumentRefused` naming the field."""
    given = dict(arguments or {})
    _refuse_unknown(given, ("state", "limit"))
    state = given.get("state")
    try:
        checked = None if state is None else State(state)
    except ValueError:
        names = ", ".join(s.value for s in State)
        raise ArgumentRefused(f"state {state!r} is not one of {names}", field="state") from None
    limit = given.get("limit", 20)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise ArgumentRefused(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}", field="limit")
    return ListQuery(state=checked, limit=limit)


def _refuse_unknown(given: Mapping[str, Any], known: tuple[str, ...]) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ArgumentRefused(
            f"unknown argument {unknown[0]!r}; the arguments are {', '.join(known)}",
            field=unknown[0],
        )
