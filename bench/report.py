"""What a benchmark prints and writes: rows per round, tables of medians, ratios, JSON.

A table shows, per row, the median over the rounds and the min-max. A ratio row divides two
rows **round by round** (a pair measured close together, in the same round) and then takes the
median of those ratios, not the ratio of the medians. Progress lines (``say``) go to stderr,
the tables to stdout.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from machine import STEAL_LIMIT, MachineState
from rich.console import Console
from rich.table import Table


@dataclass
class Row:
    """One measured quantity: a value per round."""

    name: str
    unit: str
    section: str
    values: list[float] = field(default_factory=list)
    #: Shown with an "x" and computed round by round from two other rows.
    ratio: bool = False
    #: Per value: measured above the steal limit (kept in min-max and JSON, not in the median).
    marked: list[bool] = field(default_factory=list)

    def kept(self) -> list[float]:
        """The values the median is taken over: the unmarked ones (all, if every one is)."""
        unmarked = [v for v, m in zip(self.values, self._marks(), strict=True) if not m]
        return unmarked or self.values

    def _marks(self) -> list[bool]:
        return self.marked + [False] * (len(self.values) - len(self.marked))

    def median(self) -> float:
        """The median of :meth:`kept` (NaN if none is finite)."""
        return median(self.kept())

    def marked_count(self) -> int:
        """How many values were measured above the steal limit."""
        return sum(self._marks())


@dataclass(frozen=True)
class MachineRecord:
    """The machine's state while one case ran in one round (``machine``)."""

    round: int
    case: str
    state: MachineState


#: A row by its name alone (unique in the table), or by (section, name).
RowRef = str | tuple[str, str]


class Results:
    """Rows in the order they were first added, grouped in sections; a row is identified by
    its section and name."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.rows: dict[tuple[str, str], Row] = {}
        self.notes: list[str] = []
        self.machine: list[MachineRecord] = []
        self.steal_limit = STEAL_LIMIT

    def add(
        self, name: str, value: float, *, unit: str, section: str = "", marked: bool = False
    ) -> None:
        """Append one round's ``value`` to row ``name`` of ``section`` (made on first use);
        ``marked``: it was measured above the steal limit (left out of the median)."""
        row = self.rows.get((section, name))
        if row is None:
            row = self.rows[section, name] = Row(name, unit, section)
        row.marked.extend([False] * (len(row.values) - len(row.marked)))
        row.values.append(value)
        row.marked.append(marked)

    def record_machine(self, round_number: int, case: str, state: MachineState) -> bool:
        """Keep the machine's state while ``case`` ran in round ``round_number`` (1-based);
        True if it ran above the steal limit (its values are then marked), with a note."""
        self.machine.append(MachineRecord(round_number, case, state))
        marked = state.marked(self.steal_limit)
        if marked:
            self.note(
                f"marked: round {round_number}, {case} ran at {state.steal_pct:.1f} % steal "
                f"(> {self.steal_limit:g} %): in min-max, not in the median"
            )
        return marked

    def find(self, ref: RowRef) -> Row | None:
        """The row ``ref`` names, if it exists (a bare name must be unique)."""
        if isinstance(ref, tuple):
            return self.rows.get(ref)
        found = [row for (_, name), row in self.rows.items() if name == ref]
        return found[0] if len(found) == 1 else None

    def ratio(
        self, name: str, numerator: RowRef, denominator: RowRef, *, section: str = "ratios"
    ) -> None:
        """Row ``name``: ``numerator / denominator`` per round (pairs by round index);
        nothing if either row is missing."""
        top, bottom = self.find(numerator), self.find(denominator)
        if top is None or bottom is None:
            return
        values = [a / b if b else math.nan for a, b in zip(top.values, bottom.values, strict=False)]
        marks = [a or b for a, b in zip(top._marks(), bottom._marks(), strict=False)]
        self.rows[section, name] = Row(name, "x", section, values, ratio=True, marked=marks)

    def note(self, line: str) -> None:
        """A line printed under the table."""
        self.notes.append(line)

    def target(
        self,
        goal: str,
        ref: RowRef,
        *,
        at_least: float | None = None,
        at_most: float | None = None,
    ) -> bool | None:
        """Say under the table whether row ``ref``'s median meets ``goal`` (``at_least`` or
        ``at_most`` a bound), with its min-max; None (and a line saying so) if not measured."""
        row = self.find(ref)
        value = row.median() if row is not None else math.nan
        if row is None or not math.isfinite(value):
            self.note(f"target {goal}: not measured in this run")
            return None
        met = (at_least is None or value >= at_least) and (at_most is None or value <= at_most)
        unit = "x" if row.unit == "x" else f" {row.unit}"
        self.note(
            f"target {goal}: {fmt(value, row.unit)}{unit} (median; {_spread(row)}): "
            f"{'met' if met else 'NOT met'}"
        )
        return met

    def to_json(self) -> dict[str, Any]:
        """Every row with its per-round values."""
        return {
            "title": self.title,
            "rows": [
                {
                    "name": row.name,
                    "unit": row.unit,
                    "section": row.section,
                    "values": row.values,
                    "marked": row._marks(),
                    "median": row.median(),
                }
                for row in self.rows.values()
            ],
            "machine": [{"round": m.round, "case": m.case, **vars(m.state)} for m in self.machine],
            "steal_limit": self.steal_limit,
            "notes": self.notes,
        }

    def machine_summary(self) -> str | None:
        """One line: steal, busy, the emulated steal (under ``--contend``), CPU pressure and
        the CPU probe over every case, median and worst; None if nothing was recorded."""
        if not self.machine:
            return None
        steal = [m.state.steal_pct for m in self.machine]
        busy = [m.state.busy_pct for m in self.machine]
        line = (
            f"machine while measuring ({len(self.machine)} cases): steal median "
            f"{statistics.median(steal):.1f} % (max {max(steal):.1f}), busy median "
            f"{statistics.median(busy):.0f} % (max {max(busy):.0f})"
        )
        for label, values, digits, source in (
            ("emulated steal", [m.state.emulated_steal_pct for m in self.machine], 1, "contend"),
            ("CPU pressure", [m.state.pressure_pct for m in self.machine], 0, None),
            ("CPU probe", [m.state.probe_ms for m in self.machine], 1, "machine"),
        ):
            line += _median_and_max(label, values, digits, source)
        return line


def _median_and_max(label: str, values: Sequence[float], digits: int, source: str | None) -> str:
    """``, <label> median <v> <unit> (max <v>[; bench/<source>.py])`` over the finite
    ``values`` (the probe in ms, the rest in %); empty if there are none."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    unit = "ms" if label == "CPU probe" else "%"
    where = f"; bench/{source}.py" if source else ""
    return (
        f", {label} median {statistics.median(finite):.{digits}f} {unit} "
        f"(max {max(finite):.{digits}f}{where})"
    )


def median(values: Sequence[float]) -> float:
    """The median of the finite ``values`` (NaN if none is)."""
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def _spread(row: Row) -> str:
    """``min - max`` of the row's finite values, formatted; ``-`` if it has none."""
    finite = [v for v in row.values if math.isfinite(v)]
    return f"{fmt(min(finite), row.unit)} - {fmt(max(finite), row.unit)}" if finite else "-"


def _count(row: Row) -> str:
    """The table's ``n``: the finite values the median took, and ``+Km`` for K marked ones
    left out (``Km`` alone: every value was marked, so the median took them all)."""
    marked = row.marked_count()
    finite = sum(1 for v in row.kept() if math.isfinite(v))
    if not marked:
        return str(finite)
    return f"{marked}m" if marked == len(row.values) else f"{finite} +{marked}m"


def fmt(value: float, unit: str = "") -> str:
    """A number with as many digits as it deserves (thousands separated)."""
    if not math.isfinite(value):
        return "-"
    if unit == "x":
        return f"{value:.2f}"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def console() -> Console:
    """A console at least 120 columns wide, even when the output is a pipe or a file."""
    width = shutil.get_terminal_size((120, 40)).columns
    return Console(width=max(width, 120), highlight=False)


def print_table(results: Results, out: Console | None = None) -> None:
    """Print ``results``: per row its median and min-max over the rounds."""
    out = out or console()
    out.print(f"[bold]{results.title}[/bold]")
    table = Table(show_lines=False)
    table.add_column("case")
    table.add_column("unit")
    table.add_column("median", justify="right")
    table.add_column("min-max", justify="right")
    table.add_column("n", justify="right")
    section: str | None = None
    for row in results.rows.values():
        if section is not None and row.section != section:
            table.add_section()
        if row.section != section and row.section:
            table.add_row(f"[bold]{row.section}[/bold]", "", "", "", "")
        section = row.section
        label = f"  {row.name}" if row.section else row.name
        count = _count(row)
        table.add_row(label, row.unit, fmt(row.median(), row.unit), _spread(row), count)
    out.print(table)
    summary = results.machine_summary()
    if summary:
        out.print(summary)
    for line in results.notes:
        out.print(line)


def write_json(path: Path | None, tables: Iterable[Results], meta: Mapping[str, Any]) -> None:
    """Write ``tables`` (with ``meta``: the arguments) to ``path``, if given."""
    if path is None:
        return
    data = {
        "meta": {key: _without_password(value) for key, value in meta.items()},
        "tables": [t.to_json() for t in tables],
    }
    path.write_text(json.dumps(data, indent=2, default=str), encoding="utf-8")


def _without_password(value: object) -> object:
    """A URL with its password masked; anything else as it is."""
    if not isinstance(value, str) or "://" not in value:
        return value
    parts = urlsplit(value)
    if parts.password is None:
        return value
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def say(line: str) -> None:
    """Progress, on stderr (the table goes to stdout)."""
    console_err.print(f"[dim]{line}[/dim]")


console_err = Console(stderr=True, highlight=False)
