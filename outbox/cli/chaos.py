"""``outbox chaos``: the whole stack under random crashes, and a verdict table."""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from outbox.cli.output import console, fail


class Broker(enum.StrEnum):
    """``chaos --broker`` (``outbox.dev.chaos.BrokerKind``, spelled here without importing the
    chaos machinery)."""

    RABBITMQ = "rabbitmq"
    DATABASE = "database"


def chaos_command(
    *,
    intents: Annotated[int, typer.Option(min=1, max=1_000_000, help="Intents to enqueue.")] = 500,
    kills: Annotated[
        int, typer.Option(min=0, help="SIGKILLs of a random worker or relay (each restarted).")
    ] = 20,
    pg_restarts: Annotated[
        int, typer.Option(min=0, help="PostgreSQL crashes (immediate stop) and restarts.")
    ] = 1,
    rabbitmq_restarts: Annotated[
        int,
        typer.Option(
            min=0, help="stop_app/start_app cycles of its RabbitMQ node (RabbitMQ broker)."
        ),
    ] = 1,
    cuts: Annotated[
        int,
        typer.Option(min=0, help="Dispatcher database connections cut while a call is in flight."),
    ] = 3,
    duration: Annotated[
        float,
        typer.Option(min=5, help="Seconds over which the intents and the faults are spread."),
    ] = 60.0,
    settle: Annotated[
        float, typer.Option(min=10, help="Seconds allowed afterwards for every decision.")
    ] = 240.0,
    ambiguous_rate: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Share of calls with a faulted outcome.")
    ] = 0.2,
    broker: Annotated[
        Broker | None,
        typer.Option(
            case_sensitive=False,
            help="The broker (default: RabbitMQ if it can start a node of its own).",
        ),
    ] = None,
    rabbitmq_node: Annotated[
        str | None,
        typer.Option(
            "--i-own-this-rabbitmq-node",
            "--rabbitmq-node",
            metavar="NODE",
            help="Use and restart this existing node (`rabbitmqctl -n NODE`, AMQP on "
            "127.0.0.1:5672), which you own, instead of a node of its own.",
        ),
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Seed the faults, to replay a run.")] = None,
    workdir: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR", help="Keep the cluster, logs and config here (implies --keep)."
        ),
    ] = None,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the working directory.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the verdict as JSON.")] = False,
) -> None:
    """Run the whole stack under random crashes, then judge it by the remote's ledger.

    It makes its **own PostgreSQL cluster** and its **own RabbitMQ node** (own name, ports and
    data, halted at the end; or uses the database broker), so crashing or restarting them
    disturbs nothing else. It starts two relays, two workers and beat as real processes and
    the reference service with ambiguous faults, and enqueues the intents while it SIGKILLs
    workers and relays at random, crash-restarts PostgreSQL, restarts its RabbitMQ node
    (`rabbitmqctl stop_app/start_app`) and cuts dispatchers' database connections mid-call.
    Then it waits until every operation is decided and prints the verdict. It restarts an
    existing RabbitMQ node only when `--i-own-this-rabbitmq-node` names it.

    Exits 1 on any duplicate effect, any committed intent left undecided (lost), or any
    verdict the remote's ledger contradicts. Needs no configuration (OUTBOX_* is ignored).
    """
    # Deferred: the chaos machinery (process runner, reference service) loads only here.
    from outbox.dev.chaos import ChaosConfig, ChaosRefused, run_chaos  # noqa: PLC0415

    config = ChaosConfig(
        intents=intents,
        kills=kills,
        pg_restarts=pg_restarts,
        rabbitmq_restarts=rabbitmq_restarts,
        cuts=cuts,
        chaos_s=duration,
        settle_s=settle,
        ambiguous_rate=ambiguous_rate,
        seed=seed,
        broker=None if broker is None else broker.value,
        rabbitmq_node=rabbitmq_node,
        workdir=workdir,
        keep=keep or workdir is not None,
    )
    try:
        report = run_chaos(config, progress=None if as_json else _say)
    except ChaosRefused as exc:
        fail(str(exc), code=2)
    if as_json:
        console.print_json(json.dumps({**vars(report), "ok": report.ok}))
    else:
        table = Table(title=f"chaos verdict ({report.broker} broker, seed {report.seed})")
        table.add_column("")
        table.add_column("", justify="right")
        for label, value in report.rows():
            table.add_row(label, value)
        console.print(table)
        console.print(f"{report.seconds:.0f}s; replay this run with --seed {report.seed}")
        for problem in report.problems:
            console.print(f"[red]FAILED:[/] {problem}", highlight=False)
        if report.ok:
            console.print("[green]OK[/]: no duplicate, nothing lost, every verdict matches")
    if not report.ok:
        raise typer.Exit(1)


def _say(line: str) -> None:
    console.print(line, highlight=False)
