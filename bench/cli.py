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


def wall_s(args: list[str], runs: int) -> float:
    """The median wall time of ``runs`` fresh ``outbox ARGS`` processes."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([OUTBOX, *args], check=True, capture_output=True, env=_env())  # noqa: S603 -- our own command
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    rows = [
        ("--version", wall_s(["--version"], options.runs), TOP_TARGET_S),
        ("--help", wall_s(["--help"], options.runs), TOP_TARGET_S),
    ]
    rows.extend(
        (" ".join([*path, "--help"]), wall_s([*path, "--help"], options.runs), SUB_TARGET_S)
        for path in (sub_commands()[:3] if options.smoke else sub_commands())
    )
    print(f"outbox, median wall time of {options.runs} fresh processes")
    for label, seconds, target in rows:
        verdict = "ok" if seconds < target else "OVER"
        print(f"  outbox {label:<40} {seconds:6.3f} s  (< {target} s: {verdict})")
    top = [row for row in rows if row[2] == TOP_TARGET_S]
    subs = [row for row in rows if row[2] == SUB_TARGET_S]
    for name, group, target in (
        ("--version/--help", top, TOP_TARGET_S),
        ("sub --help", subs, SUB_TARGET_S),
    ):
        worst = max(seconds for _, seconds, _ in group)
        met = "met" if worst < target else "NOT met"
        print(f"target {name} < {target} s: {met} (worst {worst:.3f} s)")
    if options.importtime:
        for args in (["--version"], ["--help"]):
            print(f"slowest imports of outbox {' '.join(args)} (cumulative):")
            for micros, name in import_top(args, 12):
                print(f"  {micros / 1e6:6.3f} s  {name}")


if __name__ == "__main__":
    main()
