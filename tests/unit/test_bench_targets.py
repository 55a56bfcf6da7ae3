"""The benchmarks judge each target plainly: met, not met, or not measured in this run."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def report() -> ModuleType:
    # The bench directory is not a package: its scripts import `report` from their own folder.
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("report")
    finally:
        sys.path.remove(str(BENCH))


def test_a_ratio_at_or_above_its_bound_is_met(report: ModuleType) -> None:
    results = report.Results("t")
    for value in (1.1, 1.3, 1.25):
        results.add("ours / peer", value, unit="x", section="ratios")
    assert results.target("ratio >= 1.2x", ("ratios", "ours / peer"), at_least=1.2) is True
    assert results.notes[-1] == "target ratio >= 1.2x: 1.25x (median; 1.10 - 1.30): met"


def test_a_latency_over_its_bound_is_not_met(report: ModuleType) -> None:
    results = report.Results("t")
    for value in (14.0, 16.5, math.nan, 17.0):
        results.add("p99", value, unit="ms")
    assert results.target("p99 <= 15 ms", "p99", at_most=15.0) is False
    assert results.notes[-1] == "target p99 <= 15 ms: 16.5 ms (median; 14.0 - 17.0): NOT met"


def test_a_row_this_run_did_not_measure_is_said_so(report: ModuleType) -> None:
    results = report.Results("t")
    assert results.target("ratio >= 2x", ("ratios", "absent"), at_least=2.0) is None
    assert results.notes == ["target ratio >= 2x: not measured in this run"]
