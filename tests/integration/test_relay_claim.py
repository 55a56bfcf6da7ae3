"""The relay's claim with a broker backlog: published `planned` rows waiting for a worker.

The claim is two halves (migration 0022): rows never published first, by due time, from
their own partial index; then rows published longer than republish_after ago, oldest publish
first, from theirs. A backlog of rows published recently is in neither: the claim neither
returns nor reads it. The relay runs the claim with the mark joined to it
(``claim_and_mark_due``, issue 35), and so does a worker taking directly (change 38).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import Connection, Engine, create_engine, text

from outbox import migrate, sql
from outbox.sql.relay import _CLAIM_AND_MARK_DUE
from tests.conftest import Databases
from tests.plans import operations_scans, prepared_plan

#: What the mark adds to the claim's plan: the CTE read (for the ids and the answer), the
#: update by the claimed rows' ctids or primary keys.
_MARK_SCANS = (("CTE Scan", ""), ("Tid Scan", "operations"), ("Index Scan", "pk_operations"))
#: A worker's take that locks reads the locked row through a function (never run for the relay).
_FLAGS_RELATIONS = ("relays", "pk_relays")
_LOCKED_READ_SCAN = ("Function Scan", "")

BACKLOG = 3000

# `n` planned rows named `{kind}-{g}`, due `due_ago` ago (1 ms apart, in g's order), published
# `published_ago` ago (also 1 ms apart, as the relay published them; NULL: never).
_LOAD = text(
    """
    INSERT INTO outbox.operations
        (intent_key, tool, target, payload, payload_hash, intent_hash, state,
         created_at, updated_at, available_at, published_at)
    SELECT :kind || '-' || g, 'deploy.create_release', 'project-a', p.payload,
           encode(sha256(convert_to(p.payload::text, 'UTF8')), 'hex'),
           outbox.intent_hash('deploy.create_release', 'project-a',
                              encode(sha256(convert_to(p.payload::text, 'UTF8')), 'hex')),
           'planned', t.due, t.due, t.due,
           now() - CAST(:published_ago AS interval) + g * interval '1 millisecond'
    FROM generate_series(1, :n) AS g
    CROSS JOIN LATERAL (
        SELECT now() - CAST(:due_ago AS interval) + g * interval '1 millisecond' AS due
    ) AS t
    CROSS JOIN LATERAL (SELECT jsonb_build_object('n', :kind || '-' || g) AS payload) AS p
    """
)


def _load(engine: Engine, kind: str, n: int, due_ago: str, published_ago: str | None) -> None:
    with engine.begin() as conn:
        conn.execute(
            _LOAD, {"kind": kind, "n": n, "due_ago": due_ago, "published_ago": published_ago}
        )


def _backlog(engine: Engine) -> None:
    """A backlog published 5 s ago, two lost messages before it, three new rows after it."""
    _load(engine, "lost", 2, "20 minutes", "10 minutes")
    _load(engine, "backlog", BACKLOG, "10 minutes", "5 seconds")
    _load(engine, "new", 3, "1 second", None)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE outbox.operations"))


def _keys(engine: Engine, ids: list[UUID]) -> list[str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, intent_key FROM outbox.operations WHERE id = ANY(:ids)"),
            {"ids": ids},
        )
        found: dict[UUID, str] = {row.id: row.intent_key for row in rows}
    return [found[i] for i in ids]


def _claim(engine: Engine, *, limit: int, republish_after_s: float = 30) -> list[str]:
    """One claim in its own transaction, rolled back: the intent keys, in the claim's order."""
    with engine.connect() as conn, conn.begin() as tx:
        claimed = sql.relay.claim_and_mark_due(
            conn, limit=limit, republish_after_s=republish_after_s
        )
        tx.rollback()
    return _keys(engine, [c.id for c in claimed])


def _plan(engine: Engine, *, analyze: bool) -> dict[str, Any]:
    options = "ANALYZE, BUFFERS, FORMAT JSON" if analyze else "FORMAT JSON"
    with engine.connect() as conn, conn.begin() as tx:
        plan = conn.execute(
            text(f"EXPLAIN ({options}) {_CLAIM_AND_MARK_DUE.clause}"),
            {
                "limit": 200,
                "look": 200,
                "republish_after": 30,
                "hold_back": 0,
                # The relay's: a look at RabbitMQ workers taking directly (none here).
                "defer": 0.2,
                "fresh": 30,
                "without_flush": False,
                "lock": False,
                "send": False,
                "send_tools": [],
                "send_max_attempts": [],
                "send_approval": [],
            },
        ).scalar_one()
        tx.rollback()
    top: dict[str, Any] = plan[0]["Plan"]
    return top


def _scans(node: dict[str, Any]) -> list[tuple[str, str]]:
    here = [(node["Node Type"], node.get("Index Name", node.get("Relation Name", "")))]
    here = [s for s in here if "Scan" in s[0] and s[0] != "Subquery Scan"]
    return here + [s for child in node.get("Plans", []) for s in _scans(child)]


def test_new_rows_come_first_and_the_backlog_is_left_until_republish_after(
    engine: Engine,
) -> None:
    """Behind thousands of rows published and waiting for a worker, the claim returns the
    never-published rows first (even before older lost messages), then the lost ones, and
    none of the backlog until republish_after has passed for it."""
    _backlog(engine)
    assert _claim(engine, limit=4) == ["new-1", "new-2", "new-3", "lost-1"]
    assert _claim(engine, limit=200) == [
        "new-1",
        "new-2",
        "new-3",
        "lost-1",
        "lost-2",
    ]
    with engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE outbox.operations SET published_at = published_at - interval '31 seconds'"
                " WHERE intent_key LIKE 'backlog-%'"
            )
        )
    claimed = _claim(engine, limit=200)
    assert claimed[:5] == ["new-1", "new-2", "new-3", "lost-1", "lost-2"]
    assert claimed[5:] == [f"backlog-{g}" for g in range(1, 196)]


def test_two_claims_at_once_take_disjoint_rows_from_both_halves(
    engine: Engine,
) -> None:
    """A claim's row locks hold both halves: a second claim skips them and takes the rest."""
    claim = sql.relay.claim_and_mark_due
    _backlog(engine)
    with engine.connect() as first, first.begin():
        mine = claim(first, limit=4, republish_after_s=30)
        with engine.connect() as second, second.begin():
            theirs = claim(second, limit=200, republish_after_s=30)
    assert _keys(engine, [c.id for c in mine]) == ["new-1", "new-2", "new-3", "lost-1"]
    assert _keys(engine, [c.id for c in theirs]) == ["lost-2"]


def test_the_claim_reads_each_half_from_its_own_index_not_the_backlog(
    engine: Engine,
) -> None:
    """The plan scans the two partial indexes of migration 0022, and the claim reads a few
    buffers, not one per row of the backlog (the single scan of `ix_operations_planned_due`
    fetched every backlog row from the heap to test its published_at)."""
    _backlog(engine)
    scans = _scans(_plan(engine, analyze=False))
    # The mark reads the claimed rows back from the CTE and updates them by primary key.
    # The deferral's look at the workers' flags reads outbox.relays (a few rows) once, by a
    # scan or by its primary key as the planner likes.
    scans = [
        scan
        for scan in scans
        if scan not in (*_MARK_SCANS, _LOCKED_READ_SCAN) and scan[1] not in _FLAGS_RELATIONS
    ]
    assert sorted(scans) == [
        ("Index Scan", "ix_operations_planned_published"),
        ("Index Scan", "ix_operations_planned_unpublished"),
    ]
    top = _plan(engine, analyze=True)
    buffers = top["Shared Hit Blocks"] + top["Shared Read Blocks"]
    assert top["Actual Rows"] == 5
    assert buffers < 100, f"the claim read {buffers} buffers for 5 rows beside a backlog"


def _published_at(conn: Connection, keys: list[str]) -> dict[str, datetime | None]:
    rows = conn.execute(
        text("SELECT intent_key, published_at FROM outbox.operations WHERE intent_key = ANY(:k)"),
        {"k": keys},
    )
    return {row.intent_key: row.published_at for row in rows}


def test_the_relay_claim_stamps_published_at_and_a_rollback_undoes_it(engine: Engine) -> None:
    """claim_and_mark_due stamps every row it claims, hands back each row's previous stamp,
    and leaves nothing stamped when its transaction rolls back."""
    _load(engine, "lost", 2, "20 minutes", "10 minutes")
    _load(engine, "new", 3, "1 second", None)
    keys = ["new-1", "new-2", "new-3", "lost-1", "lost-2"]
    with engine.connect() as conn:
        before = _published_at(conn, keys)
        conn.commit()
        with conn.begin() as tx:
            claimed = sql.relay.claim_and_mark_due(conn, limit=200, republish_after_s=30)
            assert _keys(engine, [c.id for c in claimed]) == keys  # another connection: no stamp
            stamped = _published_at(conn, keys)
            tx.rollback()
        after = _published_at(conn, keys)
    assert [c.previous_published_at for c in claimed] == [before[k] for k in keys]
    assert all(stamped[k] is not None and stamped[k] != before[k] for k in keys)
    assert after == before


def test_unconfirmed_rows_get_their_previous_stamp_back(engine: Engine) -> None:
    """Rows whose messages the broker did not confirm are given back the published_at they had
    before the claim (NULL for a new row, the old time for a lost one); the rest keep theirs."""
    _load(engine, "lost", 1, "20 minutes", "10 minutes")
    _load(engine, "new", 2, "1 second", None)
    keys = ["new-1", "new-2", "lost-1"]
    with engine.connect() as conn:
        before = _published_at(conn, keys)
        conn.commit()
        with conn.begin():
            claimed = sql.relay.claim_and_mark_due(conn, limit=200, republish_after_s=30)
            confirmed, unconfirmed = claimed[:1], claimed[1:]
            sql.relay.unmark_published(conn, unconfirmed)
        after = _published_at(conn, keys)
    assert _keys(engine, [c.id for c in confirmed]) == ["new-1"]
    assert after["new-1"] is not None
    assert after["new-2"] is None
    assert after["lost-1"] == before["lost-1"]


def _generic_plan(engine: Engine) -> dict[str, Any]:
    """The claim's plan as a prepared statement keeps it: generic."""
    values = {
        "limit": "1",
        "look": "2",
        "republish_after": "30",
        "hold_back": "0",
        "defer": "0.2",
        "fresh": "30",
        "without_flush": "true",
        "lock": "true",
        "send": "true",
        "send_tools": "'{deploy.create_release}'",
        "send_max_attempts": "'{3}'",
        "send_approval": "'{f}'",
    }
    return prepared_plan(engine, _CLAIM_AND_MARK_DUE.sql, values, "force_generic_plan")


def test_the_generic_plan_made_on_a_new_table_never_reads_the_table(
    databases: Databases,
) -> None:
    """A worker's take prepared while the table is new (a new database: no statistics, ten
    pages assumed) keeps its plan while the table grows: the mark must still fetch the claimed
    rows (by ctid or primary key), not read the table (`id = ANY(...)` alone did, every take)."""
    engine = create_engine(databases.create())
    try:
        migrate.upgrade(engine)
        with engine.connect() as conn:
            never_analysed = conn.execute(
                text(
                    "SELECT reltuples = -1 AND NOT EXISTS (SELECT FROM pg_statistic "
                    "WHERE starelid = 'outbox.operations'::regclass) "
                    "FROM pg_class WHERE oid = 'outbox.operations'::regclass"
                )
            ).scalar_one()
        assert never_analysed
        scans = operations_scans(_generic_plan(engine))
    finally:
        engine.dispose()
    assert ("Seq Scan", "") not in scans, scans
    assert {("Tid Scan", ""), ("Index Scan", "pk_operations")} & set(scans), scans


def test_the_generic_plan_made_beside_a_due_backlog_never_reads_the_table(
    engine: Engine,
) -> None:
    """Made while thousands of never-published rows are due (analysed), the plan still
    fetches the claimed rows (by ctid or primary key)."""
    _load(engine, "due", 20_000, "1 minute", None)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE outbox.operations"))
    scans = operations_scans(_generic_plan(engine))
    assert ("Seq Scan", "") not in scans, scans
    assert {("Tid Scan", ""), ("Index Scan", "pk_operations")} & set(scans), scans
