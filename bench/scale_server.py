"""The soak's server: started when not given (autovacuum on, every autovacuum logged), sampled
each window (statistics, backlog, vacuum running, EXPLAIN of the claim), its settings and
autovacuum reports read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from report import say
from rich.console import Console
from rich.table import Table
from sqlalchemy import Engine, text

from outbox.db import create_engine

_STATS = text(
    """
    SELECT relname, n_live_tup, n_dead_tup, autovacuum_count, autoanalyze_count,
           extract(epoch FROM clock_timestamp() - last_autovacuum) AS since_autovacuum
    FROM pg_stat_user_tables
    WHERE schemaname = 'outbox' AND relname IN ('operations', 'events')
    """
)
_BACKLOG = text(
    "SELECT (SELECT count(*) FROM outbox.operations WHERE state = 'planned') AS planned, "
    "(SELECT count(*) FROM outbox.operations WHERE state = 'sent') AS sent, "
    "(SELECT count(*) FROM outbox.operations WHERE state = 'unknown') AS unknown, "
    "(SELECT count(*) FROM outbox.operations WHERE state = 'planned' "
    "AND published_at IS NOT NULL) AS published"
)
_VACUUMING = text(
    "SELECT string_agg(left(c.relname, 3) || ': ' || p.phase, ', ') "
    "FROM pg_stat_progress_vacuum p "
    "JOIN pg_class c ON c.oid = p.relid WHERE p.datname = current_database()"
)
_INDEX_KB = text("SELECT pg_relation_size('outbox.ix_operations_planned_unpublished') / 1024")


def sample(engine: Engine) -> dict[str, Any]:
    """The tables' statistics, the backlog and any vacuum running, now."""
    with engine.connect() as conn:
        stats = {row.relname: row for row in conn.execute(_STATS)}
        backlog = conn.execute(_BACKLOG).one()
        vacuuming = conn.execute(_VACUUMING).scalar_one()
        index_kb = conn.execute(_INDEX_KB).scalar_one()
    ops, evs = stats["operations"], stats["events"]
    return {
        "live": int(backlog.planned + backlog.sent + backlog.unknown),
        "published": int(backlog.published),
        "ops_dead": int(ops.n_dead_tup),
        "ops_av": int(ops.autovacuum_count),
        "ops_since_av": ops.since_autovacuum,
        "ev_dead": int(evs.n_dead_tup),
        "ev_av": int(evs.autovacuum_count),
        "vacuuming": vacuuming or "",
        "index_kb": int(index_kb),
    }


def reset_storage(engine: Engine) -> None:
    """Back to PostgreSQL's defaults: RESET every storage option of the outbox tables."""
    with engine.begin() as conn:
        rows = conn.execute(
            text(
                "SELECT relname, reloptions FROM pg_class "
                "WHERE relnamespace = 'outbox'::regnamespace AND relkind = 'r' "
                "AND reloptions IS NOT NULL"
            )
        ).all()
        for row in rows:
            names = ", ".join(option.split("=", 1)[0] for option in row.reloptions)
            conn.execute(text(f"ALTER TABLE outbox.{row.relname} RESET ({names})"))


def explain_claim(engine: Engine, claim: tuple[str, Any] | None) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of the relay's claim as it last ran, rolled back: the
    buffers it touched and its execution time (noise-free, unlike a latency)."""
    if claim is None:
        return {"claim_buffers": math.nan, "claim_exec_ms": math.nan}
    sql, parameters = claim
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {sql}", parameters)
        row = cursor.fetchone()
        cursor.close()
        raw.rollback()
    finally:
        raw.close()
    if row is None:
        return {"claim_buffers": math.nan, "claim_exec_ms": math.nan}
    document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    plan = document[0]["Plan"]
    return {
        "claim_buffers": int(plan.get("Shared Hit Blocks", 0))
        + int(plan.get("Shared Read Blocks", 0)),
        "claim_exec_ms": float(document[0].get("Execution Time", math.nan)),
    }


_SERVER_SETTINGS = (
    "server_version",
    "autovacuum",
    "autovacuum_naptime",
    "autovacuum_vacuum_threshold",
    "autovacuum_vacuum_scale_factor",
    "autovacuum_vacuum_insert_threshold",
    "autovacuum_vacuum_insert_scale_factor",
    "autovacuum_analyze_scale_factor",
    "autovacuum_vacuum_cost_limit",
    "autovacuum_vacuum_cost_delay",
    "shared_buffers",
)


def storage_settings(engine: Engine) -> list[str]:
    """The server's autovacuum settings and the outbox tables' storage options, as lines."""
    with engine.connect() as conn:
        values = {
            row.name: f"{row.setting}{row.unit or ''}"
            for row in conn.execute(
                text("SELECT name, setting, unit FROM pg_settings WHERE name = ANY(:names)"),
                {"names": list(_SERVER_SETTINGS)},
            )
        }
        options = conn.execute(
            text(
                "SELECT relname, reloptions FROM pg_class "
                "WHERE relnamespace = 'outbox'::regnamespace "
                "AND relname IN ('operations', 'events') "
                "ORDER BY relname"
            )
        ).all()
    server = ", ".join(f"{name}={values[name]}" for name in _SERVER_SETTINGS if name in values)
    tables = "; ".join(
        f"outbox.{row.relname}: {', '.join(row.reloptions) if row.reloptions else 'defaults'}"
        for row in options
    )
    return [f"Soak server: {server}", f"Table storage options: {tables}"]


@dataclass(frozen=True)
class SoakServer:
    """Where the soak runs; ``log`` is the server's log when the soak started it."""

    url: str
    log: Path | None


@contextlib.contextmanager
def soak_server(args: argparse.Namespace) -> Iterator[SoakServer]:
    """A server with autovacuum on: ``--soak-url``, else a private cluster that logs every
    autovacuum run (``log_autovacuum_min_duration = 0``)."""
    if args.soak_url:
        yield SoakServer(args.soak_url, None)
        return
    from outbox.dev.clusters import LocalCluster  # noqa: PLC0415 -- only for the soak

    root = Path(tempfile.mkdtemp(prefix="outbox-scale-"))
    cluster = LocalCluster(root / "cluster")
    say(f"soak: starting a private PostgreSQL in {root}")
    try:
        cluster.start()
        admin = create_engine(cluster.url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(text("ALTER SYSTEM SET log_autovacuum_min_duration = 0"))
                conn.execute(text("SELECT pg_reload_conf()"))
        finally:
            admin.dispose()
        yield SoakServer(cluster.url, cluster.log_path)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


_AUTOVACUUM_LINE = re.compile(
    r"^(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\S* \S+ \[\d+\] LOG:  automatic "
    r"(?P<kind>vacuum|analyze) of table \"[^\"]+\.outbox\.(?P<table>\w+)\"(?P<rest>.*)$"
)


@dataclass
class AutovacuumRun:
    """One autovacuum (or autoanalyze) of an outbox table, from the server's log."""

    at: str
    kind: str
    table: str
    lines: list[str]

    def field(self, pattern: str) -> str:
        """The first group of ``pattern`` in the report, or ``-``."""
        for line in self.lines:
            found = re.search(pattern, line)
            if found:
                return found.group(1)
        return "-"

    @property
    def index_pass(self) -> str:
        """``done`` (dead index entries removed), ``bypassed`` or ``-``."""
        text_ = " ".join(self.lines)
        if "index scan bypassed" in text_:
            return "bypassed"
        if "index scan needed" in text_:
            return "done"
        return "not needed" if "index scan not needed" in text_ else "-"


def autovacuum_runs(log: Path, since: str) -> list[AutovacuumRun]:
    """Every autovacuum/autoanalyze report of ``operations`` or ``events`` logged at or after
    ``since``."""
    runs: list[AutovacuumRun] = []
    current: AutovacuumRun | None = None
    for line in log.read_text(errors="replace").splitlines():
        found = _AUTOVACUUM_LINE.match(line)
        if found:
            current = AutovacuumRun(found["at"], found["kind"], found["table"], [found["rest"]])
            if found["at"] >= since and found["table"] in ("operations", "events"):
                runs.append(current)
        elif current is not None and line.startswith(("\t", " ")):
            current.lines.append(line.strip())
        else:
            current = None
    return runs


def print_autovacuum(runs: Sequence[AutovacuumRun], out: Console) -> None:
    """The autovacuum reports as a table."""
    table = Table(title="autovacuum of the outbox tables during the soak (the server's log)")
    for column in ("at", "what", "table", "index pass", "dead items", "pages scanned", "elapsed"):
        table.add_column(column)
    for run in runs:
        vacuumed = run.kind == "vacuum"
        table.add_row(
            run.at[11:],
            run.kind,
            run.table,
            run.index_pass if vacuumed else "",
            run.field(r"(\d+) dead item identifiers") if vacuumed else "",
            run.field(r"(\d+) scanned") if vacuumed else "",
            run.field(r"elapsed: ([\d.]+ s)"),
        )
    out.print(table)
