"""Guard rails per tool and target: circuit breakers, rate limits and concurrency caps.

A tool declares them (TOML sub-tables ``[tools."x".breaker]``, ``.rate``, ``.concurrency``, or
``@tool(breaker=Breaker(...), rate=Rate(...), concurrency=Concurrency(...))``); the dispatcher
asks them in the statement of its ``sent`` move (:func:`outbox.guard_state.admission`,
migration 0020's ``outbox.guard_admit``). Their state lives in PostgreSQL
(``outbox.guard_breakers``, ``outbox.guard_buckets``; the in-flight count is the ``sent`` rows
themselves), so every process and host shares it, a SIGKILL forgets nothing, and time is the
database's clock.

This module holds the declarations and the pure arithmetic (the breaker's next state, the
GCRA's verdict), which tests check without a database.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

#: The values of a guard's ``per``: one state for the whole tool, or one per target.
PER_VALUES = ("tool", "target")
#: Separates tool and target in a guard key (tool names never contain it).
KEY_SEPARATOR = ":"


@dataclass(frozen=True, kw_only=True)
class Breaker:
    """A circuit breaker: opens after ``failures`` consecutive failed calls (not delivered,
    ambiguous, 5xx), or when ``ratio`` of at least ``min_calls`` calls in ``window_s``
    failed; stays open ``open_s``; then lets one probe through (one across every worker)."""

    #: Consecutive failures that open it: enough to not trip on one bad request.
    failures: int = 5
    #: Seconds it stays open before one probe: long enough for a restart of the remote.
    open_s: float = 30.0
    #: ``"target"``: one breaker per tool and target; ``"tool"``: one for the whole tool.
    per: str = "target"
    #: Optional: open when this share of the calls in the window failed (0 < ratio <= 1).
    ratio: float | None = None
    #: The window of the ratio, in seconds.
    window_s: float = 60.0
    #: Calls in the window before the ratio may open it (a handful of calls proves nothing).
    min_calls: int = 20

    def problems(self) -> Iterator[str]:
        """What is wrong with these values, each naming its field."""
        if self.failures < 1:
            yield f"breaker.failures must be at least 1, not {self.failures}"
        if not self.open_s > 0:
            yield f"breaker.open_s must be positive, not {self.open_s}"
        if self.per not in PER_VALUES:
            yield f"breaker.per must be 'tool' or 'target', not {self.per!r}"
        if self.ratio is not None and not 0 < self.ratio <= 1:
            yield f"breaker.ratio must be in (0, 1], not {self.ratio}"
        if not self.window_s > 0:
            yield f"breaker.window_s must be positive, not {self.window_s}"
        if self.min_calls < 1:
            yield f"breaker.min_calls must be at least 1, not {self.min_calls}"


@dataclass(frozen=True, kw_only=True)
class Rate:
    """A rate limit (GCRA): at most ``per_second`` sends a second on average, and at most
    ``burst`` at once after a quiet spell."""

    per_second: float
    #: Sends allowed back to back after a quiet spell (1: perfectly even spacing).
    burst: int = 1
    per: str = "target"

    def problems(self) -> Iterator[str]:
        """What is wrong with these values, each naming its field."""
        if not (self.per_second > 0 and math.isfinite(self.per_second)):
            yield f"rate.per_second must be positive, not {self.per_second}"
        if self.burst < 1:
            yield f"rate.burst must be at least 1, not {self.burst}"
        if self.per not in PER_VALUES:
            yield f"rate.per must be 'tool' or 'target', not {self.per!r}"

    @property
    def interval_s(self) -> float:
        """The emission interval: seconds between two sends at the sustained rate."""
        return 1.0 / self.per_second


@dataclass(frozen=True, kw_only=True)
class Concurrency:
    """A concurrency cap: at most ``max_in_flight`` attempts in ``sent`` at once."""

    max_in_flight: int
    per: str = "target"
    #: Seconds an operation over the cap waits before it is tried again.
    retry_s: float = 0.2

    def problems(self) -> Iterator[str]:
        """What is wrong with these values, each naming its field."""
        if self.max_in_flight < 1:
            yield f"concurrency.max_in_flight must be at least 1, not {self.max_in_flight}"
        if self.per not in PER_VALUES:
            yield f"concurrency.per must be 'tool' or 'target', not {self.per!r}"
        if not self.retry_s > 0:
            yield f"concurrency.retry_s must be positive, not {self.retry_s}"


@dataclass(frozen=True)
class GuardKey:
    """Whose state a guard keeps: a tool, or a tool and one target (``target`` ``""``: the
    whole tool). Written ``tool`` or ``tool:target``."""

    tool: str
    target: str = ""

    @classmethod
    def of(cls, tool: str, target: str, per: str) -> GuardKey:
        """The key of ``tool`` and ``target`` for a guard declared ``per``."""
        return cls(tool, target if per == "target" else "")

    @classmethod
    def parse(cls, text: str) -> GuardKey:
        """``tool`` or ``tool:target`` (the target may itself contain ``:``)."""
        tool, _, target = text.partition(KEY_SEPARATOR)
        return cls(tool, target)

    def __str__(self) -> str:
        return f"{self.tool}{KEY_SEPARATOR}{self.target}" if self.target else self.tool


class BreakerState(enum.StrEnum):
    """Where a breaker is; who moves it out."""

    CLOSED = "closed"  #: calls flow; a run of failures (or the ratio) opens it
    OPEN = "open"  #: nothing sent until ``open_until``; then the first dispatcher probes
    HALF_OPEN = "half_open"  #: one probe in flight; its outcome closes or re-opens it


class Verdict(enum.StrEnum):
    """How an attempt's outcome counts for a breaker."""

    SUCCESS = "success"  #: the remote answered (applied, or an authoritative refusal)
    FAILURE = "failure"  #: not delivered, ambiguous (timeout, reset, 5xx)
    NEUTRAL = "neutral"  #: says nothing about the remote (not sent: our own deadline)


@dataclass(frozen=True)
class BreakerRow:
    """A breaker's stored state (``outbox.guard_breakers``)."""

    state: BreakerState
    failures: int
    window_started_at: datetime | None
    window_calls: int
    window_failures: int
    open_until: datetime | None
    probe_operation_id: str | None


CLOSED_ROW = BreakerRow(BreakerState.CLOSED, 0, None, 0, 0, None, None)


def next_breaker(
    row: BreakerRow, breaker: Breaker, verdict: Verdict, *, now: datetime, operation_id: str
) -> BreakerRow:
    """The breaker after an attempt of ``operation_id`` ended in ``verdict`` at ``now``.

    A probe's success closes it and its failure re-opens it; an outcome of an attempt that
    was not the probe (sent before the breaker opened) moves the counters only. In the
    closed state a run of ``failures`` failures, or the ratio over the window, opens it.
    """
    if verdict is Verdict.NEUTRAL:
        return row
    failed = verdict is Verdict.FAILURE
    window_started, calls, failures_in_window = row.window_started_at, row.window_calls, 0
    if window_started is None or now - window_started > timedelta(seconds=breaker.window_s):
        window_started, calls = now, 0
    else:
        failures_in_window = row.window_failures
    calls += 1
    failures_in_window += int(failed)
    consecutive = row.failures + 1 if failed else 0
    counted = BreakerRow(
        row.state, consecutive, window_started, calls, failures_in_window, row.open_until, None
    )
    reopened = BreakerRow(
        BreakerState.OPEN,
        consecutive,
        window_started,
        calls,
        failures_in_window,
        now + timedelta(seconds=breaker.open_s),
        None,
    )
    if row.state is not BreakerState.CLOSED:
        if row.probe_operation_id != operation_id:
            return _keep_probe(counted, row)
        if failed:
            return reopened
        return BreakerRow(BreakerState.CLOSED, 0, now, 0, 0, None, None)
    if failed and (consecutive >= breaker.failures or _ratio_tripped(breaker, counted)):
        return reopened
    return counted


def _keep_probe(counted: BreakerRow, row: BreakerRow) -> BreakerRow:
    return BreakerRow(
        row.state,
        counted.failures,
        counted.window_started_at,
        counted.window_calls,
        counted.window_failures,
        row.open_until,
        row.probe_operation_id,
    )


def _ratio_tripped(breaker: Breaker, row: BreakerRow) -> bool:
    if breaker.ratio is None or row.window_calls < breaker.min_calls:
        return False
    return row.window_failures >= breaker.ratio * row.window_calls


@dataclass(frozen=True)
class GcraVerdict:
    """The GCRA's answer: allowed (and the bucket's new theoretical arrival time), or not
    (and the first instant a send would be)."""

    allowed: bool
    tat: datetime
    next_at: datetime


def gcra(tat: datetime | None, rate: Rate, now: datetime) -> GcraVerdict:
    """The generic cell rate algorithm, as the SQL of :mod:`outbox.sql.guards` computes it:
    a send at ``now`` is allowed if ``max(tat, now) + T <= now + burst * T``, and moves the
    theoretical arrival time ``tat`` to ``max(tat, now) + T``."""
    interval = timedelta(seconds=rate.interval_s)
    base = max(tat, now) if tat is not None else now
    new_tat = base + interval
    if new_tat <= now + rate.burst * interval:
        return GcraVerdict(allowed=True, tat=new_tat, next_at=now)
    return GcraVerdict(allowed=False, tat=base, next_at=base - (rate.burst - 1) * interval)
