"""``outbox dev``: what developers, tests and benchmarks run beside the outbox."""

from __future__ import annotations

import enum
import sys
from pathlib import Path
from typing import Annotated

import typer

from outbox.cli.output import fail
from outbox.config import get_settings
from outbox.dev.ownership import OWN_DATABASE_FLAG, NotOwned, confirm_owned
from outbox.dev.service import (
    DEFAULT_FAULT_DELAY_S,
    DEFAULT_PORT,
    FAULT_MODES,
    DeployService,
    DeployServiceError,
    parse_fault_rates,
    serve,
)


class ScenarioMode(enum.StrEnum):
    """``scenario --mode``: what the remote offers (``outbox.dev.scenario.MODES``, which this
    spells without importing the scenario's runner)."""

    LOOKUP = "lookup"  #: a lookup by key, no dedup window
    DEDUP = "dedup"  #: a dedup window, no lookup
    NEITHER = "neither"  #: neither: an ambiguous call escalates


app = typer.Typer(
    help="Development helpers: the reference remote service for tests, demos and benchmarks.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",
)


@app.callback()
def dev() -> None:
    """Development helpers: the reference remote service for tests, demos and benchmarks."""
    # A callback keeps `deploy-service` a sub-command when this app runs on its own, too.


@app.command("deploy-service")
def deploy_service_command(
    *,
    host: Annotated[str, typer.Option(help="Address to bind; keep it local.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on; 0 picks a free one.")] = (
        DEFAULT_PORT
    ),
    dedup_window: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="Honour the same key with the same payload for this long (200, same release). "
            "Unset: no dedup, every request creates a release.",
        ),
    ] = None,
    lookup: Annotated[
        bool, typer.Option("--lookup/--no-lookup", help="Serve GET .../by-key/{key} (else 501).")
    ] = True,
    ledger: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE", help="Keep the ledger in this SQLite file (default: in memory)."
        ),
    ] = None,
    idempotency_header: Annotated[
        str, typer.Option(metavar="NAME", help="Header carrying the idempotency key.")
    ] = "Idempotency-Key",
    fault_rate: Annotated[
        list[str] | None,
        typer.Option(
            metavar="MODE=RATE",
            help=f"Inject a fault with this probability (repeatable). Modes: "
            f"{', '.join(FAULT_MODES)}.",
        ),
    ] = None,
    seed: Annotated[
        int | None, typer.Option(help="Seed the fault draws, for reproducible runs.")
    ] = None,
    fault_delay: Annotated[
        float,
        typer.Option(metavar="SECONDS", help="How long commit_then_timeout and slow wait."),
    ] = DEFAULT_FAULT_DELAY_S,
    log_requests: Annotated[
        bool, typer.Option("--log-requests", help="Print one line per request on stderr.")
    ] = False,
) -> None:
    """Run the reference remote service in the foreground until Ctrl-C or SIGTERM.

    It creates releases at `POST /projects/{target}/releases`, keyed by an idempotency
    header, rolls them back at `POST /projects/{target}/rollbacks` (`{"release": "rel-N"}`),
    and keeps a ledger of every effect (`GET /ledger`) so a run can check that no action
    happened twice. Faults are injected by rate (`--fault-rate`), per request
    (`X-Fault` header) or per key (`POST /_faults/keys/{key}`). Prints one line with its URL.
    """
    try:
        service = DeployService(
            host=host,
            port=port,
            dedup_window_s=dedup_window,
            lookup_enabled=lookup,
            ledger_path=ledger,
            idempotency_header=idempotency_header,
            fault_rates=parse_fault_rates(fault_rate or []),
            seed=seed,
            fault_delay_s=fault_delay,
            log_requests=log_requests,
        )
        serve(service, _announce)
    except DeployServiceError as exc:
        fail(str(exc))


def _announce(line: str) -> None:
    # Flushed at once: whoever started us (a test, a script) waits for this line on a pipe.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


@app.command("scenario")
def scenario_command(
    *,
    mode: Annotated[
        list[ScenarioMode] | None,
        typer.Option(
            "--mode",
            case_sensitive=False,
            help="What the remote offers; repeat for several (default: all three).",
        ),
    ] = None,
    intents: Annotated[int, typer.Option(min=1, max=100_000, help="Intents per run.")] = 300,
    ambiguous_rate: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Share of calls with an ambiguous outcome.")
    ] = 0.2,
    timeout: Annotated[float, typer.Option(min=10, help="Seconds allowed per run.")] = 240.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the reports as JSON.")] = False,
    i_own_this_database: Annotated[
        str | None,
        typer.Option(
            OWN_DATABASE_FLAG,
            metavar="URL",
            help="Let it empty the outbox tables of OUTBOX_DATABASE_URL, which this names "
            "(passwords may be masked). Without it a set OUTBOX_DATABASE_URL is refused.",
        ),
    ] = None,
) -> None:
    """Run intents through a faulty remote until each is decided, and check the promises.

    Starts the reference service with ambiguous faults, a signed-webhook receiver, and a
    worker, relay and beat; exits 1 if an operation got two effects, stayed undecided, was
    escalated although a lookup or dedup window existed, or an escalation's webhook did not
    arrive correctly signed. Uses OUTBOX_BROKER_URL (unset: the database as broker).

    Each run starts from empty outbox tables. With OUTBOX_DATABASE_URL unset it makes a
    **throw-away PostgreSQL cluster of its own** (removed afterwards; never the embedded
    one). A set OUTBOX_DATABASE_URL is emptied only when `--i-own-this-database` names that
    same database; otherwise the command refuses (exit 2) and touches nothing.
    """
    # Deferred: imports the webhook verifier and the process runner only when used.
    from outbox.dev.scenario import report_json, run_scenario  # noqa: PLC0415

    modes = mode or list(ScenarioMode)
    settings = get_settings()
    url = settings.database_url.get_secret_value() if settings.database_url else None
    _check_owned(url, i_own_this_database)
    broker = settings.broker_url.get_secret_value() if settings.broker_url else None
    reports = []
    for chosen in modes:
        reports.append(
            run_scenario(
                url,
                mode=chosen.value,
                i_own_this_database=i_own_this_database,
                intents=intents,
                ambiguous_rate=ambiguous_rate,
                broker_url=broker,
                timeout_s=timeout,
            )
        )
        if not as_json:
            _announce(reports[-1].render())
    if as_json:
        _announce("[" + ",\n".join(report_json(r) for r in reports) + "]")
    if not all(report.ok for report in reports):
        raise typer.Exit(1)


def _check_owned(url: str | None, named: str | None) -> None:
    """Refuse (exit 2) before anything runs unless the database is ours to empty."""
    if url is None:
        if named is not None:
            fail(
                f"{OWN_DATABASE_FLAG} names a database but OUTBOX_DATABASE_URL is not set: set "
                "it to that URL, or drop the flag to run on a throw-away cluster",
                code=2,
            )
        return
    try:
        confirm_owned(url, named, doing="outbox dev scenario empties the outbox tables of")
    except NotOwned as exc:
        fail(str(exc), code=2)
