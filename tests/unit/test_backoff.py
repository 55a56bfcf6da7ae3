"""outbox.backoff: the one capped, doubling, jittered wait."""

from __future__ import annotations

import math

import pytest

from outbox.backoff import JITTER, Backoff, exponential_s, jittered


def test_exponential_doubles_from_base_and_is_capped() -> None:
    """base after the first failure, doubling per failure, never above max."""
    waits = [exponential_s(n, base_s=1.0, max_s=60.0) for n in range(1, 10)]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]


def test_exponential_treats_no_failure_as_the_first_and_never_overflows() -> None:
    """0 or fewer failures wait base; a huge count neither overflows nor exceeds the cap."""
    assert exponential_s(0, base_s=5.0, max_s=300.0) == 5.0
    assert exponential_s(-3, base_s=5.0, max_s=300.0) == 5.0
    assert exponential_s(10**9, base_s=5.0, max_s=300.0) == 300.0
    assert math.isfinite(exponential_s(10**9, base_s=5.0, max_s=math.inf))


def test_jitter_stays_within_its_spread_and_varies() -> None:
    """±20 %, never negative, and not the same every time."""
    samples = [jittered(10.0) for _ in range(500)]
    assert all(10.0 * (1 - JITTER) <= s <= 10.0 * (1 + JITTER) for s in samples)
    assert len(set(samples)) > 100
    assert jittered(0.0) == 0.0


def test_loop_backoff_doubles_per_failure_and_resets_on_success() -> None:
    """next_s doubles up to the cap; reset starts again from base."""
    backoff = Backoff(base_s=0.5, max_s=2.0, jitter=False)
    assert [backoff.next_s() for _ in range(4)] == [0.5, 1.0, 2.0, 2.0]
    backoff.reset()
    assert backoff.next_s() == 0.5


@pytest.mark.parametrize("failures", [1, 2, 5])
def test_loop_backoff_jitters_by_default(failures: int) -> None:
    """With jitter, each wait is within the spread of the doubling value."""
    backoff = Backoff(base_s=1.0, max_s=30.0)
    for _ in range(failures - 1):
        backoff.next_s()
    expected = exponential_s(failures, base_s=1.0, max_s=30.0)
    assert expected * (1 - JITTER) <= backoff.next_s() <= expected * (1 + JITTER)
