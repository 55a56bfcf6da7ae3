"""How long the ``outbox`` command takes to answer (issue 33, item 4).

Wall time of fresh processes, the median of ``--runs`` each: ``outbox --version``, ``outbox
--help`` and every sub-command's ``--help`` (the groups' sub-commands too), against the
targets (0.3 s for the first two, 0.5 s for each ``--help``). ``--importtime`` adds the
slowest imports of ``outbox --version`` and ``outbox --help`` (``python -X importtime``).

    .venv/bin/python bench/cli.py --runs 5 --importtime
    .venv/bin/python bench/cli.py --smoke    # a few commands once: does it still run
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from typer.core import TyperGroup
from typer.main import get_command

from outbox.cli import app

#: The targets of issue 33: seconds of wall time.
TOP_TARGET_S = 0.3
SUB_TARGET_S = 0.5
#: ``outbox`` in the same virtual environment as this interpreter.
OUTBOX = str(Path(sys.executable).with_name("outbox"))


def wall_s(args: list[str], runs: int) -> tuple[float, float]:
    """The median wall time and the median CPU time (user + system) of ``runs`` fresh
    ``outbox ARGS`` processes: on a loaded machine the CPU time says what the command
    costs, the wall time also how long it waited for a core."""
    times, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([OUTBOX, *args], check=True, capture_output=True, env=_env())  # noqa: S603 -- our own command
        times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return statistics.median(times), statistics.median(cpus)


def _env() -> dict[str, str]:
    # Wide and plain: the help's layout is not what is measured.
    return {**os.environ, "COLUMNS": "160", "TERM": "dumb"}


def sub_commands() -> list[list[str]]:
    """Every command path under ``outbox``: the top ones and each group's own."""
    # Click's tree, read once in this process (its cost is not what is measured).
    paths: list[list[str]] = []
    root = get_command(app)

    def walk(group: TyperGroup, prefix: list[str]) -> None:
        ctx = group.make_context("outbox", [], resilient_parsing=True)
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            paths.append([*prefix, name])
            if isinstance(command, TyperGroup):
                walk(command, [*prefix, name])

    if not isinstance(root, TyperGroup):
        raise TypeError("outbox is a group of commands")
    walk(root, [])
    return paths


def import_top(args: list[str], count: int) -> list[tuple[int, str]]:
    """The ``count`` slowest imports (cumulative microseconds) of ``outbox ARGS``."""
    code = "import sys; from outbox.cli import main; sys.argv = ['outbox', *sys.argv[1:]]; main()"
    done = subprocess.run(  # noqa: S603 -- our own interpreter
        [sys.executable, "-X", "importtime", "-c", code, *args],
        capture_output=True,
        text=True,
        env=_env(),
        check=False,
    )
    rows = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = (part.strip() for part in line[len("import time:") :].split("|"))
        # Top-level packages only: a package's cumulative time holds its sub-modules'.
        if not name.startswith(" "):
            rows.append((int(cumulative), name.strip()))
    return sorted(rows, reverse=True)[:count]


def main() -> None:
    """Measure, print a table and the verdicts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per command")
    parser.add_argument("--importtime", action="store_true", help="the slowest imports too")
    parser.add_argument(
        "--smoke", action="store_true", help="one run of a few commands: does it still run"
    )
    options = parser.parse_args()
    if options.smoke:
        options.runs = 1
    paths = [["--version"], ["--help"]]
    paths += [[*path, "--help"] for path in sub_commands()[: 3 if options.smoke else None]]
    rows = []
    for args in paths:
        wall, cpu = wall_s(args, options.runs)
        target = TOP_TARGET_S if len(args) == 1 else SUB_TARGET_S
        rows.append((" ".join(args), wall, cpu, target))
    load = os.getloadavg()[0]
    print(f"outbox, median of {options.runs} fresh processes (load average {load:.2f})")
    print(f"  {'command':<47} {'wall':>7} {'cpu':>7}")
    for label, wall, cpu, target in rows:
        verdict = "ok" if wall < target else "OVER"
        print(f"  outbox {label:<40} {wall:6.3f}s {cpu:6.3f}s  (wall < {target} s: {verdict})")
    for name, target in (("--version/--help", TOP_TARGET_S), ("sub --help", SUB_TARGET_S)):
        group = [row for row in rows if row[3] == target]
        worst = max(row[1] for row in group)
        worst_cpu = max(row[2] for row in group)
        met = "met" if worst < target else "NOT met"
        print(
            f"target {name} < {target} s: {met} (worst wall {worst:.3f} s, "
            f"worst cpu {worst_cpu:.3f} s)"
        )
    if options.importtime:
        for args in (["--version"], ["--help"]):
            print(f"slowest imports of outbox {' '.join(args)} (cumulative):")
            for micros, name in import_top(args, 12):
                print(f"  {micros / 1e6:6.3f} s  {name}")


if __name__ == "__main__":
    main()
