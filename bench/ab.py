"""Two versions of this repository measured alternately in one run: A, B, B, A, A, B, ...

A change on the hot path is quoted before and after (docs/performance.md), and on a shared
host the same code gives figures far apart from one minute to the next: measured one after
the other, a change and the machine's drift cannot be told apart. This runs one benchmark
script on two versions in turn, pair after pair, the first of each pair alternating, and
judges each of the script's rows by the ratio B / A **within each pair** (the two ran
minutes apart), then the median over pairs, beside the machine's state during each side's
runs.

A version is a git revision (``HEAD~1``, a branch, a commit), checked out for the run into a
detached worktree of its own (removed at the end), or ``.``: the working tree as it is,
uncommitted changes included. Each side runs ``bench/SCRIPT`` as that version has it, with
that version first on ``PYTHONPATH`` (the processes the script starts inherit it), from a
scratch directory, and its own ``--json`` file: the script must take ``--json``, as every
script built on ``bench/arguments.py`` does. The installed packages are this checkout's
virtualenv for both: a change of dependencies is not what this compares.

Usage: python bench/ab.py A B [--pairs 3] [--json FILE] -- SCRIPT [SCRIPT'S ARGUMENTS]

    python bench/ab.py HEAD~1 HEAD -- peers.py --systems ours,celery --loads flat --rounds 1
    python bench/ab.py HEAD . --pairs 4 -- server_cost.py --rounds 1 --ops 1000

Exit status: 0 when every run succeeded; 1 when one failed (its output is shown); 2 for a
bad command line (an unknown revision, no such script); 130 when interrupted (Ctrl-C or
SIGTERM: the script is interrupted in turn and cleans up, and the worktrees are removed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from machine import MachineState
from report import MachineRecord, Results, console, fmt, median, say
from rich.table import Table
from throwaway import sigterm_as_interrupt

REPO = Path(__file__).resolve().parents[1]
#: The version that is the working tree as it is.
WORKING_TREE = "."
#: How long an interrupted script may take to clean up before it is killed.
INTERRUPT_GRACE_S = 60.0


class UsageError(Exception):
    """A command line that names something that is not there (exit 2)."""


class RunFailed(Exception):
    """One side's run of the script did not succeed (exit 1)."""


@dataclass(frozen=True)
class Version:
    """One side: what the user named, the commit it is (None: the working tree) and the
    directory its code runs from."""

    label: str
    spec: str
    commit: str | None
    tree: Path

    def describe(self) -> str:
        """``A = HEAD~1 (1a2b3c4)``, or ``B = . (the working tree)``."""
        what = self.commit[:7] if self.commit else "the working tree"
        return f"{self.label} = {self.spec} ({what})"


@dataclass
class Side:
    """Every run of one version: per row (section, name) the run's median, and the machine's
    state over each run's cases."""

    version: Version
    rows: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    units: dict[tuple[str, str], str] = field(default_factory=dict)
    machine: list[Mapping[str, Any]] = field(default_factory=list)

    def add_run(self, tables: Sequence[Mapping[str, Any]]) -> None:
        """Keep one run's rows (its medians over its own rounds) and machine records."""
        for table in tables:
            for row in table.get("rows", []):
                key = (str(row.get("section", "")), str(row["name"]))
                self.rows.setdefault(key, []).append(float(row["median"]))
                self.units[key] = str(row.get("unit", ""))
            self.machine.extend(table.get("machine", []))

    def machine_line(self) -> str:
        """The machine over this side's runs, as each script's own line under its table
        (:meth:`report.Results.machine_summary`), named by the side."""
        known = {f.name for f in dataclasses.fields(MachineState)}
        summary = Results(self.version.label)
        for record in self.machine:
            values = {name: value for name, value in record.items() if name in known}
            with contextlib.suppress(TypeError):  # an older version's record lacking a field
                state = MachineState(**values)
                summary.machine.append(MachineRecord(record["round"], record["case"], state))
        line = summary.machine_summary()
        if line is None:
            return f"{self.version.label}: the script recorded no machine state"
        return f"{self.version.label} while measuring" + line.removeprefix(
            "machine while measuring"
        )


def _git(*args: str) -> str:
    done = subprocess.run(  # noqa: S603 -- git on this repository, arguments from this file
        ["git", "-C", str(REPO), *args],  # noqa: S607 -- the git on PATH, as a user runs it
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise UsageError(done.stderr.strip() or f"git {' '.join(args)} failed")
    return done.stdout.strip()


def _commit(spec: str) -> str:
    """The commit ``spec`` names, or a :class:`UsageError` saying it names none."""
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}")
    except UsageError:
        raise UsageError(f"{spec!r} is not a revision of this repository") from None


@contextlib.contextmanager
def _versions(specs: Sequence[str], scratch: Path) -> Iterator[list[Version]]:
    """The two versions, each revision in a detached worktree under ``scratch`` (removed on
    the way out, whatever happened)."""
    versions: list[Version] = []
    made: list[Path] = []
    try:
        for label, spec in zip("AB", specs, strict=True):
            if spec == WORKING_TREE:
                versions.append(Version(label, spec, None, REPO))
                continue
            commit = _commit(spec)
            tree = scratch / f"tree-{label}"
            _git("worktree", "add", "--detach", "--quiet", str(tree), commit)
            made.append(tree)
            versions.append(Version(label, spec, commit, tree))
        yield versions
    finally:
        for tree in made:
            with contextlib.suppress(UsageError):
                _git("worktree", "remove", "--force", str(tree))


def _script(version: Version, name: str) -> Path:
    path = version.tree / "bench" / name
    if not path.is_file():
        raise UsageError(f"{version.describe()} has no bench/{name}")
    return path


def _run(version: Version, script: str, args: Sequence[str], scratch: Path, run: int) -> Any:
    """One run of ``script`` on ``version``: its ``--json`` tables. Its progress and table go
    to stderr as it runs (this tool's own table is the one on stdout)."""
    out = scratch / f"run-{run}-{version.label}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(version.tree), os.environ.get("PYTHONPATH", "")) if p
    )
    workdir = scratch / "cwd"  # no stray module of the caller's directory shadows a sibling
    workdir.mkdir(exist_ok=True)
    argv = [sys.executable, str(_script(version, script)), *args, "--json", str(out)]
    # A script of this repository (checked above), this interpreter; the caller's arguments.
    # In a session of its own: an interrupt reaches it once, from here (below), not also from
    # the terminal, so its own clean-up (a throw-away database, its processes) is not cut short.
    with subprocess.Popen(  # noqa: S603
        argv, cwd=workdir, env=env, stdout=sys.stderr, start_new_session=True
    ) as child:
        try:
            returncode = child.wait()
        except KeyboardInterrupt:
            child.send_signal(signal.SIGINT)
            try:
                child.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                child.kill()
            raise
    if returncode != 0:
        raise RunFailed(f"{version.describe()}: bench/{script} exited {returncode}")
    if not out.is_file():
        raise RunFailed(f"{version.describe()}: bench/{script} wrote no --json file")
    return json.loads(out.read_text(encoding="utf-8"))["tables"]


def _order(pair: int) -> tuple[int, int]:
    """Which side goes first in ``pair`` (0-based): A B, then B A, and so on."""
    return (0, 1) if pair % 2 == 0 else (1, 0)


def _ratio_table(a: Side, b: Side, pairs: int) -> tuple[Table, list[dict[str, Any]]]:
    """Per row both sides measured: A's and B's median over pairs, and B / A per pair."""
    table = Table(show_lines=False)
    for column, justify in (
        ("row", "left"),
        ("unit", "left"),
        ("A", "right"),
        ("B", "right"),
        ("B / A", "right"),
        ("min-max", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    summary: list[dict[str, Any]] = []
    section: str | None = None
    for key, a_values in a.rows.items():
        b_values = b.rows.get(key)
        if b_values is None or len(a_values) != pairs or len(b_values) != pairs:
            continue
        ratios = [
            bv / av if av and math.isfinite(av) and math.isfinite(bv) else math.nan
            for av, bv in zip(a_values, b_values, strict=True)
        ]
        finite = [r for r in ratios if math.isfinite(r)]
        unit = a.units[key]
        if key[0] != section:
            if section is not None:
                table.add_section()
            if key[0]:
                table.add_row(f"[bold]{key[0]}[/bold]", "", "", "", "", "")
            section = key[0]
        ratio = median(ratios)
        table.add_row(
            f"  {key[1]}" if key[0] else key[1],
            unit,
            fmt(median(a_values), unit),
            fmt(median(b_values), unit),
            fmt(ratio, "x"),
            f"{fmt(min(finite), 'x')} - {fmt(max(finite), 'x')}" if finite else "-",
        )
        summary.append(
            {
                "section": key[0],
                "name": key[1],
                "unit": unit,
                "a": a_values,
                "b": b_values,
                "b_over_a": ratios,
                "median_b_over_a": ratio,
            }
        )
    return table, summary


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="python bench/ab.py A B [--pairs N] [--json FILE] -- SCRIPT [ARGS...]",
    )
    parser.add_argument("a", metavar="A", help="a git revision, or '.' for the working tree")
    parser.add_argument("b", metavar="B", help="the other version, the same way")
    parser.add_argument("--pairs", type=int, default=3, help="A-and-B pairs (default 3)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every pair's values")
    parser.add_argument("script", metavar="SCRIPT", help="a script of bench/, e.g. peers.py")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, not {args.pairs}")
    if "--json" in args.args:
        parser.error("the script's --json is this tool's to set: give --json before the --")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = _parse(raw)
    # Ctrl-C or a signal from outside ends the run cleanly, even when started in the
    # background by a shell (which ignores SIGINT there): the script is interrupted in turn
    # and cleans up, then the worktrees are removed. A handler, not an ignored signal, is
    # what the script's own interpreter starts with.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with (
            sigterm_as_interrupt(),
            tempfile.TemporaryDirectory(prefix="outbox-ab-") as scratch_dir,
        ):
            scratch = Path(scratch_dir)
            with _versions([args.a, args.b], scratch) as versions:
                for version in versions:
                    _script(version, args.script)  # both have it, before anything runs
                sides = [Side(v) for v in versions]
                for pair in range(args.pairs):
                    for index in _order(pair):
                        side = sides[index]
                        say(f"pair {pair + 1}/{args.pairs}: {side.version.describe()}")
                        side.add_run(_run(side.version, args.script, args.args, scratch, pair))
    except UsageError as exc:
        print(f"ab.py: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"ab.py: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # or SIGTERM; the worktrees are gone already (``_versions``)
        print("ab.py: interrupted", file=sys.stderr)
        return 130
    a, b = sides
    table, summary = _ratio_table(a, b, args.pairs)
    out = console()
    out.print(f"[bold]A/B: bench/{args.script} {' '.join(args.args)}[/bold]")
    # One line each: a long command line above may wrap, these must stay whole.
    for version in (a.version, b.version):
        out.print(version.describe(), soft_wrap=True)
    pairs = f"{args.pairs} pair" + ("s" if args.pairs != 1 else "")
    out.print(f"{pairs}, alternated (A B, B A, ...)")
    out.print(table)
    out.print(a.machine_line(), soft_wrap=True)
    out.print(b.machine_line(), soft_wrap=True)
    out.print(
        "A and B: each side's median over pairs of the run's own median; B / A: per pair "
        "(the two runs of a pair ran one after the other), then the median."
    )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "script": args.script,
                    "args": args.args,
                    "a": vars(a.version) | {"tree": str(a.version.tree)},
                    "b": vars(b.version) | {"tree": str(b.version.tree)},
                    "pairs": args.pairs,
                    "rows": summary,
                    "machine": {"a": a.machine, "b": b.machine},
                },
                indent=2,
                default=str,
            ),
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
