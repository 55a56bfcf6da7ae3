"""Capped exponential backoff with jitter: the one formula every retry in the outbox uses.

A wait doubles with each failure from ``base_s`` up to ``max_s``; :func:`jittered` spreads
it by ±20 % so that many rows or processes that failed together (a remote's outage, a
database restart) do not all come back in the same instant.
"""

from __future__ import annotations

import random

#: How far :func:`jittered` spreads a wait, either way.
JITTER = 0.2

# 2**32 base periods is far beyond any cap; past it the float would only grow.
_MAX_DOUBLINGS = 32


def exponential_s(failures: int, *, base_s: float, max_s: float) -> float:
    """The wait after ``failures`` failures in a row: ``base_s`` after the first, doubling
    after each one more, never more than ``max_s``. No jitter (see :func:`jittered`)."""
    doublings = min(max(failures - 1, 0), _MAX_DOUBLINGS)
    return min(max_s, base_s * 2.0**doublings)


def jittered(wait_s: float) -> float:
    """``wait_s`` spread uniformly by ±:data:`JITTER` (never negative)."""
    return max(0.0, wait_s * random.uniform(1 - JITTER, 1 + JITTER))  # noqa: S311 -- not secret


class Backoff:
    """The wait of a loop that retries after errors: :meth:`next_s` after each failure
    (doubling, capped, jittered), :meth:`reset` after a success."""

    def __init__(self, *, base_s: float, max_s: float, jitter: bool = True) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.jitter = jitter
        self.failures = 0

    def next_s(self) -> float:
        """Count one more failure; how long to wait before trying again."""
        self.failures += 1
        wait = exponential_s(self.failures, base_s=self.base_s, max_s=self.max_s)
        return jittered(wait) if self.jitter else wait

    def reset(self) -> None:
        """A success: the next failure waits ``base_s`` again."""
        self.failures = 0
