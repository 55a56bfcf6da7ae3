"""Intent keys built from a run's durable identity (outbox.integrations.keys)."""

from __future__ import annotations

import pytest

from outbox.api import MAX_INTENT_KEY_LENGTH
from outbox.integrations.keys import durable_intent_key


def test_the_same_call_gets_the_same_key_and_another_call_another() -> None:
    """The key depends on run, step, tool and ordinal only, and each part changes it."""
    key = durable_intent_key(run_id="thread-7", step="charge", tool="billing.charge", ordinal=0)
    assert key == "thread-7:charge:billing.charge:0"
    assert key == durable_intent_key(
        run_id="thread-7", step="charge", tool="billing.charge", ordinal=0
    )
    others = {
        durable_intent_key(run_id="thread-8", step="charge", tool="billing.charge", ordinal=0),
        durable_intent_key(run_id="thread-7", step="refund", tool="billing.charge", ordinal=0),
        durable_intent_key(run_id="thread-7", step="charge", tool="billing.refund", ordinal=0),
        durable_intent_key(run_id="thread-7", step="charge", tool="billing.charge", ordinal=1),
    }
    assert key not in others
    assert len(others) == 4


def test_a_long_key_keeps_a_prefix_and_stays_distinct() -> None:
    """A key over the limit is cut to the limit with a hash of the whole, still distinct."""
    long_run = "r" * 400
    a = durable_intent_key(run_id=long_run, step="s", tool="t", ordinal=0)
    b = durable_intent_key(run_id=long_run, step="s", tool="t", ordinal=1)
    assert len(a) == len(b) == MAX_INTENT_KEY_LENGTH
    assert a.startswith("rrrr")
    assert a != b


@pytest.mark.parametrize(
    ("run_id", "ordinal", "message"),
    [("", 0, "run_id must not be empty"), ("t", -1, "ordinal must not be negative")],
)
def test_refuses_what_cannot_be_durable(run_id: str, ordinal: int, message: str) -> None:
    """An empty run id or a negative ordinal is refused with the argument named."""
    with pytest.raises(ValueError, match=message):
        durable_intent_key(run_id=run_id, step="s", tool="t", ordinal=ordinal)
