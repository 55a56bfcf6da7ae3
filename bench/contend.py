"""Emulated steal: a co-tenant that takes a fixed share of every core, in bursts.

Issue 35 asks the steady latency targets "on a quiet host and at 10-20 % steal alike", and
this machine shows no steal for days on end. Steal is the hypervisor running someone else on
our virtual CPU: for a few milliseconds at a time, nothing of ours runs on that core, however
urgently it woke. A process at normal priority does not reproduce that (the scheduler
preempts a CPU hog for a task that just woke), so the co-tenant here is **real-time**: one
process per core, pinned to it, ``SCHED_FIFO`` priority 1, busy for ``share`` of every
:data:`PERIOD_S` and asleep the rest, its bursts' phase jittered so that they do not line up
with the benchmark's own rhythm. While a burst runs, no normal task runs on that core,
exactly as under steal. It needs ``CAP_SYS_NICE`` (root); without it the co-tenant runs at
normal priority and says so (a gentler load, named as such in the table's notes).

The kernel's real-time throttling (``/proc/sys/kernel/sched_rt_runtime_us``, 95 % by default)
and :data:`MAX_SHARE` bound what a bug here could take.

The machine's line under each table (:mod:`machine`) gives the share the co-tenant actually
took over each case's seconds (``emulated steal``), from its processes' own CPU time.

Usage: ``python bench/contend.py --share 15 --seconds 10`` runs the co-tenant alone (to watch
it with ``top``); ``bench/peers.py --contend 15`` and ``bench/pipeline.py --contend 15`` run
their cases under it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

#: Each core's co-tenant wakes this often and burns ``share`` of it: bursts of 1.5 ms at 15 %,
#: the order of a hypervisor's time slice.
PERIOD_S = 0.010
#: The largest share of a core the co-tenant may take, in percent.
MAX_SHARE = 50.0

_active: Contender | None = None


def checked_share(share_pct: float) -> float:
    """``share_pct`` if the co-tenant may take it (above 0, at most :data:`MAX_SHARE`);
    ValueError naming the bounds otherwise."""
    if not 0 < share_pct <= MAX_SHARE:
        raise ValueError(
            f"the co-tenant's share must be in (0, {MAX_SHARE:g}] percent of a core, "
            f"not {share_pct:g}"
        )
    return share_pct


class Contender:
    """The co-tenant's processes (one per core) between :meth:`start` and :meth:`stop`."""

    def __init__(self, share_pct: float) -> None:
        self.share_pct = checked_share(share_pct)
        self.realtime = False
        self._processes: list[subprocess.Popen[str]] = []

    def start(self) -> None:
        """One co-tenant per core, each pinned to it; waits until all burn."""
        cores = sorted(os.sched_getaffinity(0))
        for core in cores:
            process = subprocess.Popen(  # noqa: S603 -- this file, this interpreter
                [sys.executable, __file__, "--core", str(core), "--share", str(self.share_pct)],
                stdout=subprocess.PIPE,
                stdin=subprocess.PIPE,
                text=True,
            )
            self._processes.append(process)
        answers = [p.stdout.readline().strip() for p in self._processes if p.stdout is not None]
        self.realtime = all(answer == "realtime" for answer in answers)

    def stop(self) -> None:
        """Stop every co-tenant (closing its stdin ends it)."""
        for process in self._processes:
            with contextlib.suppress(OSError):
                if process.stdin is not None:
                    process.stdin.close()
        for process in self._processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
        self._processes = []

    def cpu_ticks(self) -> int:
        """The co-tenants' CPU time so far, in clock ticks (user + system)."""
        total = 0
        for process in self._processes:
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        return total

    def describe(self) -> str:
        """What the co-tenant is, for the table's notes."""
        how = (
            "SCHED_FIFO, one process pinned to each core"
            if self.realtime
            else "normal priority (no CAP_SYS_NICE: gentler than steal)"
        )
        return (
            f"emulated steal: a co-tenant takes {self.share_pct:g} % of every core in bursts of "
            f"{self.share_pct / 100 * PERIOD_S * 1000:.1f} ms every {PERIOD_S * 1000:g} ms "
            f"({how}; bench/contend.py)"
        )


def active() -> Contender | None:
    """The co-tenant running in this process's benchmark, if any (:func:`contending`)."""
    return _active


@contextlib.contextmanager
def contending(share_pct: float | None) -> Iterator[Contender | None]:
    """A started :class:`Contender` taking ``share_pct`` of every core (None: nothing)."""
    global _active  # noqa: PLW0603 -- one co-tenant per benchmark run
    if not share_pct:
        yield None
        return
    contender = Contender(share_pct)
    try:
        contender.start()
        _active = contender
        yield contender
    finally:
        _active = None
        contender.stop()


def _burn(core: int, share_pct: float) -> None:
    """The co-tenant of one core: until stdin closes, busy ``share_pct`` of every period."""
    import threading  # noqa: PLC0415 -- only the co-tenant process needs it

    os.sched_setaffinity(0, {core})
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        print("realtime", flush=True)
    except PermissionError:
        print("normal", flush=True)
    done = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        done.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    burst = share_pct / 100 * PERIOD_S
    rng = random.Random(core)  # a phase jitter, seeded per core
    next_at = time.monotonic() + rng.uniform(0, PERIOD_S)
    while not done.is_set():
        time.sleep(max(0.0, next_at - time.monotonic()))
        until = time.monotonic() + burst
        while time.monotonic() < until:
            pass
        # The next burst one period on, give or take a fifth of one: no fixed phase.
        next_at += PERIOD_S * rng.uniform(0.8, 1.2)
        next_at = max(next_at, time.monotonic())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--share", type=float, default=15.0, help="percent of every core")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long (alone)")
    parser.add_argument("--smoke", action="store_true", help="one second: does it still run")
    parser.add_argument("--core", type=int, help=argparse.SUPPRESS)  # the co-tenant itself
    args = parser.parse_args(argv)
    if args.smoke:
        args.seconds = 1.0
    if args.core is not None:
        _burn(args.core, args.share)
        return 0
    try:
        with contending(args.share) as contender:
            assert contender is not None  # noqa: S101 -- a share was given
            before, started = contender.cpu_ticks(), time.monotonic()
            time.sleep(args.seconds)
            used = (contender.cpu_ticks() - before) / os.sysconf("SC_CLK_TCK")
            cores = len(os.sched_getaffinity(0))
            took = 100 * used / (cores * (time.monotonic() - started))
    except ValueError as exc:
        parser.error(str(exc))
    print(f"{contender.describe()}\nmeasured: {took:.1f} % of {cores} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
