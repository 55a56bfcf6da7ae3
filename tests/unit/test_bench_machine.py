"""Every benchmark figure carries the machine's state, and a case run at high steal is marked,
not averaged in (issue 35)."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench_module(name: str) -> ModuleType:
    # The bench directory is not a package: its scripts import each other from their folder.
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def report() -> ModuleType:
    return _bench_module("report")


@pytest.fixture(scope="module")
def machine() -> ModuleType:
    return _bench_module("machine")


def _state(machine: ModuleType, steal: float) -> object:
    return machine.MachineState(
        seconds=10.0, steal_pct=steal, busy_pct=80.0, probe_ms=2.0, probes=50, pressure_pct=30.0
    )


def test_a_value_measured_above_the_steal_limit_stays_in_the_spread_but_not_the_median(
    report: ModuleType,
) -> None:
    results = report.Results("t")
    for value, marked in ((10.0, False), (12.0, False), (90.0, True)):
        results.add("p50", value, unit="ms", marked=marked)
    row = results.find("p50")
    assert row.median() == 11.0
    assert report._spread(row) == "10.0 - 90.0"
    assert report._count(row) == "2 +1m"


def test_a_row_whose_every_value_is_marked_takes_them_all_and_says_so(report: ModuleType) -> None:
    results = report.Results("t")
    for value in (10.0, 30.0):
        results.add("p50", value, unit="ms", marked=True)
    row = results.find("p50")
    assert row.median() == 20.0
    assert report._count(row) == "2m"


def test_a_ratio_of_a_marked_round_is_marked(report: ModuleType) -> None:
    results = report.Results("t")
    results.add("a", 2.0, unit="ms")
    results.add("a", 8.0, unit="ms", marked=True)
    results.add("b", 1.0, unit="ms")
    results.add("b", 1.0, unit="ms")
    results.ratio("a / b", "a", "b")
    row = results.find("a / b")
    assert row.marked == [False, True]
    assert row.median() == 2.0


def test_a_case_above_the_steal_limit_is_marked_with_a_note_naming_it(
    report: ModuleType, machine: ModuleType
) -> None:
    results = report.Results("t")
    assert results.record_machine(1, "ours, steady", _state(machine, 3.0)) is False
    assert results.record_machine(2, "ours, steady", _state(machine, 25.0)) is True
    assert results.notes == [
        "marked: round 2, ours, steady ran at 25.0 % steal (> 10 %): in min-max, not in the median"
    ]
    summary = results.machine_summary()
    assert summary is not None
    assert "steal median 14.0 % (max 25.0)" in summary
    assert "CPU pressure median 30 % (max 30)" in summary
    assert "CPU probe median 2.0 ms" in summary
    assert [m["steal_pct"] for m in results.to_json()["machine"]] == [3.0, 25.0]


def test_the_meter_times_the_probe_and_reads_the_machine_over_its_own_seconds(
    machine: ModuleType,
) -> None:
    with machine.measuring() as meter:
        # Busy for a while, so the probe runs more than once.
        end = machine.time.monotonic() + 1.3
        while machine.time.monotonic() < end:
            pass
        state = meter.stop()
    assert state.probes >= 2
    assert math.isfinite(state.probe_ms)
    assert state.probe_ms > 0
    assert 0.0 <= state.steal_pct <= 100.0
    assert state.busy_pct > 0.0
    assert 0.0 <= state.pressure_pct <= 100.0
    assert machine.cpu_ticks().total > 0


@pytest.fixture(scope="module")
def contend() -> ModuleType:
    return _bench_module("contend")


def test_the_co_tenant_takes_its_share_of_every_core_and_the_meter_says_how_much(
    machine: ModuleType, contend: ModuleType
) -> None:
    with contend.contending(20.0) as contender, machine.measuring() as meter:
        assert contend.active() is contender
        machine.time.sleep(2.0)
        state = meter.stop()
    assert contend.active() is None
    # 20 % of every core in bursts: within a few points over two seconds.
    assert 14.0 <= state.emulated_steal_pct <= 26.0, state
    assert "emulated steal" in state.describe()
    assert contender._processes == []  # every co-tenant stopped
    expected = "SCHED_FIFO" if contender.realtime else "normal priority"
    assert expected in contender.describe()


def test_without_a_co_tenant_nothing_is_emulated(machine: ModuleType, contend: ModuleType) -> None:
    with contend.contending(None) as contender, machine.measuring() as meter:
        state = meter.stop()
    assert contender is None
    assert math.isnan(state.emulated_steal_pct)
    assert "emulated" not in state.describe()


@pytest.mark.parametrize("share", [0.0, -5.0, 50.5, 100.0])
def test_a_share_outside_what_the_co_tenant_may_take_is_refused(
    contend: ModuleType, share: float
) -> None:
    with pytest.raises(ValueError, match="share must be in"):
        contend.Contender(share)


def test_the_summary_gives_the_emulated_steal_when_a_co_tenant_ran(
    report: ModuleType, machine: ModuleType
) -> None:
    results = report.Results("t")
    for emulated in (14.0, 16.0):
        state = machine.MachineState(
            seconds=10.0, steal_pct=0.0, busy_pct=80.0, probe_ms=2.0, probes=5,
            emulated_steal_pct=emulated,
        )  # fmt: skip
        assert results.record_machine(1, "ours, steady", state) is False  # not real steal
    summary = results.machine_summary()
    assert summary is not None
    assert "emulated steal median 15.0 % (max 16.0; bench/contend.py)" in summary


def test_the_latency_benchmarks_refuse_a_share_they_cannot_emulate() -> None:
    arguments = _bench_module("arguments")
    parser = arguments.argparse.ArgumentParser()
    arguments.add_contend_argument(parser)
    assert parser.parse_args(["--contend", "15"]).contend == 15.0
    assert parser.parse_args([]).contend is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--contend", "80"])
