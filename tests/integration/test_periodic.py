"""The reconciler's periodic runs: one sweep at a time, decided by a PostgreSQL lock."""

from __future__ import annotations

from sqlalchemy import Engine

from outbox import sql
from outbox.locks import SWEEP_LOCK_KEY
from outbox.reconcilers.periodic import sweep_once
from outbox.reconcilers.sweep import SweepConfig
from outbox.states import State
from tests.factories import age, make_operation, reload

CONFIG = SweepConfig(sent_timeout_s=60.0)


def _lock_is_free(engine: Engine) -> bool:
    with engine.connect() as conn:
        taken = sql.locks.try_lock(conn, SWEEP_LOCK_KEY)
        sql.locks.unlock_all(conn)
        conn.commit()
    return taken


def test_a_sweep_while_another_runs_returns_at_once_and_touches_nothing(engine: Engine) -> None:
    """While another sweep holds the sweep's lock, a sweep does nothing and says so."""
    lost = make_operation(engine, State.SENT)
    age(engine, lost.id, 120, "sent_at", "first_sent_at")
    with engine.connect() as other_sweep:
        assert sql.locks.try_lock(other_sweep, SWEEP_LOCK_KEY)
        other_sweep.commit()
        assert sweep_once(engine, CONFIG) is None
        sql.locks.unlock_all(other_sweep)
        other_sweep.commit()
    assert reload(engine, lost.id).state is State.SENT


def test_a_sweep_takes_the_lock_for_its_run_and_leaves_it_free(engine: Engine) -> None:
    """A sweep with the lock free does its work and releases the lock when it ends."""
    lost = make_operation(engine, State.SENT)
    age(engine, lost.id, 120, "sent_at", "first_sent_at")
    result = sweep_once(engine, CONFIG)
    assert result is not None
    assert result.lost == 1
    assert reload(engine, lost.id).state is not State.SENT
    assert _lock_is_free(engine)
    # The next sweep, right after, finds nothing left to do.
    again = sweep_once(engine, CONFIG)
    assert again is not None
    assert again.lost == 0
