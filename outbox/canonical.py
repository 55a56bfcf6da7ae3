"""Canonical JSON for payloads, so one intent always hashes the same.

We use the JSON Canonicalization Scheme (RFC 8785) through the ``rfc8785`` library: object
keys sorted by UTF-16 code units, no whitespace, strings as UTF-8 without normalisation,
numbers rendered as ECMAScript does. The consequences, decided here and documented in
``docs/payloads.md``:

* ``1`` and ``1.0`` are the same number (JSON has only one number type), so they hash alike;
* integers must lie within ±(2**53 - 1), the range every JSON reader represents exactly;
  send larger ones (snowflake ids, big amounts) as strings. A float of larger magnitude is
  refused too: it is an integer in JSON (``2.0**53`` is written ``9007199254740992``, which
  PostgreSQL's ``jsonb`` and Python read back as an integer that this rule refuses);
* NaN and infinities are not JSON and are refused;
* ``"é"`` precomposed and ``"é"`` decomposed are different strings and hash differently.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from typing import Any

import rfc8785

#: The largest integer every JSON reader represents exactly.
MAX_SAFE_INTEGER = 2**53 - 1


class NotCanonicalizable(ValueError):
    """The value cannot be represented as canonical JSON."""


def canonical_json(value: Any) -> bytes:
    """``value`` as RFC 8785 canonical JSON bytes, or :class:`NotCanonicalizable`."""
    try:
        _refuse_unsafe_floats(value)
        return bytes(rfc8785.dumps(value))
    except NotCanonicalizable:
        raise
    except rfc8785.IntegerDomainError as exc:
        raise NotCanonicalizable(
            f"{exc}; integers beyond ±(2**53-1) lose precision in JSON, send them as strings"
        ) from exc
    except rfc8785.CanonicalizationError as exc:
        raise NotCanonicalizable(str(exc)) from exc
    except (TypeError, ValueError, RecursionError) as exc:
        raise NotCanonicalizable(f"not JSON-serialisable: {exc}") from exc


def _refuse_unsafe_floats(value: Any) -> None:
    # rfc8785 checks only ints; a float this large is written as the same unsafe integer.
    if isinstance(value, float):
        if math.isfinite(value) and abs(value) > MAX_SAFE_INTEGER:
            raise NotCanonicalizable(
                f"{value!r} is beyond ±(2**53-1): numbers this large are integers in JSON and "
                "lose precision, send them as strings"
            )
    elif isinstance(value, Mapping):
        for item in value.values():
            _refuse_unsafe_floats(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _refuse_unsafe_floats(item)


def payload_hash(canonical: bytes) -> str:
    """The sha256 hex digest that identifies a canonical payload."""
    return hashlib.sha256(canonical).hexdigest()


def intent_hash(tool: str, target: str, payload_hash: str) -> str:
    """The sha256 hex digest of what an operation does: its tool, target and payload hash.

    UTF-8 bytes separated by a NUL byte, which PostgreSQL text cannot hold, so two different
    triples never share an encoding; the SQL function ``outbox.intent_hash`` (migration
    0010) computes the same digest.
    """
    return hashlib.sha256(b"\0".join(v.encode() for v in (tool, target, payload_hash))).hexdigest()
