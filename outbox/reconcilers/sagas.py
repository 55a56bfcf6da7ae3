"""The saga driver: advances sagas by their decision table, each in a transaction of its own.

:func:`advance_saga_and_commit` takes one saga's row lock (``FOR NO KEY UPDATE``, skipping a
saga another transaction holds: an agent adding a step, another pass) and applies
:func:`outbox.sagas.advance` (release held steps, cancel them, record compensations, move
the saga), then commits. It runs

* from the periodic sweep (:func:`advance_due_sagas_and_commit`), over the live sagas
  (``running``, ``compensating``, ``needs_human``) whose next check is due: this pass alone
  guarantees progress, whatever nudge was lost;
* promptly after a step's operation settles (:func:`nudge_sagas_of_and_commit`, called by
  the lookup and the ``outbox.saga`` task the dispatch worker sends after it commits an
  outcome): best effort.

A saga that waits (an operation in flight) is looked at again ``recheck_s`` later, or at once
when a nudge comes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from uuid import UUID

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from outbox import sagas, sql, storable
from outbox.logs import Action
from outbox.models import SagaRef
from outbox.sagas import Advanced

log = logging.getLogger(__name__)

#: Seconds before the periodic pass looks again at a saga that waits for an operation (a
#: settled operation nudges it sooner).
RECHECK_S = 10.0


def advance_saga_and_commit(
    engine: Engine, ref: SagaRef, *, recheck_s: float = RECHECK_S
) -> Advanced | None:
    """Advance one saga under its row lock and commit; ``None`` if there is no such saga or
    another transaction holds it (that one's commit, or the next pass, decides)."""
    with engine.begin() as conn:
        advanced = sagas.advance(conn, ref.key, agent=ref.agent, skip_locked=True)
        if advanced is not None:
            sql.sagas.check_again_in(conn, ref, delay_s=recheck_s)
    return advanced


@dataclass
class SagaPass:
    """What one :func:`advance_due_sagas_and_commit` did."""

    advanced: int = 0  #: sagas looked at and advanced (or found waiting)
    busy: int = 0  #: held by another transaction: next time
    failed: int = 0  #: advancing raised: logged, the pass went on
    #: Moves made, by the state moved into.
    moves: dict[str, int] = field(default_factory=dict)


def advance_due_sagas_and_commit(
    engine: Engine, *, limit: int = 500, recheck_s: float = RECHECK_S
) -> SagaPass:
    """Advance every live saga whose next check is due (up to ``limit``), each in its own
    transaction: an error on one is logged and the pass goes on."""
    result = SagaPass()
    with engine.connect() as conn:
        due = sql.sagas.due_sagas(conn, limit=limit)
    for key in due:
        _advance_one(engine, key, result, recheck_s=recheck_s)
    return result


def nudge_sagas_of_and_commit(
    engine: Engine, operation_ids: Sequence[UUID], *, recheck_s: float = RECHECK_S
) -> SagaPass:
    """Advance the sagas these operations belong to (steps or compensations), now: called
    after their outcome committed. Best effort: the periodic pass catches anything missed."""
    result = SagaPass()
    with engine.connect() as conn:
        keys = sql.sagas.sagas_of_operations(conn, list(operation_ids))
    for key in keys:
        _advance_one(engine, key, result, recheck_s=recheck_s)
    return result


def _advance_one(engine: Engine, key: SagaRef, result: SagaPass, *, recheck_s: float) -> None:
    try:
        advanced = advance_saga_and_commit(engine, key, recheck_s=recheck_s)
    except Exception as exc:
        if isinstance(exc, DBAPIError) and exc.connection_invalidated:
            raise
        result.failed += 1
        log.error(  # noqa: TRY400 -- the summary, never a traceback with bound values
            "saga %s could not be advanced: %s",
            key.key,
            storable.error_summary(exc),
            extra={"action": Action.SAGA_ADVANCE_FAILED, "saga_key": key.key, "agent": key.agent},
        )
        return
    if advanced is None:
        result.busy += 1
        return
    result.advanced += 1
    for state in advanced.moves:
        result.moves[state.value] = result.moves.get(state.value, 0) + 1
