"""CPU accounting from Linux ``/proc``: per process, per named group of processes, the machine."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 if it is gone or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def scheduled_cpu_s(pid: int) -> float | None:
    """CPU seconds process ``pid`` has run so far, to the nanosecond (``/proc/PID/schedstat``:
    a short statement's cost is far below ``/proc/PID/stat``'s clock tick); None if it is gone
    or not this machine's."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except OSError:
        return None


def command_name(pid: int) -> str | None:
    """Process ``pid``'s command name (``/proc/PID/comm``); None if there is no such process."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def pids_named(*names: str) -> list[int]:
    """Pids of the processes whose command name (``/proc/PID/comm``) is one of ``names``."""
    pids = (int(entry.name) for entry in Path("/proc").glob("[0-9]*"))
    return [pid for pid in pids if command_name(pid) in names]


def machine_busy_s() -> tuple[float, float]:
    """(busy CPU seconds, total CPU seconds) of the whole machine so far, from /proc/stat."""
    try:
        first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0, 0.0
    ticks = [int(v) for v in first]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks) - idle) / _CLOCK_TICKS, sum(ticks) / _CLOCK_TICKS


class CpuMeter:
    """CPU used by named groups of processes between :meth:`start` and :meth:`stop`,
    as a percentage of one core over the wall time between them."""

    def __init__(self, groups: Mapping[str, Callable[[], Iterable[int]]]) -> None:
        self.groups = groups
        self._start: dict[str, dict[int, float]] = {}
        self._machine = (0.0, 0.0)
        self._started = 0.0

    def _sample(self) -> dict[str, dict[int, float]]:
        return {
            name: {pid: process_cpu_s(pid) for pid in pids()} for name, pids in self.groups.items()
        }

    def start(self) -> None:
        """Take the first sample."""
        self._start = self._sample()
        self._machine = machine_busy_s()
        self._started = time.monotonic()

    def stop(self) -> dict[str, float]:
        """{group: % of one core} since :meth:`start`; ``everything else`` (other processes
        and the kernel's own work) and ``machine busy``, in % of one core too (at most
        100 x the number of cores)."""
        end = self._sample()
        busy, total = machine_busy_s()
        wall = max(time.monotonic() - self._started, 1e-9)
        usage = {}
        for name, pids in end.items():
            before = self._start.get(name, {})
            used = sum(cpu - before.get(pid, 0.0) for pid, cpu in pids.items())
            usage[name] = 100 * used / wall
        cores = os.cpu_count() or 1
        spent = total - self._machine[1]
        machine = 100 * cores * (busy - self._machine[0]) / spent if spent else 0.0
        usage["everything else"] = machine - sum(usage.values())
        usage[f"machine busy (of {100 * cores})"] = machine
        return usage
