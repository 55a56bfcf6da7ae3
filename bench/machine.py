"""The machine's state over the seconds a figure was measured: CPU steal and a fixed CPU probe.

On a shared host (a cloud VM, this one) the same code gives figures several times apart from
one minute to the next, and the load average does not show why (issue 35: steal went from 0
to 21 % within minutes while the load looked quiet). So every case a benchmark measures
(``rounds.run_rounds``) records, over exactly its own seconds:

* **steal**: the share of CPU time the hypervisor gave to someone else, from the ``steal``
  column of ``/proc/stat`` (percent of all CPU time, every core);
* **busy**: the machine's busy share over the same seconds (percent of all cores);
* **CPU pressure**: the share of the time at least one runnable task waited for a CPU, from
  ``/proc/pressure/cpu`` (Linux PSI; NaN where the kernel has none): other work contending
  for the cores shows here, when steal shows only the hypervisor's;
* **emulated steal**: under ``--contend`` (:mod:`contend`), the share of all CPU time the
  co-tenant's processes used, from their own ``/proc/<pid>/stat``;
* **CPU probe**: the wall time of a fixed pure-Python loop (:data:`PROBE_LOOPS` additions,
  about 20 ms of CPU on a quiet core here), run every :data:`PROBE_PERIOD_S` by a process of
  its own at normal priority while the case runs; its median. A burst that long outlasts the
  scheduler's credit for a task that slept, so on a contended machine it waits its turn like
  the stack does; a slower probe means the case got less CPU than a quiet run would have,
  whatever the cause (steal, other work, frequency scaling). Its own cost: about 2 % of one
  core.

A case measured at more than ``steal_limit`` percent steal is *marked*
(:meth:`report.Results.add`): its values stay in the min-max and the JSON, but not in the
median, and a note under the table names the case and round.

Usage: ``python bench/machine.py`` prints the machine's state over a few seconds (the probe's
quiet time on an idle machine); ``--probe`` is the probe process itself.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import contend

#: Additions the probe times: about 20 ms on a quiet core of this machine. A 2 ms probe
#: (tried first) measured 1.5-2.1 ms at a load average of 16: the scheduler's wake-up credit
#: ran it at once.
PROBE_LOOPS = 500_000
#: How often the probe runs while a case is measured (its own CPU: about 2 % of a core).
PROBE_PERIOD_S = 1.0
#: A case measured above this steal (percent of all CPU time) is marked, not averaged in.
STEAL_LIMIT = 10.0


@dataclass(frozen=True)
class CpuTicks:
    """The ``cpu`` line of ``/proc/stat``: steal, busy and total ticks, all cores."""

    steal: int
    busy: int
    total: int


def cpu_ticks() -> CpuTicks:
    """The machine's CPU ticks so far (zeros where there is no ``/proc/stat``)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return CpuTicks(0, 0, 0)
    # user nice system idle iowait irq softirq steal guest guest_nice; guest is in user.
    total = sum(fields[:8])
    idle = fields[3] + fields[4]
    steal = fields[7] if len(fields) > 7 else 0
    return CpuTicks(steal=steal, busy=total - idle - steal, total=total)


def cpu_pressure_us() -> float:
    """Microseconds so far during which some runnable task waited for a CPU (PSI ``some``);
    NaN without ``/proc/pressure/cpu``."""
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(first.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        return float("nan")


def probe_once() -> float:
    """Milliseconds to run the fixed loop once."""
    start = time.perf_counter()
    total = 0
    for i in range(PROBE_LOOPS):
        total += i
    return (time.perf_counter() - start) * 1000


@dataclass(frozen=True)
class MachineState:
    """What the machine did over one measured stretch."""

    seconds: float
    steal_pct: float
    busy_pct: float
    probe_ms: float
    probes: int
    #: Share of the time some runnable task waited for a CPU (NaN: not measured).
    pressure_pct: float = float("nan")
    #: Share of all CPU time the ``--contend`` co-tenant took (NaN: none ran).
    emulated_steal_pct: float = float("nan")

    def marked(self, steal_limit: float = STEAL_LIMIT) -> bool:
        """Whether this stretch ran above ``steal_limit`` percent steal."""
        return self.steal_pct > steal_limit

    def describe(self) -> str:
        """``steal 3.1 %, busy 87 %, CPU pressure 40 %, probe 24.1 ms (n=40)``."""
        emulated = (
            f"emulated steal {self.emulated_steal_pct:.1f} %, "
            if math.isfinite(self.emulated_steal_pct)
            else ""
        )
        return (
            f"steal {self.steal_pct:.1f} %, {emulated}busy {self.busy_pct:.0f} %, "
            f"CPU pressure {self.pressure_pct:.0f} %, "
            f"probe {self.probe_ms:.1f} ms (n={self.probes})"
        )


class MachineMeter:
    """Measures :class:`MachineState` between :meth:`start` and :meth:`stop`: ``/proc/stat``
    at both ends, and the probe process's timings in between."""

    def __init__(self) -> None:
        self._ticks = CpuTicks(0, 0, 0)
        self._pressure = 0.0
        self._started = 0.0
        self._contended = 0
        self._probe: subprocess.Popen[str] | None = None

    def start(self) -> None:
        """Start the probe process and take the first reading."""
        self._probe = subprocess.Popen(  # noqa: S603 -- this file, this interpreter
            [sys.executable, __file__, "--probe"],
            stdout=subprocess.PIPE,
            stdin=subprocess.PIPE,
            text=True,
        )
        # Its start-up (an interpreter) is not the measured case's: wait until it is ready.
        assert self._probe.stdout is not None  # noqa: S101 -- stdout=PIPE above
        self._probe.stdout.readline()
        self._ticks = cpu_ticks()
        self._pressure = cpu_pressure_us()
        contender = contend.active()
        self._contended = contender.cpu_ticks() if contender is not None else 0
        self._started = time.monotonic()

    def stop(self) -> MachineState:
        """Stop the probe and return the state since :meth:`start`."""
        seconds = time.monotonic() - self._started
        end = cpu_ticks()
        pressure = cpu_pressure_us() - self._pressure
        contender = contend.active()
        contended = contender.cpu_ticks() - self._contended if contender is not None else None
        timings: list[float] = []
        if self._probe is not None:
            # Closing its stdin tells the probe to print what it measured and exit.
            out, _ = self._probe.communicate(input="", timeout=30)
            timings = [float(line) for line in out.split() if line]
            self._probe = None
        total = max(end.total - self._ticks.total, 1)
        return MachineState(
            seconds=seconds,
            steal_pct=100 * (end.steal - self._ticks.steal) / total,
            busy_pct=100 * (end.busy - self._ticks.busy) / total,
            probe_ms=statistics.median(timings) if timings else float("nan"),
            probes=len(timings),
            pressure_pct=min(100.0, pressure / 1e4 / max(seconds, 1e-9)),
            emulated_steal_pct=float("nan") if contended is None else 100 * contended / total,
        )

    def close(self) -> None:
        """Kill the probe if :meth:`stop` was never reached (a failed case)."""
        if self._probe is not None:
            with contextlib.suppress(OSError):
                self._probe.kill()
            self._probe.wait()
            self._probe = None


@contextlib.contextmanager
def measuring() -> Iterator[MachineMeter]:
    """A started :class:`MachineMeter`, its probe killed on the way out."""
    meter = MachineMeter()
    meter.start()
    try:
        yield meter
    finally:
        meter.close()


def _run_probe() -> None:
    """The probe process: time the loop every PROBE_PERIOD_S until stdin closes, then print
    one timing per line. A thread waits on stdin so the loop never blocks on it."""
    import threading  # noqa: PLC0415 -- only the probe process needs it

    done = threading.Event()
    print("ready", flush=True)

    def wait_for_eof() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    timings = []
    while not done.is_set():
        timings.append(probe_once())
        done.wait(PROBE_PERIOD_S)
    sys.stdout.write("\n".join(f"{t:.4f}" for t in timings) + "\n")


def quiet_probe_ms() -> float:
    """The probe's median here and now, in this process (for a reference line)."""
    return statistics.median(probe_once() for _ in range(15))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--probe", action="store_true", help="be the probe process")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to measure")
    parser.add_argument("--smoke", action="store_true", help="one second: does it still run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds = 1.0
    if args.probe:
        _run_probe()
        return 0
    with measuring() as meter:
        time.sleep(args.seconds)
        state = meter.stop()
    print(f"{os.cpu_count()} cores, over {state.seconds:.1f} s: {state.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
