"""Make text and JSON that came from a remote storable, before it reaches a column.

PostgreSQL refuses a NUL character in ``text`` (and ``\\u0000`` in ``jsonb``), a lone UTF-16
surrogate (what Python keeps of bytes that were not UTF-8, ``surrogateescape``, or of a JSON
``"\\ud800"``), and ``NaN``/``Infinity`` in ``jsonb``. A remote that answers with any of them
made the write that records the answer raise, and the answer was lost (issue 17). Every value
from outside that is stored (``last_error``, ``remote_ref``, ``result``, an event's
``reason`` and ``detail``, a webhook's reason and error) passes through here, in
:mod:`outbox.transitions` and the statements that write those columns.

Escapes are visible, so a person sees that something was replaced: NUL becomes ``\\x00``, a
byte that was not UTF-8 ``\\xNN``, any other lone surrogate ``\\uNNNN``. Lengths are bounded
(:data:`MAX_TEXT_CHARS`, :data:`MAX_JSON_CHARS`) so a remote cannot grow a row without limit.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

#: Longest reason, error or remote_ref kept, in characters. These are read by people (an
#: HTTP tool already quotes at most 200 characters of a body): 2,000 holds a reason, a quoted
#: excerpt and an exception's first line with room to spare, and keeps an event row well under
#: PostgreSQL's inline (TOAST) threshold so a chatty remote cannot bloat the audit log.
MAX_TEXT_CHARS = 2000
#: Longest ``result`` kept, as compact JSON text. The remote's answer is kept for the operator
#: (and the agent, through ``outbox.wait``); 64 KiB holds any ordinary API answer, while a
#: larger one is replaced by an excerpt rather than stored whole on every operation.
MAX_JSON_CHARS = 65536
#: Appended to a value that was cut at its bound.
TRUNCATED = "…[truncated]"
#: Key of the object that stands for a ``result`` too large to keep.
TRUNCATED_KEY = "outbox_truncated"

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def unstorable_text(value: Any) -> str | None:
    """The first string in ``value`` (a string, or JSON: keys and values, nested) that
    PostgreSQL cannot store as it is (a NUL, a lone surrogate), or ``None``: input is
    refused with it named, where a remote's answer is escaped by :func:`text`."""
    if isinstance(value, str):
        return value if _UNSTORABLE.search(value) else None
    if isinstance(value, Mapping):
        items: Any = [item for pair in value.items() for item in pair]
    elif isinstance(value, list | tuple):
        items = value
    else:
        return None
    for item in items:
        found = unstorable_text(item)
        if found is not None:
            return found
    return None


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code == 0:
        return "\\x00"
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape: a byte that was not valid UTF-8
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}"


def text(value: str, *, limit: int | None = MAX_TEXT_CHARS) -> str:
    """``value`` with NUL and lone surrogates escaped, cut to ``limit`` characters."""
    # The common case (ASCII without NUL) needs no scan.
    plain = value.isascii() and "\x00" not in value
    escaped = value if plain else _UNSTORABLE.sub(_escape, value)
    if limit is not None and len(escaped) > limit:
        return escaped[: max(0, limit - len(TRUNCATED))] + TRUNCATED
    return escaped


def optional_text(value: str | None, *, limit: int | None = MAX_TEXT_CHARS) -> str | None:
    """:func:`text`, passing ``None`` through."""
    return None if value is None else text(value, limit=limit)


def json_value(value: Any, *, limit: int = MAX_JSON_CHARS) -> Any:
    """A JSON value ``jsonb`` accepts: strings (and keys) escaped as by :func:`text`,
    non-finite numbers and non-JSON objects as strings, and a value whose JSON text is longer
    than ``limit`` replaced by ``{"outbox_truncated": true, "size": N, "excerpt": "…"}``."""
    clean = _clean(value)
    if isinstance(clean, (bool, int, float)) or clean is None:
        return clean
    encoded = json.dumps(clean, ensure_ascii=False, separators=(",", ":"))
    if len(encoded) <= limit:
        return clean
    return {TRUNCATED_KEY: True, "size": len(encoded), "excerpt": text(encoded)}


def json_mapping(value: Mapping[str, Any], *, limit: int = MAX_JSON_CHARS) -> dict[str, Any]:
    """:func:`json_value` of a mapping (an event's ``detail``), still a dict."""
    clean = json_value(dict(value), limit=limit)
    return clean if isinstance(clean, dict) else {"value": clean}


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return text(value, limit=None)
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, Mapping):
        return {text(str(key), limit=None): _clean(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(item) for item in value]
    # A Python tool may hand back anything; its text is what a person can use.
    return text(str(value), limit=None)


def error_summary(exc: BaseException) -> str:
    """An exception's class and the first line of its message, storable and short.

    For a database error, the driver's own message (SQLAlchemy's text would add the bound
    parameters, and a constraint's DETAIL line the row: payloads must not reach a log).
    """
    inner = getattr(exc, "orig", None)
    source = inner if isinstance(inner, BaseException) else exc
    lines = str(source).strip().splitlines()
    first = lines[0] if lines else ""
    name = type(source).__name__
    return text(f"{name}: {first}" if first else name, limit=300)
