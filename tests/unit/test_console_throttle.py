"""The console's sign-in throttle: per name and per client address, in one process."""

from __future__ import annotations

from outbox.web.console.session import Throttle


def test_five_failures_for_a_name_lock_it_from_any_address() -> None:
    """After `limit` failures for a name, that name is refused, naming the name as the limit."""
    throttle = Throttle(limit=5, lockout_s=60)
    for n in range(5):
        assert throttle.refusal(name="alice", address=f"10.0.0.{n}") is None
        throttle.failed(name="alice", address=f"10.0.0.{n}")
    refused = throttle.refusal(name="alice", address="10.0.0.99")
    assert refused is not None
    assert refused.what == "this name"
    assert 1 <= refused.retry_after_s <= 61
    assert throttle.refusal(name="bob", address="10.0.0.99") is None


def test_five_failures_from_an_address_lock_it_for_every_name() -> None:
    """One address guessing many names is refused for all of them."""
    throttle = Throttle(limit=5)
    for n in range(5):
        throttle.failed(name=f"user{n}", address="192.0.2.7")
    refused = throttle.refusal(name="someone-else", address="192.0.2.7")
    assert refused is not None
    assert refused.what == "this address"


def test_a_success_clears_the_names_failures_not_the_addresses() -> None:
    """A successful sign-in forgets the name's failures; the address's are kept."""
    throttle = Throttle(limit=2)
    throttle.failed(name="alice", address="a")
    throttle.succeeded(name="alice")
    throttle.failed(name="alice", address="b")
    assert throttle.refusal(name="alice", address="c") is None
    throttle.failed(name="carol", address="a")
    assert throttle.refusal(name="dave", address="a") is not None


def test_a_lockout_ends_and_old_failures_leave_the_window() -> None:
    """With no lockout and no window, failures never lock anything."""
    throttle = Throttle(limit=1, window_s=0.0, lockout_s=0.0)
    throttle.failed(name="alice", address="a")
    assert throttle.refusal(name="alice", address="a") is None


def test_the_keys_kept_are_bounded() -> None:
    """No more than `max_keys` keys are remembered: the stalest go first."""
    throttle = Throttle(limit=1, max_keys=10)
    for n in range(100):
        throttle.failed(name=f"n{n}", address=f"a{n}")
    assert len(throttle._failures) == 10
