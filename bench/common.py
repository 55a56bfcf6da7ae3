"""Shared helpers of the benchmarks: rounds, tables, ratios, throw-away databases and vhosts.

Conventions every script follows (``add_common_arguments``):

* ``--url``: a PostgreSQL server on which the benchmark may create and drop databases named
  ``bench_<hex>`` (any PostgreSQL URL: TCP, or a Unix socket as the embedded server gives);
  default ``OUTBOX_BENCH_URL``, else ``OUTBOX_TEST_DATABASE_URL``, else the local server;
* ``--rounds``: every case runs once per round, the cases side by side within a round (their
  order rotating from round to round), so a noisy machine disturbs them alike;
* ``--smoke``: a run of a few seconds that only proves the script still works;
* ``--json FILE``: every value of every round, for comparing runs later.

A table shows, per row, the median over the rounds and the min-max. A ratio row divides two
rows **round by round** (a pair measured close together, in the same round) and then takes the
median of those ratios, not the ratio of the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import socket
import statistics
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from rich.console import Console
from rich.table import Table
from sqlalchemy import make_url, text
from sqlalchemy.pool import NullPool

from outbox import migrate
from outbox.db import create_engine, normalize_url

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
RABBITMQ_HOST = "127.0.0.1"
RABBITMQ_PORT = 5672


def default_url() -> str:
    """``OUTBOX_BENCH_URL``, else ``OUTBOX_TEST_DATABASE_URL``, else the local server."""
    return (
        os.environ.get("OUTBOX_BENCH_URL")
        or os.environ.get("OUTBOX_TEST_DATABASE_URL")
        or DEFAULT_URL
    )


def add_common_arguments(parser: argparse.ArgumentParser, *, rounds: int = 3) -> None:
    """``--url``, ``--rounds``, ``--smoke`` and ``--json``, the same in every script."""
    parser.add_argument(
        "--url",
        default=default_url(),
        help="PostgreSQL server where bench_* databases may be created "
        "(default: OUTBOX_BENCH_URL, OUTBOX_TEST_DATABASE_URL or %(default)s)",
    )
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds (default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="a few seconds: does it still run")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every round's values")


# --- results ------------------------------------------------------------------------------


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


# --- rounds -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One thing measured once per round: ``run()`` returns ``{row name: (value, unit)}``
    (a case may yield several rows, e.g. throughput and latency percentiles)."""

    name: str
    run: Callable[[], Mapping[str, tuple[float, str]]]
    section: str = ""


def run_rounds(
    rounds: int,
    cases: Sequence[Case],
    results: Results,
    *,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Run every case once per round, side by side, the starting case rotating each round.

    Rows are added in the cases' declared order, whatever order a round ran them in.
    """
    report = progress or say
    for r in range(rounds):
        start = r % len(cases) if cases else 0
        measured: dict[int, Mapping[str, tuple[float, str]]] = {}
        for i in [*range(start, len(cases)), *range(start)]:
            report(f"round {r + 1}/{rounds}: {cases[i].name}")
            measured[i] = cases[i].run()
        for i, case in enumerate(cases):
            for row, (value, unit) in measured[i].items():
                results.add(row, value, unit=unit, section=case.section)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def say(line: str) -> None:
    """Progress, on stderr (the table goes to stdout)."""
    console_err.print(f"[dim]{line}[/dim]")


console_err = Console(stderr=True, highlight=False)


# --- throw-away PostgreSQL databases ------------------------------------------------------


def database_url_for(url: str, name: str) -> str:
    """``url`` naming database ``name`` instead (host, socket and credentials kept)."""
    return make_url(normalize_url(url)).set(database=name).render_as_string(hide_password=False)


@contextlib.contextmanager
def throwaway_database(url: str, *, migrated: bool = True) -> Iterator[str]:
    """``CREATE DATABASE bench_<hex>`` on the server of ``url``, migrated; dropped at the end.

    Yields the new database's URL.
    """
    name = f"bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            db_url = database_url_for(url, name)
            if migrated:
                engine = create_engine(db_url, poolclass=NullPool)
                try:
                    migrate.upgrade(engine)
                finally:
                    engine.dispose()
            yield db_url
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


# --- throw-away RabbitMQ vhosts -----------------------------------------------------------


def port_open(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def rabbitmq_available() -> bool:
    """Whether RabbitMQ answers on 127.0.0.1:5672 and ``rabbitmqctl`` can make vhosts."""
    return shutil.which("rabbitmqctl") is not None and port_open(RABBITMQ_HOST, RABBITMQ_PORT)


def _rabbitmqctl(*args: str, check: bool = True) -> None:
    ctl = shutil.which("rabbitmqctl") or "rabbitmqctl"
    subprocess.run([ctl, *args], check=check, capture_output=True, timeout=120)  # noqa: S603


@contextlib.contextmanager
def throwaway_vhost(configured: str | None = None) -> Iterator[str]:
    """An AMQP URL on a new vhost ``bench_<hex>`` (deleted at the end); or ``configured``
    as it is, if given (then nothing is created or deleted)."""
    if configured:
        yield configured
        return
    vhost = f"bench_{uuid.uuid4().hex[:8]}"
    _rabbitmqctl("add_vhost", vhost)
    try:
        _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@{RABBITMQ_HOST}:{RABBITMQ_PORT}/{vhost}"
    finally:
        _rabbitmqctl("delete_vhost", vhost, check=False)


# --- the reference service in a process of its own ---------------------------------------


def _serve(conn: multiprocessing.connection.Connection, options: dict[str, Any]) -> None:
    """The child: run a DeployService and answer method calls from the pipe until "stop"."""
    from outbox.dev.service import DeployService  # noqa: PLC0415 -- in the child

    with DeployService(**options) as service:
        conn.send(service.url)
        while True:
            try:
                method, args = conn.recv()
            except EOFError:  # the parent died
                return
            if method == "stop":
                conn.send(None)
                return
            conn.send(getattr(service, method)(*args))


class ServiceProcess:
    """The reference service (:class:`DeployService`) in a child process, driven over a pipe.

    Its own interpreter, so its GIL is not the agents'; like a real remote, it shares only
    the machine. ``options`` are DeployService's keyword arguments.
    """

    def __init__(self, **options: Any) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child, options), name="deploy-service", daemon=True
        )
        self.process.start()
        child.close()
        if not self._conn.poll(30):
            self.process.kill()
            raise RuntimeError("the reference service did not start within 30 s")
        self.url: str = self._conn.recv()

    @property
    def pid(self) -> int:
        """The child's process id."""
        assert self.process.pid is not None  # noqa: S101 -- started in __init__
        return self.process.pid

    def call(self, method: str, *args: Any) -> Any:
        """``service.<method>(*args)`` in the child; its result."""
        self._conn.send((method, args))
        return self._conn.recv()

    def arrivals(self) -> dict[str, float]:
        """Key -> wall time of its first create request."""
        result: dict[str, float] = self.call("arrivals")
        return result

    def effects_by_key(self) -> dict[str, int]:
        """Key -> effects committed."""
        result: dict[str, int] = self.call("effects_by_key")
        return result

    def clear(self) -> None:
        """Forget every effect and arrival."""
        self.call("clear")

    def stop(self) -> None:
        """Stop the service and its process."""
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError):
                self._conn.send(("stop", ()))
                self._conn.recv()
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()

    def __enter__(self) -> ServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- CPU accounting (Linux /proc) ---------------------------------------------------------

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 if it is gone or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def pids_named(*names: str) -> list[int]:
    """Pids of the processes whose command name (``/proc/PID/comm``) is one of ``names``."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if (entry / "comm").read_text().strip() in names:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


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
