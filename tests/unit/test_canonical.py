"""Canonical JSON (RFC 8785) and the payload hash: one intent always hashes the same.

Decision recorded here and in ``outbox/canonical.py``: JSON has a single number type, so
``1`` and ``1.0`` are the same number, serialise alike (``1``) and hash alike, as RFC 8785
prescribes. An agent that sends ``{"amount": 1}`` and later ``{"amount": 1.0}`` under one
intent key gets its operation back, not an ``IntentConflict``.
"""

from __future__ import annotations

import datetime
import json
import math
import random
from collections.abc import Callable, Iterable
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.canonical import MAX_SAFE_INTEGER, NotCanonicalizable, canonical_json, payload_hash


def digest(value: Any) -> str:
    """The payload hash of ``value``."""
    return payload_hash(canonical_json(value))


def test_key_order_does_not_change_the_hash() -> None:
    """Objects with the same members in another insertion order hash the same."""
    assert digest({"a": 1, "b": 2, "c": 3}) == digest({"c": 3, "a": 1, "b": 2})


def test_nested_key_order_does_not_change_the_hash() -> None:
    """Key order is irrelevant at every depth, including objects inside arrays."""
    one = {"outer": {"y": [{"q": 1, "p": 2}], "x": True}, "z": None}
    other = {"z": None, "outer": {"x": True, "y": [{"p": 2, "q": 1}]}}
    assert canonical_json(one) == canonical_json(other)
    assert digest(one) == digest(other)


def test_array_order_changes_the_hash() -> None:
    """Arrays are ordered, so reordering their items is a different payload."""
    assert digest({"a": [1, 2]}) != digest({"a": [2, 1]})


def test_output_has_sorted_keys_and_no_whitespace() -> None:
    """The canonical form sorts keys and has no insignificant whitespace."""
    assert canonical_json({"b": [1, 2], "a": {"d": "x y", "c": None}}) == (
        b'{"a":{"c":null,"d":"x y"},"b":[1,2]}'
    )


def test_keys_sort_by_utf16_code_units() -> None:
    """Keys sort by UTF-16 code units, so an astral character precedes U+FFFD (RFC 8785 3.2.3)."""
    assert canonical_json({"\ufffd": 1, "\U0001f600": 2}) == (
        '{"\U0001f600":2,"\ufffd":1}'.encode()
    )


def test_precomposed_and_decomposed_unicode_differ() -> None:
    """Precomposed and decomposed "é" are different strings: no normalisation, different hashes."""
    precomposed, decomposed = "\u00e9", "e\u0301"
    assert digest({"name": precomposed}) != digest({"name": decomposed})
    assert digest({precomposed: 1}) != digest({decomposed: 1})


def test_non_ascii_is_emitted_as_utf8() -> None:
    """Non-ASCII characters are written as raw UTF-8 bytes, never as \\u escapes."""
    assert canonical_json({"k": "é😀"}) == '{"k":"é😀"}'.encode()
    assert b"\\u" not in canonical_json({"k": "é😀"})


def test_control_characters_are_escaped() -> None:
    """Control characters inside strings are escaped as JSON requires."""
    assert canonical_json({"k": "a\nb\u0001"}) == b'{"k":"a\\nb\\u0001"}'


@pytest.mark.parametrize(
    ("integer", "floating"), [(1, 1.0), (0, -0.0), (-7, -7.0), (MAX_SAFE_INTEGER, 2.0**53 - 1)]
)
def test_integers_and_equal_floats_hash_the_same(integer: int, floating: float) -> None:
    """An integer and the float of the same value serialise and hash alike (RFC 8785 numbers)."""
    assert canonical_json({"v": integer}) == canonical_json({"v": floating})
    assert digest({"v": integer}) == digest({"v": floating})


def test_booleans_are_not_numbers() -> None:
    """``true`` and ``1`` are different JSON values and hash differently."""
    assert digest({"v": True}) != digest({"v": 1})


def test_floats_are_rendered_as_ecmascript_does() -> None:
    """Floats use the shortest ECMAScript form: 0.1 stays 0.1, 0.0000001 becomes 1e-7."""
    assert canonical_json({"a": 0.1, "b": 0.0000001, "c": 1.5}) == b'{"a":0.1,"b":1e-7,"c":1.5}'


@pytest.mark.parametrize("edge", [MAX_SAFE_INTEGER, -MAX_SAFE_INTEGER])
def test_largest_safe_integers_are_accepted(edge: int) -> None:
    """Integers at ±(2**53 - 1) are exactly representable everywhere and accepted."""
    assert canonical_json({"v": edge}) == f'{{"v":{edge}}}'.encode()


@pytest.mark.parametrize("big", [2**53, -(2**53), 2**64, 10**30])
def test_integers_beyond_the_safe_range_are_refused(big: int) -> None:
    """Integers beyond ±(2**53 - 1) are refused with advice to send them as strings."""
    with pytest.raises(NotCanonicalizable, match="as strings"):
        canonical_json({"v": big})


@pytest.mark.parametrize("big", [2.0**53, -(2.0**53), 1e20, 4.426340212470694e16, 1e300])
def test_floats_beyond_the_safe_range_are_refused(big: float) -> None:
    """A float beyond ±(2**53 - 1) is an integer in JSON, so it is refused like that integer."""
    with pytest.raises(NotCanonicalizable, match="as strings"):
        canonical_json({"nested": [{"v": big}]})


@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf])
def test_nan_and_infinities_are_refused(number: float) -> None:
    """NaN and infinities are not JSON and are refused."""
    with pytest.raises(NotCanonicalizable):
        canonical_json({"v": number})


@pytest.mark.parametrize("key", [1, 1.5, None, True, ("a",)])
def test_non_string_keys_are_refused(key: Any) -> None:
    """Object keys must be strings: nothing is silently converted to one."""
    with pytest.raises(NotCanonicalizable):
        canonical_json({key: "x"})


@pytest.mark.parametrize(
    "value",
    [
        datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
        datetime.date(2026, 1, 1),
        {1, 2},
        frozenset({"a"}),
        b"bytes",
        Decimal("1.5"),
        object(),
    ],
    ids=lambda value: type(value).__name__,
)
def test_non_json_types_are_refused(value: Any) -> None:
    """Values JSON cannot express (datetime, set, bytes, Decimal, ...) raise NotCanonicalizable."""
    with pytest.raises(NotCanonicalizable):
        canonical_json({"v": value})


def test_not_canonicalizable_is_a_value_error() -> None:
    """NotCanonicalizable is a ValueError, so generic input validation catches it."""
    assert issubclass(NotCanonicalizable, ValueError)


def test_payload_hash_is_sha256_hex() -> None:
    """The payload hash is the lowercase sha256 hex digest of the canonical bytes."""
    assert payload_hash(b"{}") == (
        "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
    )


# Hypothesis: JSON that every reader represents exactly (safe integers, floats in that range).
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-MAX_SAFE_INTEGER, max_value=MAX_SAFE_INTEGER)
    | st.floats(min_value=-MAX_SAFE_INTEGER, max_value=MAX_SAFE_INTEGER)
    | st.text(max_size=10)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=25,
)
json_objects = st.dictionaries(st.text(max_size=6), json_values, max_size=6)


def rebuilt(value: Any, order: Callable[[list[str]], Iterable[str]]) -> Any:
    """``value`` with every object rebuilt, its keys inserted in ``order(keys)``."""
    if isinstance(value, dict):
        return {key: rebuilt(value[key], order) for key in order(list(value))}
    if isinstance(value, list):
        return [rebuilt(item, order) for item in value]
    return value


@given(json_objects)
def test_hash_is_invariant_under_reversed_key_order(payload: dict[str, Any]) -> None:
    """Rebuilding every object with its keys inserted in reverse order keeps the hash."""
    assert digest(rebuilt(payload, reversed)) == digest(payload)


@given(json_objects, st.randoms(use_true_random=False))
def test_hash_is_invariant_under_shuffled_key_order(
    payload: dict[str, Any], rng: random.Random
) -> None:
    """Rebuilding every object with its keys inserted in a random order keeps the hash."""
    shuffled = rebuilt(payload, lambda keys: rng.sample(keys, len(keys)))
    assert digest(shuffled) == digest(payload)


@given(json_objects)
def test_canonical_json_round_trips(payload: dict[str, Any]) -> None:
    """Canonical JSON parses back to a value equal to the original."""
    assert json.loads(canonical_json(payload)) == payload


@given(json_objects)
def test_canonical_json_is_a_fixed_point(payload: dict[str, Any]) -> None:
    """Canonicalising the parsed canonical form yields the same bytes."""
    once = canonical_json(payload)
    assert canonical_json(json.loads(once)) == once


@given(st.floats(allow_nan=False).filter(lambda number: abs(number) > MAX_SAFE_INTEGER))
def test_floats_beyond_the_safe_range_are_always_refused(number: float) -> None:
    """Every float (or infinity) beyond ±(2**53 - 1) is refused, so canonical text stays safe."""
    with pytest.raises(NotCanonicalizable):
        canonical_json({"v": number})


@given(st.integers(min_value=-MAX_SAFE_INTEGER, max_value=MAX_SAFE_INTEGER))
def test_safe_integers_hash_like_their_floats(integer: int) -> None:
    """Every safe integer hashes like the float of the same value."""
    assert digest({"v": integer}) == digest({"v": float(integer)})
