"""The size comparison: every size loaded, the code paths timed round by round, the ratios of
the largest size to the smallest and the verdict against the target.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Mapping

from report import Results, say
from scale_data import loaded_database, size_label, vacuum
from scale_explain import Plan, capture, explain
from scale_paths import MS, Scale, lookup_registry

CLAIM = "claim, {due} due (median of {n} calls, rolled back)"
RELAY = "Relay.run_once, {due} due, publisher confirms none (median of {n})"
SWEEP = "Sweeper.run_once: {due} stale sent + {due} due unknown -> {due2} lookups"
IDLE = "Sweeper.run_once, nothing due (median of {n})"


def size_ratios(args: argparse.Namespace, results: Results, sections: Mapping[str, str]) -> None:
    """Ratio rows: every larger size over the smallest, per measurement; the verdict."""
    small, big = min(args.sizes), max(args.sizes)
    shorts = {"claim": "claim", "relay": "relay pass", "sweep": "sweep", "idle": "idle sweep"}
    for kind, short in shorts.items():
        for size in sorted(args.sizes)[1:]:
            results.ratio(
                f"{short} {size_label(size)} / {size_label(small)}",
                (sections[kind], f"{size_label(size)} terminal rows"),
                (sections[kind], f"{size_label(small)} terminal rows"),
            )
    for short in ("claim", "sweep"):
        ratio = f"{short} {size_label(big)} / {size_label(small)}"
        results.target(f"{ratio} <= {args.target:g}x", ("ratios", ratio), at_most=args.target)


def measure_sizes(args: argparse.Namespace, results: Results) -> dict[int, list[Plan]]:
    """Load every size, then run the rounds; the EXPLAIN summaries by size."""
    due = args.due
    sections = {
        "claim": CLAIM.format(due=due, n=args.claims),
        "relay": RELAY.format(due=due, n=args.passes),
        "sweep": SWEEP.format(due=due, due2=2 * due),
        "idle": IDLE.format(due=due, n=args.idle_runs),
    }
    registry = lookup_registry()
    plans: dict[int, list[Plan]] = {}
    with contextlib.ExitStack() as stack:
        scales = []
        for size in args.sizes:
            db = stack.enter_context(loaded_database(args.url, size, due, args.not_due))
            results.note(
                f"{size_label(size)}: {size:,} terminal operations (+ {3 * due} live and due, "
                f"{3 * args.not_due} live not due), "
                f"operations + events {db.table_mb:,.0f} MB with indexes, loaded in "
                f"{db.load_s:.0f} s"
            )
            scales.append(Scale(db, due, registry))
        for r in range(args.rounds):
            start = r % len(scales)
            measured: dict[tuple[str, int], float] = {}
            for scale in [*scales[start:], *scales[:start]]:
                size = scale.db.size
                say(f"round {r + 1}/{args.rounds}: {size_label(size)}")
                with contextlib.ExitStack() as watch:
                    captured = watch.enter_context(capture(scale.db.engine)) if r == 0 else None
                    measured["claim", size] = scale.claim(args.claims)
                    measured["relay", size] = scale.relay_pass(args.passes)
                    measured["sweep", size] = scale.sweep()
                    measured["idle", size] = scale.idle_sweep(args.idle_runs)
                    if captured is not None:
                        scale.relay_extras()
                scale.reset()
                if captured is not None:
                    plans[size] = explain(scale.db.engine, captured)
                    vacuum(scale.db.engine, "outbox.operations")
            for kind, section in sections.items():
                for scale in scales:
                    size = scale.db.size
                    results.add(
                        f"{size_label(size)} terminal rows",
                        measured[kind, size],
                        unit=MS,
                        section=section,
                    )
    size_ratios(args, results, sections)
    return plans
