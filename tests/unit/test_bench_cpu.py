"""The benchmarks' ``/proc`` readers: a process's scheduled CPU to the nanosecond, its command
name, and nothing (not zero, not an error) for a process that is gone."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def cpu() -> ModuleType:
    # The bench directory is not a package: its scripts import each other from their folder.
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("cpu")
    finally:
        sys.path.remove(str(BENCH))


def _gone_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(child.stdout)


def test_scheduled_cpu_counts_this_process_work(cpu: ModuleType) -> None:
    before = cpu.scheduled_cpu_s(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    after = cpu.scheduled_cpu_s(os.getpid())
    assert before is not None
    assert after is not None
    assert after - before >= 0.04


def test_a_process_that_is_gone_has_no_cpu_and_no_name(cpu: ModuleType) -> None:
    pid = _gone_pid()
    assert cpu.scheduled_cpu_s(pid) is None
    assert cpu.command_name(pid) is None


def test_command_name_is_the_process_comm(cpu: ModuleType) -> None:
    assert cpu.command_name(os.getpid()) == Path("/proc/self/comm").read_text().strip()
