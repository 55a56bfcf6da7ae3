"""``outbox demo``: about 200 releases through crashes and faults, and the evidence."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from outbox.cli.common import connected
from outbox.cli.extras import needs_extra
from outbox.cli.output import console

if TYPE_CHECKING:
    from outbox.dev.demo import DemoReport


def demo_command(
    intents: Annotated[int, typer.Option(min=20, max=5000, help="Releases the agent makes.")] = 200,
    timeout: Annotated[
        float, typer.Option(min=10, help="Seconds allowed for every decision after the script.")
    ] = 100.0,
) -> None:
    """Watch an agent's releases go through crashes without a duplicate, then check it.

    Starts a relay, two workers, beat and the metrics endpoint (the embedded PostgreSQL
    unless OUTBOX_DATABASE_URL is set; the database as broker unless OUTBOX_BROKER_URL is),
    the reference deployment service with ambiguous faults, and a scripted agent: about 200
    releases, a worker SIGKILLed mid-run, the agent restarted (it enqueues the same intents
    again), and a legacy tool with neither lookup nor dedup. Ends with a report and the
    commands that resolve what waits for a person. Exits 0 only if every check held: no
    release created twice, every operation decided, every verdict matching the service.
    The demo's operations stay in the database (intent keys `demo-<run>-…`).
    """
    from outbox import migrate  # noqa: PLC0415 -- not for --help
    from outbox.config import get_settings  # noqa: PLC0415 -- not for --help
    from outbox.db import redact  # noqa: PLC0415 -- not for --help

    # Deferred: the demo runs a worker, relay and beat and serves metrics, which need the
    # [worker] extra; it loads (with the reference service) only here.
    with needs_extra("worker", "demo"):
        from outbox.dev.demo import Demo  # noqa: PLC0415 -- not for --help

    with connected() as engine:
        url = engine.url.render_as_string(hide_password=False)
        console.print(f"database: {redact(url)}", highlight=False, soft_wrap=True)
        migrate.upgrade(engine)
        with Progress(
            TextColumn("[bold]decided"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as progress:
            bar = progress.add_task("", total=intents, visible=False)

            def on_progress(states: dict[str, int], total: int) -> None:
                decided = sum(states.get(s, 0) for s in ("confirmed", "failed", "needs_human"))
                detail = "  ".join(f"{k} {v}" for k, v in sorted(states.items()))
                progress.update(
                    bar, completed=decided, total=total, description=detail, visible=True
                )

            demo = Demo(
                engine,
                url,
                intents=intents,
                timeout_s=timeout,
                workdir=get_settings().home / "demo",
                say=lambda line: progress.console.print(line, highlight=False),
                progress=on_progress,
            )
            report = demo.run()
    _print_report(report)
    if not report.ok:
        for problem in report.problems:
            console.print(f"[red]FAILED:[/] {problem}", highlight=False)
        raise typer.Exit(1)


def _print_report(report: DemoReport) -> None:
    table = Table(title=f"demo run {report.run}: {report.seconds:.0f}s", title_justify="left")
    table.add_column("")
    table.add_column("", justify="right")
    rows = [
        ("intents the agent made", report.intents),
        ("  replayed after its restart, same operation back", report.reenqueued_same),
        ("releases created at the service", report.effects),
        ("releases created twice (duplicates)", report.duplicates),
        ("confirmed", report.states.get("confirmed", 0)),
        ("failed (refused by the service)", report.states.get("failed", 0)),
        ("needs_human (the legacy tool, ambiguous)", report.states.get("needs_human", 0)),
        ("undecided", report.undecided),
    ]
    for label, value in rows:
        table.add_row(label, str(value))
    console.print(table)
    if report.waiting:
        console.print(
            "\nWaiting for a person: the legacy API cannot be asked, so check the remote, then:"
        )
        for op_id, _tool, ref in report.waiting:
            if ref is not None:
                verdict = f"--applied --remote-ref {ref}"
                why = "its ledger shows the release"
            else:
                verdict = "--not-applied --replay"
                why = "its ledger has no such release"
            console.print(
                f"  outbox ops resolve {op_id} {verdict} --by you --note '{why}'",
                highlight=False,
                soft_wrap=True,
            )
        console.print("  (see each first: outbox ops show ID)", highlight=False)
    console.print(
        f"\nMetrics were served at {report.metrics_url} during the run. For a lasting stack: "
        "`outbox up` (panel, metrics on :9464), `outbox flower` (Flower on 127.0.0.1:5555, "
        "set OUTBOX_FLOWER_BASIC_AUTH), `outbox ops list --state needs_human`.",
        highlight=False,
        soft_wrap=True,
    )
    if report.ok:
        console.print(
            "[green]OK[/]: no release created twice; every operation decided and matching "
            "the service's ledger"
        )
