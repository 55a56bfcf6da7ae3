"""``outbox sagas``: list sagas, show one (its steps in order and its audit trail), cancel
one as an operator (docs/sagas.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from outbox import sql
from outbox.cli.common import transaction
from outbox.cli.output import age, console, fail, print_json
from outbox.errors import SagaNotFound
from outbox.saga_rules import SagaState

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from outbox.saga_attention import Blocker
    from outbox.sagas import SagaStep, SagaSummary, SagaView


def _states_help() -> str:
    from outbox.saga_attention import STATE_HELP  # noqa: PLC0415 -- not for --help

    lines = [f"`{state.value}`: {STATE_HELP[state]}" for state in SagaState]
    return "\n\n".join(["**Saga states**:", *lines])


app = typer.Typer(
    help="List and inspect sagas (multi-step actions undone together), and cancel one.",
    epilog=_states_help(),
    no_args_is_help=True,
    rich_markup_mode="markdown",
)


@app.command("list")
def list_command(
    state: Annotated[
        SagaState | None,
        typer.Option(help="Only sagas in this state.", case_sensitive=False),
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="At most this many.")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON array.")] = False,
) -> None:
    """List sagas, newest first: state, steps, how long since they last moved, and why they
    are where they are.

    `--state needs_human` lists the sagas that wait for a person: `outbox sagas show KEY`
    says which operation holds each, and what to do.
    """
    from outbox import sagas  # noqa: PLC0415 -- not for --help

    with transaction() as session:
        found = sagas.list_sagas(session, state=state, limit=limit)
        now = sql.deployment.clock(session)
    if as_json:
        print_json([summary.to_dict() for summary in found])
        return
    if not found:
        console.print("no sagas" + (f" in state {state.value}" if state else ""))
        return
    console.print(_list_table(found, now))


AgentOption = Annotated[
    str | None,
    typer.Option(
        help="The agent whose saga it is, when several agents use the key (each agent's "
        "same key is a saga of its own); default: the one agent that has it."
    ),
]


def _agent_of(session: Session, key: str, agent: str | None) -> str:
    """``agent``, else the one agent with a saga under ``key``; one line if several have."""
    from outbox import sagas  # noqa: PLC0415 -- not for --help

    if agent is not None:
        return agent
    agents = sagas.agents_of_saga_key(session, key)
    if len(agents) > 1:
        named = ", ".join(repr(a) for a in agents)
        fail(f"saga key {key!r} names {len(agents)} sagas, one per agent ({named}): add --agent")
    return agents[0] if agents else ""


@app.command("show", no_args_is_help=True)
def show_command(
    key: Annotated[str, typer.Argument(help="The saga key.")],
    agent: AgentOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON with `steps` and `events`.")
    ] = False,
) -> None:
    """Show one saga: its state and why, its steps in order (each step's operation and its
    compensation), what waits for a person, and its audit trail."""
    from outbox import sagas  # noqa: PLC0415 -- not for --help
    from outbox.saga_attention import blockers  # noqa: PLC0415 -- not for --help

    with transaction() as session:
        found = sagas.get_saga(session, key, agent=_agent_of(session, key, agent))
    if found is None:
        raise SagaNotFound(f"no saga {key!r}", saga_key=key)
    if as_json:
        print_json(found.to_dict())
        return
    console.print(_details(found), highlight=False, markup=False, soft_wrap=True)
    console.print(_steps_table(found.steps))
    console.print(_operations_table(found.steps))
    console.print(_events_table(found))
    waiting = blockers(found)
    if waiting:
        console.print(_blockers_hint(waiting), highlight=False, markup=False, soft_wrap=True)


@app.command("cancel", no_args_is_help=True)
def cancel_command(
    key: Annotated[str, typer.Argument(help="The saga key.")],
    *,
    by: Annotated[str, typer.Option(help="Who cancels it (your name), for the audit trail.")],
    reason: Annotated[str, typer.Option(help="Why, for the audit trail.")],
    agent: AgentOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the saga as JSON.")] = False,
) -> None:
    """Cancel a running saga: its steps not sent yet are cancelled, its confirmed steps are
    undone in reverse order (each undo an operation of its own), once every step in flight
    is decided. Refused, writing nothing, unless the saga is `running`."""
    from outbox import sagas  # noqa: PLC0415 -- not for --help

    if not by.strip() or not reason.strip():
        fail("--by and --reason must not be empty", code=2)
    with transaction() as session:
        done = sagas.cancel_saga(
            session,
            key,
            by=by,
            reason=reason,
            actor=sagas.OPERATOR,
            agent=_agent_of(session, key, agent),
        )
    if as_json:
        print_json(done.to_dict())
        return
    console.print(
        f"saga {done.key} cancelled by {by.strip()}: now {done.state.value}"
        + (f" ({done.reason})" if done.reason else ""),
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


def _list_table(found: list[SagaSummary], now: object) -> Table:
    table = Table()
    for header in ("key", "state", "steps", "moved", "requested by", "reason"):
        table.add_column(header)
    for summary in found:
        table.add_row(
            summary.key,
            summary.state.value,
            str(summary.steps),
            age(summary.updated_at, now),  # type: ignore[arg-type]
            summary.requested_by or "",
            summary.reason or "",
        )
    return table


def _details(saga: SagaView) -> str:
    from outbox.saga_attention import STATE_HELP  # noqa: PLC0415 -- not for --help

    rows = [
        ("saga", saga.key),
        ("agent", saga.agent or "(shared)"),
        ("state", saga.state.value),
        ("reason", saga.reason),
        ("requested by", saga.requested_by),
        ("cancelled by", saga.cancelled_by),
        ("created", saga.created_at.isoformat(timespec="seconds")),
        ("moved", saga.updated_at.isoformat(timespec="seconds")),
        ("meaning", STATE_HELP[saga.state]),
    ]
    return "\n".join(f"{name:>12}: {'-' if value is None else value}" for name, value in rows)


def _steps_table(steps: tuple[SagaStep, ...]) -> Table:
    table = Table(title="steps")
    table.add_column("#", justify="right")
    for header in ("step", "group", "pivot", "state", "remote ref", "held"):
        table.add_column(header)
    for header in ("compensation", "its state"):
        table.add_column(header)
    for step in steps:
        table.add_row(
            str(step.position),
            step.name,
            step.group or "",
            "pivot" if step.pivot else "",
            step.state.value if step.state is not None else "(pruned)",
            step.remote_ref or "",
            "held" if step.held else "",
            _compensation(step),
            step.compensation_state.value if step.compensation_state is not None else "",
        )
    return table


def _operations_table(steps: tuple[SagaStep, ...]) -> Table:
    """Each step's operation id and its compensation's (for `outbox ops show ID`)."""
    table = Table(title="operations")
    table.add_column("step")
    table.add_column("operation", no_wrap=True, min_width=36)
    table.add_column("compensation operation", no_wrap=True, min_width=36)
    for step in steps:
        table.add_row(
            step.name,
            str(step.operation_id) if step.operation_id else "(pruned)",
            str(step.compensation_operation_id) if step.compensation_operation_id else "",
        )
    return table


def _compensation(step: SagaStep) -> str:
    if step.pivot:
        return "(none: pivot)"
    if step.compensate is None:
        return ""
    return f"{step.compensate.tool} -> {step.compensate.target}"


def _events_table(saga: SagaView) -> Table:
    table = Table("at", "from", "to", "actor", "reason", title="events")
    for event in saga.events:
        table.add_row(
            event.at.isoformat(timespec="seconds"),
            event.from_state.value if event.from_state else "-",
            event.to_state.value,
            event.actor,
            event.reason,
        )
    return table


def _blockers_hint(waiting: list[Blocker]) -> str:
    lines = ["", "waiting for a person:"]
    for blocker in waiting:
        state = blocker.state.value if blocker.state is not None else "gone"
        lines.append(f"  step {blocker.step} ({blocker.role}, {state}): {blocker.action}")
        if blocker.operation_id is not None:
            lines.append(f"    outbox ops show {blocker.operation_id}")
    return "\n".join(lines)
