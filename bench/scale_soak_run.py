"""The soak run: a database loaded, the pipeline started, every window measured and printed
as a table; first/last/worst-window claim latencies and ratios into the summary.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from cpu import machine_busy_s
from report import Results, console, say
from rich import box
from rich.console import Console
from rich.table import Table
from rounds import percentile
from scale_data import checkpoint, load_terminal, size_label, vacuum
from scale_paths import MS
from scale_server import (
    autovacuum_runs,
    explain_claim,
    print_autovacuum,
    reset_storage,
    sample,
    soak_server,
    storage_settings,
)
from scale_soak import Soak, Window
from sqlalchemy import Engine, text
from throwaway import throwaway_database

from outbox.db import create_engine


def _ms(values: Sequence[float], q: float) -> float:
    return 1000 * percentile(values, q) if values else math.nan


def run_soak(args: argparse.Namespace, summary: Results) -> None:
    """The soak: windows printed as a table, first/last/worst ratios into ``summary``."""
    rows = args.soak_rows
    with soak_server(args) as server, throwaway_database(server.url) as url:
        engine = create_engine(url, pool_size=2)
        try:
            started = time.perf_counter()
            load_terminal(engine, rows, label=f"soak {size_label(rows)}")
            vacuum(engine, "outbox.operations", "outbox.events", analyze=True)
            checkpoint(engine)
            say(f"soak: {rows:,} terminal rows loaded in {time.perf_counter() - started:.0f} s")
            if args.soak_storage == "defaults":
                reset_storage(engine)
            settings = storage_settings(engine)
            with engine.connect() as conn:
                log_since = str(conn.execute(text("SELECT now()::timestamp(0)::text")).scalar())
            soak = Soak(url, args)
            soak.start()
            try:
                table, collected = _soak_windows(args, soak, engine)
            finally:
                soak.finish()
            wide = Console(width=max(console().width, 200), highlight=False)
            wide.print(table)
            for line in settings:
                wide.print(line)
            if server.log is not None:
                print_autovacuum(autovacuum_runs(server.log, log_since), wide)
        finally:
            engine.dispose()
    pause = (
        f"The workers were stopped from {args.soak_pause_at:g} min for {args.soak_pause:g} s."
        if args.soak_pause > 0
        else ""
    )
    _soak_ratios(collected, summary, pause)


def _soak_windows(
    args: argparse.Namespace, soak: Soak, engine: Engine
) -> tuple[Table, list[tuple[Window, dict[str, Any]]]]:
    """Warm up, then record every window: its row in the table, and what it collected."""
    window_s: float = args.soak_window
    windows = max(1, math.ceil(60 * args.soak_minutes / window_s))
    say(f"soak: warming up for {args.soak_warmup:g} s")
    time.sleep(args.soak_warmup)
    soak.recorder.cut()
    table = _soak_table(args)
    collected: list[tuple[Window, dict[str, Any]]] = []
    window_started = time.perf_counter()
    busy_before = machine_busy_s()
    pause_from = window_started + 60 * args.soak_pause_at
    pause_until = pause_from + args.soak_pause
    for w in range(windows):
        next_cut = window_started + (w + 1) * window_s
        while (left := next_cut - time.perf_counter()) > 0:
            now = time.perf_counter()
            if args.soak_pause > 0 and pause_from <= now < pause_until:
                soak.paused.set()
            else:
                soak.paused.clear()
            if soak.stop.wait(min(left, 1.0)):
                raise RuntimeError("the soak stopped early") from (
                    soak.errors[0] if soak.errors else None
                )
        window = soak.recorder.cut()
        stats = sample(engine)
        stats |= explain_claim(engine, soak.recorder.claim_statement)
        busy_now = machine_busy_s()
        stats["busy"] = _busy_percent(busy_before, busy_now)
        busy_before = busy_now
        collected.append((window, stats))
        _soak_row(table, w, window, stats, window_s)
        say(
            f"soak window {w + 1}/{windows}: claim p50 {_ms(window.claims, 50):.2f} ms "
            f"p99 {_ms(window.claims, 99):.2f} ms, claim buffers {stats['claim_buffers']}, "
            f"{window.done / window_s:.0f} ops/s, dead {stats['ops_dead']:,}, "
            f"autovacuums {stats['ops_av']}"
        )
    return table, collected


def _busy_percent(before: tuple[float, float], after: tuple[float, float]) -> float:
    """The machine's busy CPU between two samples, in % of all its cores."""
    spent = after[1] - before[1]
    return 100 * (after[0] - before[0]) / spent if spent > 0 else math.nan


def _soak_table(args: argparse.Namespace) -> Table:
    table = Table(
        title=f"soak: {args.soak_rate:g} intents/s for {args.soak_minutes:g} min over "
        f"{size_label(args.soak_rows)} terminal rows, {args.soak_window:g} s windows "
        "(claim: the claim statement's latency at the driver, ms; claim bufs/exec: EXPLAIN "
        "(ANALYZE, BUFFERS) of it at the window's end, buffers and ms; cpu: the machine's)",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    columns = [
        "end",
        "enq/s",
        "done/s",
        "live",
        "pub wait",
        "claims",
        "claim p50",
        "p99",
        "max",
        "claim bufs",
        "exec",
        "pass p50",
        "sweep p50",
        "ops dead",
        "ops AV",
        "since AV",
        "ev dead",
        "ev AV",
        "idx kB",
        "cpu %",
        "vacuum now",
    ]
    for column in columns:
        if column == "vacuum now":
            table.add_column(column, no_wrap=True)
        else:
            table.add_column(column, justify="right")
    return table


def _soak_row(
    table: Table, index: int, window: Window, stats: Mapping[str, Any], window_s: float
) -> None:
    since = stats["ops_since_av"]
    end = (index + 1) * window_s
    table.add_row(
        f"{int(end // 60)}:{int(end % 60):02d}",
        f"{window.enqueued / window_s:.0f}",
        f"{window.done / window_s:.0f}",
        f"{stats['live']:,}",
        f"{stats['published']:,}",
        f"{len(window.claims):,}",
        f"{_ms(window.claims, 50):.2f}",
        f"{_ms(window.claims, 99):.2f}",
        f"{_ms(window.claims, 100):.1f}",
        f"{stats['claim_buffers']:,}",
        f"{stats['claim_exec_ms']:.2f}",
        f"{_ms(window.passes, 50):.2f}",
        f"{_ms(window.sweeps, 50):.0f}",
        f"{stats['ops_dead']:,}",
        str(stats["ops_av"]),
        "-" if since is None else f"{float(since):.0f} s",
        f"{stats['ev_dead']:,}",
        str(stats["ev_av"]),
        f"{stats['index_kb']:,}",
        f"{stats['busy']:.0f}",
        stats["vacuuming"],
    )


def _soak_ratios(
    collected: Sequence[tuple[Window, Mapping[str, Any]]], summary: Results, pause: str
) -> None:
    if not collected:
        return
    section = "soak: claim latency (the claim statement at the driver)"
    first, last = collected[0][0], collected[-1][0]
    worst50 = max(_ms(w.claims, 50) for w, _ in collected)
    worst99 = max(_ms(w.claims, 99) for w, _ in collected)
    for name, value in (
        ("first window p50", _ms(first.claims, 50)),
        ("last window p50", _ms(last.claims, 50)),
        ("worst window p50", worst50),
        ("first window p99", _ms(first.claims, 99)),
        ("last window p99", _ms(last.claims, 99)),
        ("worst window p99", worst99),
    ):
        summary.add(name, value, unit=MS, section=section)
    buffers = _soak_buffers(collected, summary)
    for q in ("p50", "p99"):
        summary.ratio(
            f"soak claim {q}: last window / first window",
            (section, f"last window {q}"),
            (section, f"first window {q}"),
            section="soak ratios",
        )
        summary.ratio(
            f"soak claim {q}: worst window / first window",
            (section, f"worst window {q}"),
            (section, f"first window {q}"),
            section="soak ratios",
        )
    for which in ("last", "worst"):
        summary.ratio(
            f"soak claim buffers: {which} window / first window",
            (buffers, f"{which} window buffers"),
            (buffers, "first window buffers"),
            section="soak ratios",
        )
    autovacuums = collected[-1][1]["ops_av"] - collected[0][1]["ops_av"]
    if pause:
        summary.note(pause)
    summary.note(
        f"Soak: {len(collected)} windows; autovacuums of outbox.operations during the windows: "
        f"{autovacuums} (count at the end {collected[-1][1]['ops_av']})."
    )


def _soak_buffers(collected: Sequence[tuple[Window, Mapping[str, Any]]], summary: Results) -> str:
    """The claim's buffers (EXPLAIN at each window's end): first, last, worst; the section."""
    section = "soak: claim buffers (EXPLAIN ANALYZE of the claim at the window's end)"
    buffers = [float(stats["claim_buffers"]) for _, stats in collected]
    for name, value in (
        ("first window buffers", buffers[0]),
        ("last window buffers", buffers[-1]),
        ("worst window buffers", max(buffers)),
    ):
        summary.add(name, value, unit="buffers", section=section)
    return section
