"""A tool's declared payload schema (``input_schema``): checked when declared, then at enqueue.

A tool may declare the JSON Schema its payload must match (TOML ``input_schema``, or
``@tool(input_schema=...)``). The schema is checked once, when the contract is built, so a
broken one stops the process at start-up naming the tool; a payload is checked at ``enqueue``
in any process that knows the tool's contract (one that loaded the tools: workers, the HTTP
API and the MCP server when configured with them, an agent that called ``load_tools``), and is
refused with :class:`~outbox.errors.PayloadInvalid` naming the path (``payload.amount``),
before anything is written.

Error messages name the path, the schema keyword and what the schema asks for, never the
payload's values: a payload may hold secrets, and refusals are logged and shown to models.
The ``jsonschema`` library does the checking; no remote ``$ref`` is ever fetched (its
``referencing`` registry retrieves nothing unless told to).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping
from typing import Any

from jsonschema import exceptions, validators
from jsonschema.protocols import Validator

from outbox.errors import PayloadInvalid

#: The dialect of a schema that names none (``$schema``): the one MCP and OpenAPI 3.1 use.
DEFAULT_DIALECT = validators.Draft202012Validator
#: Keywords whose standard message names only schema parts or property names, never values.
_SAFE_MESSAGES = frozenset({"additionalProperties", "unevaluatedProperties", "propertyNames"})
#: Keywords a substituted string cannot turn from failing to passing: they judge a value's
#: type, or an object's or array's keys and size, never what a string inside says.
_SHAPE_KEYWORDS = frozenset(
    {
        "type",
        "required",
        "dependentRequired",
        "minProperties",
        "maxProperties",
        "additionalProperties",
        "unevaluatedProperties",
        "propertyNames",
        "minItems",
        "maxItems",
    }
)
#: How much of a schema value a message quotes.
_QUOTE_LIMIT = 120


def schema_problem(schema: object) -> str | None:
    """Why ``schema`` is not a usable JSON Schema, or ``None`` if it is."""
    if not isinstance(schema, Mapping):
        return f"input_schema must be a table (a JSON Schema object), not {type(schema).__name__}"
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        return f"input_schema must hold JSON values only: {exc}"
    try:
        validators.validator_for(schema, default=DEFAULT_DIALECT).check_schema(dict(schema))
    except exceptions.SchemaError as exc:
        where = "/".join(str(part) for part in exc.path) or "the top"
        return f"input_schema is not a valid JSON Schema (at {where}): {exc.message}"
    remote = next(_remote_references(schema), None)
    if remote is not None:
        return (
            f"input_schema refers to {remote!r}: only references inside the schema ('#/...') "
            "are allowed; nothing is ever fetched"
        )
    return None


def _remote_references(node: object) -> Iterator[str]:
    """Every ``$ref``/``$dynamicRef`` that does not point inside the schema itself: at
    enqueue such a reference could only fail (the library fetches nothing), so it is refused
    when the contract is built."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            if key in ("$ref", "$dynamicRef") and isinstance(value, str):
                if not value.startswith("#"):
                    yield value
            else:
                yield from _remote_references(value)
    elif isinstance(node, list):
        for item in node:
            yield from _remote_references(item)


def check_payload(
    tool: str,
    schema: Mapping[str, Any],
    payload: dict[str, Any],
    *,
    unresolved: str | None = None,
) -> None:
    """Raise :class:`PayloadInvalid` unless ``payload`` matches the tool's ``schema``.

    ``payload`` is the JSON value as stored (parsed canonical JSON). The error names the
    first offending path the way the library ranks them (its ``best_match``).

    ``unresolved``: a text standing for a value not known yet (a saga compensation's
    ``"{remote_ref}"``). A failure that depends on what a string holding it will say
    (``pattern``, ``enum``, ``format``...) is not judged now: it is judged, substituted, when
    the payload is enqueued. Every other failure (a field missing, a number where a string
    belongs, a key too many) is refused at once.
    """
    validator = _validator(json.dumps(schema, sort_keys=True))
    errors = validator.iter_errors(payload)
    if unresolved is not None:
        errors = (
            e
            for e in errors
            if e.validator in _SHAPE_KEYWORDS or not _holds(e.instance, unresolved)
        )
    error = exceptions.best_match(errors)
    if error is None:
        return
    field = _field(error)
    raise PayloadInvalid(
        f"payload does not match the input_schema of tool {tool!r}: {field} {_what(error)}; "
        "nothing was written",
        field=field,
        keyword=str(error.validator),
    )


def _holds(value: object, text: str) -> bool:
    """Whether ``text`` is inside a string of ``value``, at any depth."""
    if isinstance(value, str):
        return text in value
    if isinstance(value, Mapping):
        return any(_holds(item, text) for item in value.values())
    if isinstance(value, list):
        return any(_holds(item, text) for item in value)
    return False


@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Validator:
    # Keyed by the schema's JSON text so a contract replaced with another schema (a reload)
    # never meets a stale validator. Building one is 10-100x the cost of one small check.
    schema = json.loads(schema_json)
    cls = validators.validator_for(schema, default=DEFAULT_DIALECT)
    return cls(schema)


def _field(error: exceptions.ValidationError) -> str:
    path = list(error.absolute_path)
    wanted = error.validator_value
    if error.validator == "required" and isinstance(error.instance, Mapping):
        names = wanted if isinstance(wanted, list) else []
        missing = [name for name in names if name not in error.instance]
        path.extend(missing[:1])
    field = "payload"
    for part in path:
        field += f"[{part}]" if isinstance(part, int) else f".{part}"
    return field


def _what(error: exceptions.ValidationError) -> str:
    if error.validator == "required":
        return "is required"
    if error.validator in _SAFE_MESSAGES:
        return f"fails {error.validator}: {error.message}"
    wanted = json.dumps(error.validator_value, sort_keys=True)
    if len(wanted) > _QUOTE_LIMIT:
        wanted = wanted[: _QUOTE_LIMIT - 1] + "…"
    return f"fails {error.validator}: {wanted}"
