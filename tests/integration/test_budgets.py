"""Budgets at enqueue: refusals that write nothing, keys, costs, the sliding window, exactness
across concurrent enqueuers, and enforcement in a process that loads no configuration."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

import outbox
from outbox import aio, api, approval, budgets, migrate, sql
from outbox.budgets import BUDGETS, Budget, publish_budgets_committed
from outbox.cli.db import prune_batches
from outbox.config import get_settings
from outbox.contracts import CONTRACTS
from outbox.db import create_async_engine, create_engine
from outbox.errors import BudgetExceeded, InvalidIntent
from outbox.integrations._calls import refusal
from outbox.mcp.auth import Caller
from outbox.mcp.calls import Calls
from outbox.metrics import OutboxCollector
from outbox.models import Operation
from outbox.sql.retention import DedupWindows
from outbox.states import Actor, State
from outbox.tools import REGISTRY
from outbox.workers.runtime import publish_loaded_policies
from tests.conftest import Databases
from tests.factories import age, apply_move, operation_count, reload

TOOL = "billing.charge"
OTHER = "deploy.create_release"


def publish(engine: Engine, **fields: Any) -> Budget:
    """Publish one budget over TOOL, as a starting worker would."""
    declared = Budget(**{"name": "spend", "tools": (TOOL,), "window_s": 3600.0, **fields})
    publish_budgets_committed(engine, [declared])
    return declared


def charge(
    engine: Engine, *, by: str | None = "agent-a", amount: float = 1, **extra: Any
) -> Operation:
    """Enqueue one charge in a transaction of its own."""
    with Session(engine) as session, session.begin():
        return api.enqueue(
            session,
            tool=TOOL,
            target="acct",
            payload={"amount": amount, "n": uuid.uuid4().hex},
            requested_by=by,
            **extra,
        )


def age_usage(engine: Engine, seconds: float) -> None:
    """Move every usage row ``seconds`` into the past (the database clock decides windows)."""
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE outbox.budget_usage SET used_at = used_at - make_interval(secs => :s)"),
            {"s": seconds},
        )


def test_over_budget_is_refused_and_writes_nothing(engine: Engine) -> None:
    """An enqueue past max_operations raises BudgetExceeded naming the budget, the window and
    what is left, and writes no row, while another requester still has its own budget."""
    publish(engine, max_operations=2)
    charge(engine)
    charge(engine)
    with pytest.raises(BudgetExceeded) as refused:
        charge(engine)
    exc = refused.value
    assert (exc.budget, exc.key, exc.window_s, exc.limit, exc.used, exc.remaining) == (
        "spend",
        "agent-a",
        3600.0,
        2,
        2,
        0,
    )
    assert "'spend'" in str(exc)
    assert "3600s" in str(exc)
    assert "0 left" in str(exc)
    assert operation_count(engine) == 2
    charge(engine, by="agent-b")
    assert operation_count(engine) == 3


def test_budget_counts_per_metadata_key_and_other_tools_are_free(engine: Engine) -> None:
    """A budget by metadata.conversation counts each conversation apart; tools it does not
    name are never refused."""
    publish(engine, by="metadata.conversation", max_operations=1)
    charge(engine, metadata={"conversation": "c1"})
    charge(engine, metadata={"conversation": "c2"})
    with pytest.raises(BudgetExceeded):
        charge(engine, metadata={"conversation": "c1"}, by="someone-else")
    with Session(engine) as session, session.begin():
        for n in range(3):
            api.enqueue(session, tool=OTHER, target="p", payload={"n": n}, requested_by="agent-a")
    assert operation_count(engine) == 5


def test_cost_budget_refuses_what_does_not_fit(engine: Engine) -> None:
    """A cost budget sums the payload's amounts: a charge that does not fit is refused with
    the cost asked and what is left, and a payload without the amount is invalid."""
    publish(engine, cost="payload.amount", max_cost=100)
    charge(engine, amount=60)
    with pytest.raises(BudgetExceeded) as refused:
        charge(engine, amount=50)
    assert (refused.value.measure, refused.value.remaining, refused.value.asked) == (
        "cost",
        40,
        50,
    )
    charge(engine, amount=40)
    with Session(engine) as session, session.begin(), pytest.raises(InvalidIntent) as bad:
        api.enqueue(session, tool=TOOL, target="acct", payload={"n": 1}, requested_by="agent-a")
    assert bad.value.field == "payload.amount"
    assert operation_count(engine) == 2


def test_window_slides_and_cancelled_operations_give_back(engine: Engine) -> None:
    """Usage older than the window (database clock) no longer counts and is deleted (another
    key's too), nor does a cancelled operation's count."""
    publish(engine, max_operations=1, window_s=60.0)
    first = charge(engine)
    with pytest.raises(BudgetExceeded):
        charge(engine)
    charge(engine, by="gone")
    age_usage(engine, 61)
    second = charge(engine)
    with Session(engine) as session, session.begin():
        api.cancel(session, second.id)
    charge(engine)
    assert first.state is State.PLANNED
    assert operation_count(engine) == 4
    with engine.connect() as conn:
        keys = conn.execute(text("SELECT key FROM outbox.budget_usage ORDER BY id")).scalars()
        # The expired rows of every key dropped, and the cancelled one's as it was cancelled.
        assert list(keys) == ["agent-a"]


def test_re_enqueue_of_a_recorded_intent_is_never_refused_nor_counted(engine: Engine) -> None:
    """The same intent key again, over budget, returns the recorded operation and uses no
    more of the budget."""
    publish(engine, max_operations=1)
    payload = {"amount": 1}
    with Session(engine) as session, session.begin():
        first = api.enqueue(
            session, tool=TOOL, target="acct", payload=payload, intent_key="k1", requested_by="a"
        )
    with Session(engine) as session, session.begin():
        again = api.enqueue(
            session, tool=TOOL, target="acct", payload=payload, intent_key="k1", requested_by="a"
        )
        many = api.enqueue_many(session, [api.Intent(TOOL, "acct", payload, "k1", None, "a")])
    assert again.id == first.id == many[0].id
    with Session(engine) as session:
        (used,) = budgets.usage(session)
    assert (used.budget, used.key, used.operations, used.max_operations) == ("spend", "a", 1, 1)


def test_enqueue_many_and_async_enqueue_are_held_to_the_budget(
    engine: Engine, database_url: str
) -> None:
    """A batch that would go over writes nothing (the caller's transaction goes on), a batch
    that fits is recorded, and outbox.aio refuses like the sync API."""
    publish(engine, max_operations=3)
    batch = [api.Intent(TOOL, "acct", {"amount": n}, None, None, "a") for n in range(4)]
    with Session(engine) as session, session.begin():
        with pytest.raises(BudgetExceeded):
            api.enqueue_many(session, batch)
        api.enqueue_many(session, [*batch[:2], api.Intent(OTHER, "p", {}, None, None, "a")])
    assert operation_count(engine) == 3

    async def main() -> None:
        async_engine = create_async_engine(database_url)
        try:
            async with async_engine.connect() as conn:
                await aio.enqueue(
                    conn, tool=TOOL, target="x", payload={"amount": 1}, requested_by="a"
                )
                with pytest.raises(BudgetExceeded):
                    await aio.enqueue(
                        conn, tool=TOOL, target="x", payload={"amount": 2}, requested_by="a"
                    )
                await conn.commit()
        finally:
            await async_engine.dispose()

    asyncio.run(main())
    assert operation_count(engine) == 4
    with engine.connect() as conn:
        (totals,) = sql.budgets.totals(conn)
    assert totals.refusals == 2  # each refusal counted in a transaction of its own


def test_budget_exhausted_webhook_is_written_once_per_key_and_window(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refusals of one key write one budget_exhausted delivery per window (in a transaction
    of their own, kept though the caller rolls back), another key its own."""
    monkeypatch.setenv("OUTBOX_WEBHOOK_URL", "http://127.0.0.1:9/hook")
    monkeypatch.setenv("OUTBOX_WEBHOOK_SECRET", "whsec_" + base64.b64encode(bytes(32)).decode())
    get_settings.cache_clear()
    try:
        publish(engine, max_operations=1, window_s=60.0)
        charge(engine, by="a")
        charge(engine, by="b")
        for by in ("a", "a", "a", "b"):
            with pytest.raises(BudgetExceeded):
                charge(engine, by=by)
        with engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE outbox.budget_alerts "
                    "SET exhausted_at = exhausted_at - interval '61 seconds'"
                )
            )
        with pytest.raises(BudgetExceeded):
            charge(engine, by="a")
    finally:
        get_settings.cache_clear()
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT subject, event, payload FROM outbox.webhook_deliveries "
                "WHERE operation_id IS NULL ORDER BY id"
            )
        ).all()
    assert [(r.subject, r.event) for r in rows] == [
        ("budget:spend:a", "budget_exhausted"),
        ("budget:spend:b", "budget_exhausted"),
        ("budget:spend:a", "budget_exhausted"),
    ]
    body = rows[0].payload
    assert body["type"] == "guard.budget_exhausted"
    assert (body["data"]["budget"], body["data"]["key"], body["data"]["remaining"]) == (
        "spend",
        "a",
        0,
    )


def test_the_mcp_server_and_the_adapters_answer_a_refusal_in_the_core_words(
    engine: Engine, database_url: str
) -> None:
    """Over budget, an MCP call is a refusal naming the budget and what is left, and the
    framework adapters' answer is a settled refusal, nothing written."""
    publish(engine, max_operations=1)

    async def main() -> list[Any]:
        async_engine = create_async_engine(database_url)
        try:
            calls = Calls(engine=async_engine, wait_s=0)
            return [
                await calls.call_registered(
                    TOOL,
                    {"intent_key": key, "target": "acct", "payload": {"amount": 1}},
                    Caller(name="a", agent="a"),
                )
                for key in ("m-1", "m-2")
            ]
        finally:
            await async_engine.dispose()

    first, refused = asyncio.run(main())
    assert not first.is_error
    assert refused.is_error
    assert refused.structured_content["field"] == "budget"
    assert refused.content[0].text.startswith("Refused (budget): budget 'spend' exceeded for")
    assert "0 left" in refused.content[0].text
    with pytest.raises(BudgetExceeded) as exc:
        charge(engine, by="a")
    answer = refusal(exc.value)
    assert (answer["outcome"], answer["settled"], answer["budget"], answer["remaining"]) == (
        "refused",
        True,
        "spend",
        0,
    )
    assert operation_count(engine) == 1


def test_usage_and_metrics_report_each_budget(engine: Engine) -> None:
    """usage() lists each key's use and when it was exhausted; the metrics sum the keys per
    budget, with the fullest key's share and the refusals."""
    publish(engine, max_operations=4, cost="payload.amount", max_cost=10)
    charge(engine, by="a", amount=6)
    charge(engine, by="a", amount=4)
    charge(engine, by="b", amount=1)
    with pytest.raises(BudgetExceeded):
        charge(engine, by="a", amount=1)
    with Session(engine) as session:
        a, b = budgets.usage(session)
    assert (a.key, a.operations, a.cost, a.max_cost, b.key, b.cost) == ("a", 2, 10, 10, "b", 1)
    assert a.exhausted_at is not None
    assert b.exhausted_at is None
    samples = {
        (sample.name, sample.labels.get("budget")): sample.value
        for family in OutboxCollector(engine).collect()
        for sample in family.samples
    }
    assert samples[("outbox_budget_operations", "spend")] == 3
    assert samples[("outbox_budget_cost", "spend")] == 11
    assert samples[("outbox_budget_keys", "spend")] == 2
    assert samples[("outbox_budget_fullest_ratio", "spend")] == 1
    assert samples[("outbox_budget_refusals_total", "spend")] == 1


def test_concurrent_enqueuers_in_threads_never_exceed_the_budget(engine: Engine) -> None:
    """Eight threads racing for one key end with exactly max_operations operations."""
    publish(engine, max_operations=12)
    outcomes: list[str] = []
    lock = threading.Lock()

    def agent() -> None:
        for _ in range(4):
            try:
                charge(engine)
                result = "ok"
            except BudgetExceeded:
                result = "refused"
            with lock:
                outcomes.append(result)

    threads = [threading.Thread(target=agent) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("ok") == 12
    assert outcomes.count("refused") == 20
    assert operation_count(engine) == 12


AGENT_SCRIPT = """
import json, sys, uuid
from sqlalchemy.orm import Session
from outbox import api
from outbox.db import create_engine
from outbox.errors import BudgetExceeded
engine = create_engine(sys.argv[1])
done = {"ok": 0, "refused": 0, "message": ""}
for n in range(int(sys.argv[2])):
    try:
        with Session(engine) as session, session.begin():
            api.enqueue(session, tool="billing.charge", target="acct",
                        payload={"amount": 1, "n": uuid.uuid4().hex}, requested_by="agent-a")
        done["ok"] += 1
    except BudgetExceeded as exc:
        done["refused"] += 1
        done["message"] = str(exc)
print(json.dumps(done))
"""


@pytest.fixture
def worker_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An OUTBOX_CONFIG declaring the tool and a budget, as a worker's environment."""
    config = tmp_path / "outbox.toml"
    config.write_text(
        f"""
[tools."{TOOL}"]
kind = "http"
method = "POST"
url = "http://127.0.0.1:9/charge"
remote_ref = "id"
idempotency_header = "Idempotency-Key"

[budgets."agent-spend"]
tools = ["{TOOL}"]
by = "requested_by"
window_s = 86400
max_operations = 5
"""
    )
    yield config
    BUDGETS.clear()


def test_agent_processes_without_config_enforce_what_a_worker_published(
    engine: Engine, database_url: str, worker_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a worker published the TOML's budget, three agent processes with no OUTBOX_CONFIG
    racing for one key are held to it exactly."""
    monkeypatch.setenv("OUTBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("OUTBOX_CONFIG", str(worker_config))
    get_settings.cache_clear()
    try:
        publish_loaded_policies()
    finally:
        get_settings.cache_clear()
        REGISTRY.clear()
        CONTRACTS.clear()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    agents = [
        subprocess.Popen(
            [sys.executable, "-c", AGENT_SCRIPT, database_url, "4"],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    results = [json.loads(agent.communicate(timeout=60)[0]) for agent in agents]
    assert sum(r["ok"] for r in results) == 5
    assert sum(r["refused"] for r in results) == 7
    assert any("agent-spend" in r["message"] for r in results)
    assert operation_count(engine) == 5


# --- a cancel gives the share back (migration 0021: its usage rows deleted as it is cancelled) ---


def used_by(engine: Engine, key: str = "agent-a") -> int:
    """How many operations ``key`` has used inside the window, as outbox.budgets.usage says."""
    with Session(engine) as session:
        return next((u.operations for u in budgets.usage(session) if u.key == key), 0)


def usage_rows_of(engine: Engine, operation_id: uuid.UUID) -> int:
    """The operation's rows in outbox.budget_usage."""
    with engine.connect() as conn:
        query = text("SELECT count(*) FROM outbox.budget_usage WHERE operation_id = :id")
        return int(conn.execute(query, {"id": operation_id}).scalar_one())


def test_every_cancel_gives_the_share_back_and_a_pruned_operation_still_counts(
    engine: Engine,
) -> None:
    """The agent's cancel, an approver's rejection, the sweep's approval expiry and a saga's
    cancel each delete the operation's usage rows in the cancelling transaction; a confirmed
    operation pruned from outbox.operations keeps counting; enqueue's count agrees."""
    publish(engine, max_operations=5)
    withdrawn = charge(engine)
    rejected = charge(engine, require_approval=True)
    expired = charge(engine, require_approval=True)
    with Session(engine) as session, session.begin():
        step = outbox.saga(session, "s-budget", requested_by="agent-a").step(
            "charge", tool=TOOL, target="acct", payload={"amount": 1}
        )
    done = charge(engine)
    assert used_by(engine) == 5
    with pytest.raises(BudgetExceeded):
        charge(engine)

    with Session(engine) as session, session.begin():
        api.cancel(session, withdrawn.id)
    assert (usage_rows_of(engine, withdrawn.id), used_by(engine)) == (0, 4)
    with Session(engine) as session, session.begin():
        outbox.reject(session, rejected.id, by="carol", reason="no")
    assert (usage_rows_of(engine, rejected.id), used_by(engine)) == (0, 3)
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox.operations SET approval_expires_at = now() - interval '1 second'"
                " WHERE id = :id"
            ),
            {"id": expired.id},
        )
    with engine.connect() as conn:
        assert approval.expire_due_and_commit(conn).expired == 1
    assert (usage_rows_of(engine, expired.id), used_by(engine)) == (0, 2)
    with Session(engine) as session, session.begin():
        outbox.cancel_saga(session, "s-budget", by="bob", reason="not now", agent="agent-a")
    assert reload(engine, step.id).state is State.CANCELLED
    assert (usage_rows_of(engine, step.id), used_by(engine)) == (0, 1)

    with Session(engine) as session, session.begin():
        apply_move(
            session,
            done.id,
            from_state=State.PLANNED,
            to_state=State.SENT,
            actor=Actor.DISPATCHER,
            reason="test",
        )
        apply_move(
            session,
            done.id,
            from_state=State.SENT,
            to_state=State.CONFIRMED,
            actor=Actor.DISPATCHER,
            reason="test",
            remote_ref="ch-1",
        )
    age(engine, done.id, 7200, "resolved_at", "updated_at", "created_at")
    windows = DedupWindows({TOOL: None})
    assert sum(prune_batches(engine, older_than_s=3600, batch_size=100, windows=windows)) == 1
    assert operation_count(engine) == 4  # the confirmed one is gone; the cancelled ones stay
    assert (usage_rows_of(engine, done.id), used_by(engine)) == (1, 1)
    for _ in range(4):
        charge(engine)
    with pytest.raises(BudgetExceeded):
        charge(engine)


def _charge_as_of_0020(engine: Engine) -> uuid.UUID:
    """A planned charge and its usage row, written as that revision's enqueue wrote them (the
    code at head writes columns a database at 0020 does not have yet)."""
    with engine.begin() as conn:
        op_id = conn.execute(
            text(
                "INSERT INTO outbox.operations "
                "(intent_key, tool, target, payload, payload_hash, intent_hash) "
                "VALUES (:key, :tool, 'acct', '{}', :hash, "
                "        outbox.intent_hash(:tool, 'acct', :hash)) RETURNING id"
            ),
            {"key": uuid.uuid4().hex, "tool": TOOL, "hash": "0" * 64},
        ).scalar_one()
        conn.execute(
            text(
                "INSERT INTO outbox.budget_usage (budget, key, operation_id, cost) "
                "VALUES ('spend', 'agent-a', :id, 1)"
            ),
            {"id": op_id},
        )
    return uuid.UUID(str(op_id))


def _cancel_as_of_0020(engine: Engine, op_id: uuid.UUID) -> None:
    """The agent's cancel as a database at 0020 takes it (the state and its resolution)."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox.operations SET state = 'cancelled', "
                "resolved_at = clock_timestamp(), updated_at = clock_timestamp() WHERE id = :id"
            ),
            {"id": op_id},
        )


def test_0021_deletes_the_rows_of_operations_cancelled_before_it_and_downgrades(
    databases: Databases,
) -> None:
    """Upgrading to 0021 deletes the usage rows of operations cancelled already and keeps the
    others; down to 0020, a cancel leaves its rows again (no trigger), and up again fixes it."""
    fresh = create_engine(databases.create())
    try:
        migrate.upgrade(fresh, "0020")
        publish(fresh, max_operations=10)
        kept, cancelled = _charge_as_of_0020(fresh), _charge_as_of_0020(fresh)

        def rows() -> dict[uuid.UUID, int]:
            return {op_id: usage_rows_of(fresh, op_id) for op_id in (kept, cancelled)}

        _cancel_as_of_0020(fresh, cancelled)
        assert rows() == {kept: 1, cancelled: 1}
        migrate.upgrade(fresh, "0021")
        assert rows() == {kept: 1, cancelled: 0}
        assert used_by(fresh) == 1
        config = migrate.alembic_config()
        with fresh.connect() as conn:
            config.attributes["connection"] = conn
            command.downgrade(config, "0020")
        again = _charge_as_of_0020(fresh)
        _cancel_as_of_0020(fresh, again)
        assert usage_rows_of(fresh, again) == 1
        migrate.upgrade(fresh)
        assert usage_rows_of(fresh, again) == 0
    finally:
        fresh.dispose()


def test_a_cancel_never_waits_for_an_enqueuer_deleting_its_expired_row(engine: Engine) -> None:
    """An enqueuer whose count is deleting an operation's expired usage row (its transaction
    still open) does not hold up that operation's cancel: the cancel skips the row, which
    left the window for good, and the enqueuer's commit deletes it."""
    publish(engine, max_operations=5, window_s=60.0)
    old = charge(engine)
    age_usage(engine, 61)
    with engine.connect() as enqueuer:
        with enqueuer.begin():
            api.enqueue(
                enqueuer, tool=TOOL, target="acct", payload={"amount": 1}, requested_by="agent-a"
            )
            with Session(engine) as session, session.begin():
                session.execute(text("SET LOCAL lock_timeout = '2s'"))
                assert api.cancel(session, old.id).state is State.CANCELLED
            assert usage_rows_of(engine, old.id) == 1  # skipped: the enqueuer is deleting it
        assert usage_rows_of(engine, old.id) == 0
    assert used_by(engine) == 1
