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


#: A row by its name alone (unique in the table), or by (section, name).
RowRef = str | tuple[str, str]


class Results:
    """Rows in the order they were first added, grouped in sections; a row is identified by
    its section and name."""

    def __init__(self, title: str) -> None:
        self.title = title
        self.rows: dict[tuple[str, str], Row] = {}
        self.notes: list[str] = []

    def add(self, name: str, value: float, *, unit: str, section: str = "") -> None:
        """Append one round's ``value`` to row ``name`` of ``section`` (made on first use)."""
        row = self.rows.get((section, name))
        if row is None:
            row = self.rows[section, name] = Row(name, unit, section)
        row.values.append(value)

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
        self.rows[section, name] = Row(name, "x", section, values, ratio=True)

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
        value = _median(row.values) if row is not None else math.nan
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
                    "median": _median(row.values),
                }
                for row in self.rows.values()
            ],
            "notes": self.notes,
        }


def _median(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def _spread(row: Row) -> str:
    """``min - max`` of the row's finite values, formatted; ``-`` if it has none."""
    finite = [v for v in row.values if math.isfinite(v)]
    return f"{fmt(min(finite), row.unit)} - {fmt(max(finite), row.unit)}" if finite else "-"


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
        finite = [v for v in row.values if math.isfinite(v)]
        label = f"  {row.name}" if row.section else row.name
        table.add_row(
            label, row.unit, fmt(_median(row.values), row.unit), _spread(row), str(len(finite))
        )
    out.print(table)
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
