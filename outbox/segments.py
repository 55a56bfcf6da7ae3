"""Dot segments: values that would move a URL's path if a remote resolved them (issue 32).

Values from agents become URL path segments: an HTTP tool's ``{target}`` and ``{intent_key}``
placeholders, the saga key in a console or API link. Each is percent-encoded as one segment,
but encoding cannot hide a dot segment: WHATWG URL parsing (browsers, Node's ``URL``) resolves
``.``, ``..`` and their ``%2E`` forms in any case mix, some servers and proxies decode ``%2F``
(or ``\\``) to a separator before resolving, and some decode twice (``%252E``). So such a
value is refused where it enters (enqueue, saga creation), naming the field, rather than
trusted to every remote's parser.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

#: What a path segment that navigates is, once decoded.
DOT_SEGMENTS = frozenset({".", ".."})
#: What some remotes take as a path separator once decoded (``\\`` in WHATWG special URLs).
_SEPARATORS = re.compile(r"[/\\]")


def has_dot_segment(value: str) -> bool:
    """Whether ``value``, as written or percent-decoded any number of times, has a ``.`` or
    ``..`` part between separators (``/`` or ``\\``): ``..``, ``%2e%2E``, ``.%2E``,
    ``%252E``, ``a/../b`` and ``a%2F..`` do; ``...``, ``.a`` and ``v1.2`` do not."""
    text = value
    while True:
        if any(part in DOT_SEGMENTS for part in _SEPARATORS.split(text)):
            return True
        decoded = unquote(text)
        if decoded == text:  # each decoding that changes the text shortens it: this ends
            return False
        text = decoded


def dot_segment_refusal(field: str) -> str:
    """The message refusing ``field`` for a dot segment (the value is not repeated)."""
    return (
        f"{field} has a '.' or '..' path segment (also when percent-encoded, '%2E', or between "
        "'/' or '\\'): a URL built from it could reach another path; choose another"
    )
