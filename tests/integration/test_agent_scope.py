"""An intent key belongs to its agent (migration 0023): the same key from two agents names two
operations, and nothing one agent gets back speaks of the other's operation."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from uuid import UUID

import pytest
from alembic import command
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

import outbox
from outbox import aio, api, migrate, sagas
from outbox.api import Intent
from outbox.canonical import canonical_json, payload_hash
from outbox.cli.db import prune_batches
from outbox.db import create_async_engine, create_engine
from outbox.errors import IntentAlreadyDone, IntentConflict
from outbox.models import Operation
from outbox.sql.retention import DedupWindows
from outbox.states import State
from tests.conftest import Databases
from tests.factories import age, make_operation, operation_count

TOOL = "deploy.create_release"
PAYLOAD = {"version": "1.2.3"}
DAY = 86400
MONTH = 30 * DAY


def enqueue(engine: Engine, key: str, *, payload: Any = PAYLOAD, **scope: Any) -> Operation:
    """One intent under ``key`` for the agent ``scope`` names, committed."""
    with Session(engine) as session, session.begin():
        return api.enqueue(
            session, tool=TOOL, target="project-a", payload=payload, intent_key=key, **scope
        )


def prune(engine: Engine) -> int:
    """Prune every operation that ended more than a month ago."""
    windows = DedupWindows({TOOL: None})
    return sum(prune_batches(engine, older_than_s=MONTH, batch_size=100, windows=windows))


def confirmed_and_pruned(engine: Engine, key: str, agent: str) -> Operation:
    """``agent``'s operation under ``key``, confirmed, aged past retention and pruned."""
    op = make_operation(engine, State.CONFIRMED, intent_key=key, payload=PAYLOAD, agent=agent)
    age(engine, op.id, 40 * DAY, "resolved_at", "updated_at", "created_at")
    assert prune(engine) == 1
    return op


def test_the_same_key_from_two_agents_is_two_operations(engine: Engine) -> None:
    """Agents a and b each get their own operation for one key; each finds its own again."""
    a = enqueue(engine, "release-1", agent="a")
    b = enqueue(engine, "release-1", agent="b")
    assert a.id != b.id
    assert (a.agent, b.agent) == ("a", "b")
    assert enqueue(engine, "release-1", agent="a").id == a.id
    assert enqueue(engine, "release-1", agent="b").id == b.id
    with Session(engine) as session:
        assert api.find(session, "release-1", agent="a") == a
        assert api.find(session, "release-1", agent="b") == b
        assert api.find(session, "release-1") is None
        assert [op.id for op in api.find_every_agents(session, "release-1")] == [a.id, b.id]
    assert operation_count(engine) == 2


def test_the_agent_defaults_to_requested_by_then_to_the_shared_scope(engine: Engine) -> None:
    """Without ``agent``, the key is ``requested_by``'s; with neither, the shared scope's."""
    by_bob = enqueue(engine, "k", requested_by="bob")
    shared = enqueue(engine, "k")
    named = enqueue(engine, "k", agent="bob", requested_by="bob-token-2")
    assert (by_bob.agent, shared.agent) == ("bob", "")
    assert by_bob.id != shared.id
    assert named.id == by_bob.id


def test_a_conflict_in_one_scope_names_only_that_agents_operation(engine: Engine) -> None:
    """Agent b's other payload under a's key is b's new operation; b's own differing retry is
    a conflict naming b's operation, never a's."""
    a = enqueue(engine, "k", agent="a")
    b = enqueue(engine, "k", agent="b", payload={"version": "9.9.9"})
    with pytest.raises(IntentConflict) as caught:
        enqueue(engine, "k", agent="b")
    assert (caught.value.operation_id, caught.value.agent) == (b.id, "b")
    assert str(a.id) not in str(caught.value)


def test_another_agents_pruned_key_is_a_new_operation(engine: Engine) -> None:
    """Once a's operation is pruned, a's same intent is already done, and b's is a new one."""
    a = confirmed_and_pruned(engine, "k", "a")
    with pytest.raises(IntentAlreadyDone) as done:
        enqueue(engine, "k", agent="a")
    assert done.value.operation_id == a.id
    b = enqueue(engine, "k", agent="b")
    assert b.id != a.id


def test_a_key_pruned_before_agents_were_recorded_is_done_for_every_agent(
    engine: Engine,
) -> None:
    """A pruned intent kept with all_agents (pruned before 0023) refuses the key to every
    agent, so no intent can happen twice across the upgrade."""
    a = confirmed_and_pruned(engine, "old-key", "a")
    with engine.begin() as conn:
        conn.execute(text("UPDATE outbox.pruned_intents SET agent = '', all_agents = true"))
    for agent in ("a", "b", None):
        with pytest.raises(IntentAlreadyDone) as done:
            enqueue(engine, "old-key", agent=agent)
        assert done.value.operation_id == a.id
    batch = [Intent(TOOL, "project-a", PAYLOAD, "old-key", agent="c")]
    with Session(engine) as session, session.begin(), pytest.raises(IntentAlreadyDone):
        api.enqueue_many(session, batch)
    assert operation_count(engine) == 0


def test_a_batch_with_one_key_for_two_agents_records_two_operations(engine: Engine) -> None:
    """enqueue_many keeps each agent's key apart: two intents under one key, two agents, two
    operations; the same agent's key twice, one."""
    batch = [
        Intent(TOOL, "project-a", PAYLOAD, "k", agent="a"),
        Intent(TOOL, "project-a", PAYLOAD, "k", agent="b"),
        Intent(TOOL, "project-a", PAYLOAD, "k", agent="a"),
    ]
    with Session(engine) as session, session.begin():
        first, second, third = api.enqueue_many(session, batch)
    assert (first.agent, second.agent) == ("a", "b")
    assert first.id != second.id
    assert third.id == first.id
    with Session(engine) as session, session.begin():
        again = api.enqueue_many(session, batch)
    assert [op.id for op in again] == [first.id, second.id, first.id]
    assert operation_count(engine) == 2


def test_two_agents_racing_one_key_end_with_one_operation_each(engine: Engine) -> None:
    """Eight threads per agent enqueue one key at once: two operations, and every thread
    holds its own agent's."""
    barrier = threading.Barrier(16)

    def one(agent: str) -> tuple[str, UUID]:
        barrier.wait()
        return agent, enqueue(engine, "raced", agent=agent).id

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, ["a", "b"] * 8))
    ids = {agent: {op_id for who, op_id in results if who == agent} for agent in ("a", "b")}
    assert len(ids["a"]) == len(ids["b"]) == 1
    assert ids["a"] != ids["b"]
    assert operation_count(engine) == 2


def test_the_database_refuses_a_second_row_for_one_agents_key(engine: Engine) -> None:
    """The scope is in the unique rule: a second row for (key, agent) is refused by
    PostgreSQL itself, a row for another agent is not."""
    op = enqueue(engine, "k", agent="a")
    insert = text(
        "INSERT INTO outbox.operations (intent_key, agent, tool, target, payload, payload_hash,"
        " intent_hash) SELECT intent_key, :agent, tool, target, payload, payload_hash,"
        " intent_hash FROM outbox.operations WHERE id = :id"
    )
    with engine.begin() as conn:
        conn.execute(insert, {"agent": "b", "id": op.id})
    with pytest.raises(IntegrityError, match="uq_operations_intent_key_agent"), engine.begin() as c:
        c.execute(insert, {"agent": "a", "id": op.id})
    assert operation_count(engine) == 2


def test_the_agent_is_immutable(engine: Engine) -> None:
    """Moving an operation to another agent is refused by the identity trigger."""
    op = enqueue(engine, "k", agent="a")
    with pytest.raises(IntegrityError, match="agent is immutable"), engine.begin() as conn:
        conn.execute(text("UPDATE outbox.operations SET agent = 'b' WHERE id = :id"), {"id": op.id})


def test_aio_scopes_keys_alike(database_url: str, engine: Engine) -> None:
    """outbox.aio's enqueue and find take the same agent, with the same defaults."""

    async def main() -> tuple[Operation, Operation, Operation | None, Operation | None]:
        async_engine = create_async_engine(database_url)
        try:
            async with async_engine.begin() as conn:
                a = await aio.enqueue(
                    conn, tool=TOOL, target="t", payload=PAYLOAD, intent_key="k", agent="a"
                )
                b = await aio.enqueue(
                    conn, tool=TOOL, target="t", payload=PAYLOAD, intent_key="k", requested_by="b"
                )
                return a, b, await aio.find(conn, "k", agent="b"), await aio.find(conn, "k")
        finally:
            await async_engine.dispose()

    a, b, found, shared = asyncio.run(main())
    assert (a.agent, b.agent) == ("a", "b")
    assert a.id != b.id
    assert found == b
    assert shared is None


# --- the migration ----------------------------------------------------------------------------


def _insert_as_of_0022(engine: Engine, key: str, requested_by: str | None) -> UUID:
    with engine.begin() as conn:
        found = conn.execute(
            text(
                "INSERT INTO outbox.operations (intent_key, tool, target, payload, payload_hash,"
                " intent_hash, requested_by) VALUES (:key, :tool, 'project-a', :payload, :hash,"
                " outbox.intent_hash(:tool, 'project-a', :hash), :by) RETURNING id"
            ),
            {
                "key": key,
                "tool": TOOL,
                "payload": '{"version": "1.2.3"}',
                "hash": payload_hash(canonical_json(PAYLOAD)),
                "by": requested_by,
            },
        ).scalar_one()
    return UUID(str(found))


def test_0023_keeps_every_existing_operations_identity(databases: Databases) -> None:
    """Rows written before 0023 get the agent each door now computes for their caller (an API
    token's name, the Python caller's requested_by, else the shared scope), so the same intent
    again finds the same operation through every door; a token speaks for its own name."""
    fresh = create_engine(databases.create())
    try:
        migrate.upgrade(fresh, "0022")
        by_token = _insert_as_of_0022(fresh, "k-api", "agent-a")
        by_python = _insert_as_of_0022(fresh, "k-py", None)
        with fresh.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO outbox.api_tokens (name, scope, token_hash) "
                    "VALUES ('agent-a', 'agent', repeat('a', 64))"
                )
            )
        migrate.upgrade(fresh)
        assert enqueue(fresh, "k-api", agent="agent-a").id == by_token
        assert enqueue(fresh, "k-api", requested_by="agent-a").id == by_token
        assert enqueue(fresh, "k-py").id == by_python
        assert enqueue(fresh, "k-api", agent="agent-b").id not in (by_token, by_python)
        with fresh.connect() as conn:
            agent = conn.execute(text("SELECT agent FROM outbox.api_tokens")).scalar_one()
        assert agent == "agent-a"
    finally:
        fresh.dispose()


def test_0023_downgrades_and_upgrades_again(databases: Databases) -> None:
    """Down to 0022 (no key shared by two agents) and up again: an operation whose agent is
    its requested_by is found again under the same key (an agent named apart from
    requested_by is not kept by 0022, and comes back as requested_by's)."""
    fresh = create_engine(databases.create())
    try:
        migrate.upgrade(fresh)
        op = enqueue(fresh, "k", requested_by="a")
        config = migrate.alembic_config()
        with fresh.connect() as conn:
            config.attributes["connection"] = conn
            command.downgrade(config, "0022")
        migrate.upgrade(fresh)
        assert enqueue(fresh, "k", agent="a").id == op.id
    finally:
        fresh.dispose()


# --- sagas ------------------------------------------------------------------------------------

STEP: dict[str, Any] = {"tool": TOOL, "target": "project-a", "payload": PAYLOAD}


def test_saga_keys_are_their_agents_and_step_keys_are_unambiguous(engine: Engine) -> None:
    """Two agents' sagas under one key are two sagas; saga ``rel:a`` step ``b`` and saga
    ``rel`` step ``a:b`` (one key in the old form) are two operations; a compensation's key is
    never a step's."""
    with Session(engine) as session, session.begin():
        mine = outbox.saga(session, "rel", agent="a").step("a:b", **STEP)
        theirs = outbox.saga(session, "rel", agent="b").step("a:b", **STEP)
        other = outbox.saga(session, "rel:a", agent="a").step("b", **STEP)
        named_undo = outbox.saga(session, "rel:a", agent="a").step("undo", **STEP)
    assert len({mine.id, theirs.id, other.id, named_undo.id}) == 4
    assert (mine.agent, theirs.agent, other.agent) == ("a", "b", "a")
    keys = {
        sagas.step_intent_key("rel", "a:b"),
        sagas.step_intent_key("rel:a", "b"),
        sagas.compensation_intent_key("rel", "a:b"),
        sagas.compensation_intent_key("rel:a", "b"),
        sagas.step_intent_key("rel:a", "undo"),
    }
    assert len(keys) == 5
    with Session(engine) as session:
        assert sagas.agents_of_saga_key(session, "rel") == ["a", "b"]
        found = outbox.get_saga(session, "rel", agent="b")
    assert found is not None
    assert [s.operation_id for s in found.steps] == [theirs.id]


def test_another_agent_cannot_take_a_sagas_step_or_undo_key_first(engine: Engine) -> None:
    """Agent b enqueuing the very keys agent a's saga step and its undo will use blocks
    nothing: a's saga records its own step and, once refused later, its own undo."""
    step_key = sagas.step_intent_key("deploy", "release")
    undo_key = sagas.compensation_intent_key("deploy", "release")
    for key in (step_key, undo_key):
        enqueue(engine, key, agent="b")
    with Session(engine) as session, session.begin():
        step = outbox.saga(session, "deploy", agent="a").step(
            "release",
            **STEP,
            compensate=outbox.Compensate(TOOL, "project-a", {"undo": "{remote_ref}"}),
        )
    assert (step.intent_key, step.agent) == (step_key, "a")
    with Session(engine) as session:
        theirs = api.find(session, step_key, agent="b")
    assert theirs is not None
    assert theirs.id != step.id


def test_a_saga_opened_before_0023_keeps_its_steps_keys(databases: Databases) -> None:
    """A saga recorded in the old key form is found again step by step after the upgrade:
    declaring the same step again returns its operation, and nothing new is recorded."""
    fresh = create_engine(databases.create())
    try:
        migrate.upgrade(fresh, "0022")
        op_id = _insert_as_of_0022(fresh, "saga:old:release", "agent-a")
        with fresh.begin() as conn:
            conn.execute(
                text("INSERT INTO outbox.sagas (key, requested_by) VALUES ('old', 'agent-a')")
            )
            conn.execute(
                text(
                    "INSERT INTO outbox.saga_steps (saga_key, position, name, operation_id,"
                    " released_at) VALUES ('old', 0, 'release', :id, clock_timestamp())"
                ),
                {"id": op_id},
            )
        migrate.upgrade(fresh)
        with Session(fresh) as session, session.begin():
            again = outbox.saga(session, "old", requested_by="agent-a").step(
                "release", tool=TOOL, target="project-a", payload=PAYLOAD
            )
        assert again.id == op_id
        assert operation_count(fresh) == 1
    finally:
        fresh.dispose()
