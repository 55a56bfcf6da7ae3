"""outbox.storable: what comes from a remote is made storable, visibly and within bounds."""

from __future__ import annotations

import json

from sqlalchemy.exc import IntegrityError

from outbox import storable


def test_plain_text_is_unchanged() -> None:
    """ASCII and valid Unicode without NUL come back as they were."""
    assert storable.text("HTTP 503: try later") == "HTTP 503: try later"
    assert storable.text("déjà vu \U0001f600") == "déjà vu \U0001f600"


def test_nul_and_bytes_that_are_not_utf8_are_escaped_visibly() -> None:
    """NUL becomes \\x00, a surrogate-escaped byte \\xNN, any other lone surrogate \\uNNNN."""
    decoded = b"a\x00b\xffc".decode("utf-8", errors="surrogateescape")
    assert storable.text(decoded) == "a\\x00b\\xffc"
    assert storable.text("x\ud800y") == "x\\ud800y"


def test_text_is_cut_at_its_bound_with_a_mark() -> None:
    """A text longer than the bound is cut to exactly the bound, ending with the mark."""
    cut = storable.text("y" * 10_000)
    assert len(cut) == storable.MAX_TEXT_CHARS
    assert cut.endswith(storable.TRUNCATED)
    assert storable.text("z" * 50, limit=None) == "z" * 50


def test_json_values_are_cleaned_throughout() -> None:
    """Strings and keys at any depth are escaped; NaN, infinities and other objects become text."""
    value = {"a\x00": ["x\x00", {"n": float("nan")}, float("-inf"), 1, True, None, 2.5], "o": {1}}
    assert storable.json_value(value) == {
        "a\\x00": ["x\\x00", {"n": "nan"}, "-inf", 1, True, None, 2.5],
        "o": "{1}",
    }


def test_a_json_value_past_its_bound_is_replaced_by_an_excerpt() -> None:
    """A result whose JSON text is over the bound is stored as a marked excerpt with its size."""
    big = {"blob": "q" * (storable.MAX_JSON_CHARS + 10)}
    kept = storable.json_value(big)
    assert kept[storable.TRUNCATED_KEY] is True
    assert kept["size"] == len(json.dumps(big, separators=(",", ":")))
    assert len(kept["excerpt"]) == storable.MAX_TEXT_CHARS


def test_an_error_summary_leaves_out_bound_parameters_and_detail_lines() -> None:
    """A database error is summarised by the driver's class and first line only."""

    class DriverError(Exception):
        pass

    orig = DriverError(
        'new row violates check constraint "ck"\nDETAIL:  Failing row contains (secret)'
    )
    exc = IntegrityError("INSERT ...", {"payload": "secret"}, orig)
    summary = storable.error_summary(exc)
    assert summary == 'DriverError: new row violates check constraint "ck"'
    assert "secret" not in summary
