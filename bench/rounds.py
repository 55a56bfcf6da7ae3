"""Rounds: every case measured once per round, side by side, the starting case rotating.

A noisy machine then disturbs all cases alike; the rows' medians and round-by-round ratios
are in ``report``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from contend import contending
from machine import measuring
from report import Results, say


@dataclass(frozen=True)
class Case:
    """One thing measured once per round: ``run()`` returns ``{row name: (value, unit)}``
    (a case may yield several rows, e.g. throughput and latency percentiles)."""

    name: str
    run: Callable[[], Mapping[str, tuple[float, str]]]
    section: str = ""


def run_rounds(
    rounds: int,
    cases: Sequence[Case],
    results: Results,
    *,
    progress: Callable[[str], None] | None = None,
    contend_pct: float | None = None,
) -> None:
    """Run every case once per round, side by side, the starting case rotating each round.

    Rows are added in the cases' declared order, whatever order a round ran them in. The
    machine's state over each case's own seconds (CPU steal, busy, the CPU probe:
    :mod:`machine`) is kept in ``results``; a case run above its steal limit has its values
    marked (in the min-max, not in the median).

    ``contend_pct``: every round under emulated steal, a co-tenant taking that share of every
    core (:mod:`contend`); the table's notes say so, its machine line says what it took.
    """
    with contending(contend_pct) as contender:
        if contender is not None:
            results.note(contender.describe())
        _run_rounds(rounds, cases, results, progress or say)


def _run_rounds(
    rounds: int, cases: Sequence[Case], results: Results, report: Callable[[str], None]
) -> None:
    for r in range(rounds):
        start = r % len(cases) if cases else 0
        measured: dict[int, Mapping[str, tuple[float, str]]] = {}
        marked: dict[int, bool] = {}
        for i in [*range(start, len(cases)), *range(start)]:
            report(f"round {r + 1}/{rounds}: {cases[i].name}")
            with measuring() as meter:
                measured[i] = cases[i].run()
                state = meter.stop()
            report(f"  machine: {state.describe()}")
            marked[i] = results.record_machine(r + 1, cases[i].name, state)
        for i, case in enumerate(cases):
            for row, (value, unit) in measured[i].items():
                results.add(row, value, unit=unit, section=case.section, marked=marked[i])


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
