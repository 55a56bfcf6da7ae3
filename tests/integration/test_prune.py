"""Retention against a real PostgreSQL: `outbox db prune` deletes old finished operations whole
(events and webhook deliveries with them), batch by batch, and nothing else."""

from __future__ import annotations

from collections.abc import Iterator
from uuid import UUID

import pytest
from alembic import command
from sqlalchemy import Engine, text

from outbox import migrate, sql
from outbox.cli.db import parse_duration, prune_batches
from outbox.db import create_engine
from outbox.sql.retention import DedupWindows
from outbox.states import LIVE_STATES, TERMINAL_STATES, State
from tests.conftest import Databases
from tests.factories import age, make_operation

DAY = 86400
MONTH = 30 * DAY
TERMINAL = sorted(TERMINAL_STATES)
LIVE = sorted(LIVE_STATES)
#: The tools these tests' operations use, registered without a dedup window.
WINDOWS = DedupWindows({"deploy.create_release": None, "t.x": None})


def _deliver(engine: Engine, operation_id: UUID, status: str) -> None:
    """Record one webhook delivery of ``operation_id`` with ``status``."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox.webhook_deliveries (operation_id, event, payload, status, "
                "delivered_at) VALUES (:id, 'resolved', '{}', :status, "
                "CASE WHEN :status = 'delivered' THEN clock_timestamp() END)"
            ),
            {"id": operation_id, "status": status},
        )


def _finished(engine: Engine, state: State, resolved_ago_s: float) -> UUID:
    """A terminal operation resolved ``resolved_ago_s`` seconds ago, with a delivered webhook."""
    op = make_operation(engine, state)
    age(engine, op.id, resolved_ago_s, "resolved_at", "updated_at", "created_at")
    _deliver(engine, op.id, "delivered")
    return op.id


def _counts(engine: Engine) -> dict[UUID, tuple[int, int]]:
    """Each operation's id with its number of events and of webhook deliveries."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT o.id,"
                " (SELECT count(*) FROM outbox.events e WHERE e.operation_id = o.id),"
                " (SELECT count(*) FROM outbox.webhook_deliveries d WHERE d.operation_id = o.id)"
                " FROM outbox.operations o"
            )
        )
        return {row[0]: (int(row[1]), int(row[2])) for row in rows}


def _orphans(engine: Engine) -> tuple[int, int]:
    """Events and deliveries whose operation is gone (the cascade makes these impossible)."""
    with engine.connect() as conn:
        return (
            int(
                conn.execute(
                    text(
                        "SELECT count(*) FROM outbox.events e WHERE NOT EXISTS "
                        "(SELECT FROM outbox.operations o WHERE o.id = e.operation_id)"
                    )
                ).scalar_one()
            ),
            int(
                conn.execute(
                    text(
                        "SELECT count(*) FROM outbox.webhook_deliveries d WHERE NOT EXISTS "
                        "(SELECT FROM outbox.operations o WHERE o.id = d.operation_id)"
                    )
                ).scalar_one()
            ),
        )


def _prune_all(engine: Engine, older_than_s: float, batch_size: int = 1000) -> list[int]:
    return list(
        prune_batches(engine, older_than_s=older_than_s, batch_size=batch_size, windows=WINDOWS)
    )


def _prunable(engine: Engine, older_than_s: float) -> int:
    with engine.connect() as conn:
        return sql.retention.count_prunable(
            conn, older_than_s=older_than_s, windows=WINDOWS
        ).prunable


def test_prune_removes_exactly_the_old_finished_operations(engine: Engine) -> None:
    """Old terminal rows go with their events and deliveries; new ones and every live or
    needs_human row stay, however old, with their events and deliveries untouched."""
    old_terminal = {_finished(engine, state, 40 * DAY) for state in TERMINAL}
    new_terminal = {_finished(engine, state, 29 * DAY) for state in TERMINAL}
    live = set()
    for state in LIVE:
        for ago in (0, 400 * DAY):
            op = make_operation(engine, state)
            # Every timestamp a live row has, made old: none of them may count.
            age(engine, op.id, ago, "created_at", "updated_at", "available_at")
            _deliver(engine, op.id, "delivered")
            live.add(op.id)
    before = _counts(engine)
    assert all(events > 0 and deliveries == 1 for events, deliveries in before.values())

    assert _prunable(engine, MONTH) == len(old_terminal)
    assert _prune_all(engine, MONTH) == [len(old_terminal)]

    after = _counts(engine)
    assert set(after) == new_terminal | live
    assert after == {op_id: before[op_id] for op_id in after}
    assert _orphans(engine) == (0, 0)
    assert _prune_all(engine, MONTH) == [0]


def test_a_pending_webhook_keeps_its_operation_until_delivered_or_abandoned(
    engine: Engine,
) -> None:
    """A finished operation whose webhook is still being retried stays; once the delivery is
    settled (delivered or abandoned) the operation is pruned like any other."""
    pending = _finished(engine, State.CONFIRMED, 40 * DAY)
    abandoned = _finished(engine, State.FAILED, 40 * DAY)
    _deliver(engine, pending, "pending")
    _deliver(engine, abandoned, "abandoned")
    assert _prune_all(engine, MONTH) == [1]
    assert set(_counts(engine)) == {pending}
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox.webhook_deliveries SET status = 'delivered', "
                "delivered_at = clock_timestamp() WHERE status = 'pending'"
            )
        )
    assert _prune_all(engine, MONTH) == [1]
    assert _counts(engine) == {}
    assert _orphans(engine) == (0, 0)


@pytest.mark.parametrize(("resolved_ago_s", "pruned"), [(110, True), (70, False)])
def test_the_cutoff_is_the_database_clock_minus_the_age(
    engine: Engine, resolved_ago_s: int, pruned: bool
) -> None:
    """`resolved_at < now() - older_than`, both read from the database."""
    op_id = _finished(engine, State.CANCELLED, resolved_ago_s)
    assert _prune_all(engine, 90) == [1 if pruned else 0]
    assert (op_id in _counts(engine)) is not pruned


def test_batches_delete_the_oldest_first_each_in_its_own_transaction(engine: Engine) -> None:
    """A batch deletes at most its size, oldest resolved first; the loop stops on a short one."""
    # Resolved 31, 32, ... 37 days ago, in states round-robin.
    ids = [_finished(engine, TERMINAL[n % 3], (31 + n) * DAY) for n in range(7)]
    oldest_first = ids[::-1]
    with engine.begin() as conn:
        assert sql.retention.prune_terminal(conn, older_than_s=MONTH, limit=3, windows=WINDOWS) == 3
    assert set(_counts(engine)) == set(oldest_first[3:])

    # The remaining four: a full batch of 3, then a short batch of 1 ends the run.
    assert _prune_all(engine, MONTH, batch_size=3) == [3, 1]
    assert _counts(engine) == {}

    # A count that divides exactly costs one more, empty, batch.
    for n in range(6):
        _finished(engine, State.CONFIRMED, (31 + n) * DAY)
    assert _prune_all(engine, MONTH, batch_size=2) == [2, 2, 2, 0]


def test_committed_batches_stay_when_a_run_stops_halfway(engine: Engine) -> None:
    """Stopped between batches, what was deleted stays deleted and the rest waits."""
    for n in range(5):
        _finished(engine, State.FAILED, (31 + n) * DAY)
    batches = prune_batches(engine, older_than_s=MONTH, batch_size=2, windows=WINDOWS)
    assert next(batches) == 2
    batches.close()
    assert len(_counts(engine)) == 3
    assert _prune_all(engine, MONTH, batch_size=2) == [2, 1]


def test_dry_run_counts_and_deletes_nothing(engine: Engine) -> None:
    """The count is what a prune would delete; counting leaves every row in place."""
    for state in TERMINAL:
        _finished(engine, state, 40 * DAY)
        _finished(engine, state, DAY)
    make_operation(engine, State.NEEDS_HUMAN)
    before = _counts(engine)
    assert _prunable(engine, MONTH) == 3
    assert _prunable(engine, DAY // 2) == 6
    assert _counts(engine) == before


def test_a_row_locked_elsewhere_is_skipped_not_waited_for(engine: Engine) -> None:
    """SKIP LOCKED: a prune never waits on another transaction's row (another prune's)."""
    locked = _finished(engine, State.CONFIRMED, 40 * DAY)
    free = _finished(engine, State.CONFIRMED, 41 * DAY)
    with engine.connect() as holder:
        holder.execute(
            text("SELECT FROM outbox.operations WHERE id = :id FOR UPDATE"), {"id": locked}
        )
        with engine.begin() as conn:
            conn.execute(text("SET LOCAL lock_timeout = '2s'"))
            assert (
                sql.retention.prune_terminal(conn, older_than_s=MONTH, limit=10, windows=WINDOWS)
                == 1
            )
        holder.rollback()
    assert set(_counts(engine)) == {locked}
    assert free not in _counts(engine)


def test_the_batch_reads_the_resolved_at_index(engine: Engine) -> None:
    """On a table of mostly live rows, the batch and the count read ix_operations_resolved_at:
    the cost follows the rows pruned, not the table."""
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox.operations"
                " (intent_key, tool, target, payload, payload_hash, intent_hash)"
                " SELECT 'live-' || g, 't.x', 'a', '{}', repeat('0', 64),"
                " outbox.intent_hash('t.x', 'a', repeat('0', 64))"
                " FROM generate_series(1, 20000) g"
            )
        )
        conn.execute(
            text(
                "INSERT INTO outbox.operations"
                " (intent_key, tool, target, payload, payload_hash, intent_hash, state,"
                " resolved_at)"
                " SELECT 'done-' || g, 't.x', 'a', '{}', repeat('0', 64),"
                " outbox.intent_hash('t.x', 'a', repeat('0', 64)), 'cancelled',"
                " clock_timestamp() - make_interval(days => g)"
                " FROM generate_series(1, 200) g"
            )
        )
    with engine.connect() as conn:
        conn.execute(text("ANALYZE outbox.operations"))
        conn.execute(text("ANALYZE outbox.webhook_deliveries"))
        conn.commit()
        params = {"older_than": MONTH, "limit": 1000, **WINDOWS.params()}
        from outbox.sql.retention import (  # noqa: PLC0415 -- the statements' own SQL
            _COUNT_PRUNABLE,
            _PRUNE_BATCH,
        )

        for statement in (_PRUNE_BATCH, _COUNT_PRUNABLE):
            plan = "\n".join(
                row[0] for row in conn.execute(text("EXPLAIN " + statement.text), params)
            )
            assert "ix_operations_resolved_at" in plan, plan
            assert "Seq Scan on operations" not in plan, plan
        conn.rollback()
    with engine.begin() as conn:
        assert (
            sql.retention.prune_terminal(conn, older_than_s=MONTH, limit=1000, windows=WINDOWS)
            == 171
        )  # days 30 to 200


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("30d", 30 * DAY), ("12h", 12 * 3600), ("90m", 5400), ("3600s", 3600), (" 1d ", DAY)],
)
def test_durations(value: str, seconds: int) -> None:
    """Whole numbers with a unit of s, m, h or d."""
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["30", "d", "1.5h", "-1d", "30 d", "2w", "30D", "", "0d"])
def test_bad_durations_name_the_value(value: str) -> None:
    """Anything else, and zero, is refused naming the value."""
    with pytest.raises(ValueError, match="--older-than") as refused:
        parse_duration(value)
    assert repr(value) in str(refused.value)


# --- the migration --------------------------------------------------------------------------

INDEX_QUERY = (
    "SELECT indexdef FROM pg_indexes WHERE schemaname = 'outbox' "
    "AND indexname = 'ix_operations_resolved_at'"
)


@pytest.fixture
def fresh_engine(databases: Databases) -> Iterator[Engine]:
    """An engine on a new, empty database."""
    fresh = create_engine(databases.create())
    yield fresh
    fresh.dispose()


def _downgrade(engine: Engine, revision: str) -> None:
    config = migrate.alembic_config()
    with engine.connect() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, revision)


def _index(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text(INDEX_QUERY)).scalars())


def test_0005_adds_the_partial_index_and_downgrades_without_it(fresh_engine: Engine) -> None:
    """Up: the partial index on resolved_at; down to 0004: only that index is gone."""
    migrate.upgrade(fresh_engine)
    [definition] = _index(fresh_engine)
    assert "(resolved_at)" in definition
    assert "WHERE (resolved_at IS NOT NULL)" in definition
    _downgrade(fresh_engine, "0004")
    assert migrate.current(fresh_engine) == "0004"
    assert _index(fresh_engine) == []
    migrate.upgrade(fresh_engine)
    assert _index(fresh_engine) == [definition]


def test_0005_accepts_the_index_built_concurrently_beforehand(fresh_engine: Engine) -> None:
    """A DBA may build the index with CREATE INDEX CONCURRENTLY first; the upgrade keeps it."""
    migrate.upgrade(fresh_engine, "0004")
    with fresh_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(
            text(
                "CREATE INDEX CONCURRENTLY ix_operations_resolved_at ON outbox.operations "
                "(resolved_at) WHERE resolved_at IS NOT NULL"
            )
        )
    migrate.upgrade(fresh_engine)
    assert migrate.status(fresh_engine).up_to_date
    assert len(_index(fresh_engine)) == 1
