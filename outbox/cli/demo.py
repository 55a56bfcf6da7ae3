"""``outbox demo``: what the outbox does, on the embedded PostgreSQL, in a few seconds.

For now the demo shows the agent side: intents recorded in the agent's own transaction, a
restarted agent getting the same operations back, a rolled-back transaction leaving nothing,
and a reused intent key refused. Delivery, reconciliation and crashes join it as they land.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from outbox import api, migrate
from outbox.cli.common import connected
from outbox.cli.output import console, fail
from outbox.db import redact
from outbox.errors import IntentConflict
from outbox.models import Operation

TOOL = "deploy.create_release"
RELEASES = [("web", "2.4.0"), ("api", "1.9.3"), ("worker", "0.8.1")]


def demo_command() -> None:
    """Record a few release intents and show what an agent restart and a key reuse do."""
    with connected() as engine:
        console.print(f"database: {redact(engine.url.render_as_string(hide_password=False))}")
        migrate.upgrade(engine)

        console.rule("an agent records three releases, each in its own transaction")
        first = []
        for project, version in RELEASES:
            with Session(engine) as session, session.begin():
                first.append(_record(session, project, version))
        for op in first:
            console.print(f"  {op.id}  {op.state.value:8} {op.tool} -> {op.target}")

        console.rule("the agent crashes and replays its conversation: the same operations")
        with Session(engine) as session, session.begin():
            again = [_record(session, project, version) for project, version in RELEASES]
        same = [a.id == b.id for a, b in zip(first, again, strict=True)]
        console.print(f"  {sum(same)} of {len(same)} intents returned their existing operation")

        console.rule("a transaction that rolls back leaves no intent behind")
        with Session(engine) as session, session.begin():
            ghost = _record(session, "billing", "9.9.9")
            session.rollback()
        with Session(engine) as session:
            gone = api.get(session, ghost.id) is None
        console.print(f"  operation {ghost.id} exists after rollback: {not gone}")

        console.rule("the same intent key with another payload is refused")
        with Session(engine) as session, session.begin():
            try:
                api.enqueue(
                    session,
                    tool=TOOL,
                    target="web",
                    payload={"version": "3.0.0"},
                    intent_key="demo:release:web",
                )
            except IntentConflict as exc:
                console.print(f"  refused: {exc}", highlight=False)
            else:
                fail("a conflicting intent was accepted")
    if not all(same) or not gone:
        fail("the demo's checks did not hold")
    console.print("\nNext: `outbox ops list`, `outbox ops show ID`.")


def _record(session: Session, project: str, version: str) -> Operation:
    return api.enqueue(
        session,
        tool=TOOL,
        target=project,
        payload={"version": version},
        intent_key=f"demo:release:{project}",
        requested_by="demo-agent",
    )
