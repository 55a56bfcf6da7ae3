"""The agent API for asyncio: :mod:`outbox.api`, :mod:`outbox.approval` and
:func:`outbox.resolve` on SQLAlchemy's ``AsyncSession`` and ``AsyncConnection``, and an
awaitable :func:`wait`.

Each function runs its synchronous twin unchanged through SQLAlchemy's ``run_sync`` (the sync
code runs in a greenlet on the caller's async connection; psycopg's async driver does the
I/O): the validation, the SQL, the rules and the errors are the same ones, not a copy. And like
the sync API each joins the transaction of the session or connection it is given and never
begins, commits or rolls back: an intent exists if and only if the caller commits.

:func:`wait` costs no thread and no connection per waiter: the waiters of an event loop share
one listener per database (:mod:`outbox.listener`, two connections). Close it with
``await outbox.aio.close()`` before the loop ends, or let ``asyncio.run`` end it.

    from outbox import aio

    async with AsyncSession(engine) as session, session.begin():
        op = await aio.enqueue(session, tool="deploy.create_release", target="project-a",
                               payload={"version": "1.2.3"}, intent_key="release-1.2.3")
    settled = await aio.wait(op.id, timeout=60, engine=engine)
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar
from uuid import UUID

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from outbox import api, approval, listener, sagas, trace_context
from outbox.api import Intent, _as_uuid
from outbox.db import database_errors
from outbox.errors import OperationNotFound, WaitTimeout
from outbox.models import Executor, Operation
from outbox.resolve import resolve as _resolve
from outbox.sagas import (
    Compensate,
    DeclaredSaga,
    SagaPosition,
    SagaState,
    SagaSummary,
    SagaView,
    StepSpec,
)
from outbox.states import State

__all__ = [
    "AsyncExecutor",
    "AsyncSaga",
    "Intent",
    "approve",
    "cancel",
    "cancel_saga",
    "close",
    "declare_saga",
    "enqueue",
    "enqueue_many",
    "find",
    "get",
    "get_saga",
    "list_sagas",
    "reject",
    "resolve",
    "saga",
    "wait",
]

#: What the functions here take, as the sync ones take a ``Session`` or ``Connection``.
AsyncExecutor = AsyncSession | AsyncConnection

T = TypeVar("T")


async def _run(session: AsyncExecutor, call: Callable[[Executor], T]) -> T:
    """``call(sync twin of session)`` in the caller's transaction, on its async connection;
    a connection that cannot be made or a schema that is missing raise the typed errors the
    sync API raises (:func:`outbox.db.database_errors`), here too where the session connects."""
    # The caller's trace context, taken here: run_sync's greenlet has a context of its own.
    call = trace_context.within(trace_context.current(), call)
    with database_errors():
        if isinstance(session, AsyncSession):
            return await session.run_sync(call)
        return await session.run_sync(call)


async def enqueue(
    session: AsyncExecutor,
    *,
    tool: str,
    target: str,
    payload: Any,
    intent_key: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    requested_by: str | None = None,
    require_approval: bool = False,
    agent: str | None = None,
) -> Operation:
    """Record the intent to call ``tool`` on ``target`` with ``payload``, in the caller's txn.

    This function joins the transaction of ``session`` (a SQLAlchemy ``AsyncSession`` or
    ``AsyncConnection``) and does not begin, commit or roll back: the operation exists if and
    only if the caller commits. Until then no relay or worker can see it.

    ``intent_key`` names the intended effect across retries (default: the new operation's
    id). Calling again with the same key and the same tool, target and payload returns the
    existing operation, whatever its state; with any of them different it raises
    :class:`~outbox.IntentConflict` naming what differs, and writes nothing. Concurrent
    callers with one key end with one operation. A key whose operation finished and was
    pruned is still remembered: the same intent again raises
    :class:`~outbox.IntentAlreadyDone` and writes nothing; a different one,
    :class:`~outbox.IntentConflict`. The key belongs to ``agent`` (default: ``requested_by``,
    else the shared scope): another agent's same key names another operation.

    The payload must be a JSON object; it is canonicalised (RFC 8785) and its sha256 stored,
    and it never changes afterwards. Malformed input raises :class:`~outbox.InvalidIntent`
    naming the field. The rules are :func:`outbox.enqueue`'s, run by it: an unknown tool or a
    payload its published ``input_schema`` refuses is refused once the deployment has
    published its tools (``outbox tools publish``, or a worker's start), writing nothing.

    A tool that requires approval (its ``approval = "required"``), or ``require_approval=True``
    here (a call may tighten its tool's policy, never loosen it), creates the operation in
    ``awaiting_approval``: nothing is sent until a person approves exactly this payload
    (:func:`approve`).

    Over one of its tool's budgets it raises :class:`~outbox.BudgetExceeded` and writes
    nothing (docs/budgets.md).
    """
    return await _run(
        session,
        lambda s: api.enqueue(
            s,
            tool=tool,
            target=target,
            payload=payload,
            intent_key=intent_key,
            metadata=metadata,
            requested_by=requested_by,
            require_approval=require_approval,
            agent=agent,
        ),
    )


async def enqueue_many(session: AsyncExecutor, intents: Iterable[Intent]) -> list[Operation]:
    """Record many intents in the caller's transaction, in one round trip; in input order.

    The batch form of :func:`enqueue` (:func:`outbox.enqueue_many`, run by it): every intent
    is checked before anything is written (:class:`~outbox.InvalidIntent` names the intent's
    position and field); a key already recorded with the same intent gives back its
    operation; a conflict or a pruned key raises and writes nothing: the batch runs under a
    savepoint that is rolled back, and the caller's transaction goes on.
    """
    batch = list(intents)
    return await _run(session, lambda s: api.enqueue_many(s, batch))


async def get(session: AsyncExecutor, operation_id: UUID | str) -> Operation | None:
    """The operation with this id, or ``None``. Reads in the caller's transaction."""
    return await _run(session, lambda s: api.get(s, operation_id))


async def find(
    session: AsyncExecutor, intent_key: str, *, agent: str = api.SHARED_AGENT
) -> Operation | None:
    """The operation ``agent`` recorded under ``intent_key``, or ``None`` (see
    :func:`outbox.find`). Reads in the caller's transaction."""
    return await _run(session, lambda s: api.find(s, intent_key, agent=agent))


async def cancel(
    session: AsyncExecutor, operation_id: UUID | str, *, reason: str | None = None
) -> Operation:
    """Withdraw a ``planned`` operation that no attempt can have reached the remote with.

    Joins the caller's transaction and does not commit. Raises
    :class:`~outbox.NotCancellable` when the operation is past ``planned`` or an earlier
    attempt's outcome is in doubt (resolve it instead), and :class:`~outbox.OperationNotFound`.
    """
    return await _run(session, lambda s: api.cancel(s, operation_id, reason=reason))


async def resolve(
    session: AsyncExecutor,
    op_id: UUID | str,
    *,
    applied: bool,
    remote_ref: str | None = None,
    replay: bool = False,
    by: str,
    note: str,
    expect_attempts: int | None = None,
    payload_hash: str | None = None,
    force: bool = False,
) -> Operation:
    """Record an operator's verdict on an ``unknown`` or ``needs_human`` operation.

    :func:`outbox.resolve`, run by it, with the same arguments, rules and errors:
    ``applied=True`` with ``remote_ref`` → ``confirmed``; ``applied=False`` → ``failed``, or
    with ``replay=True`` → ``planned`` again. It joins the caller's transaction and does not
    commit; the operation's advisory lock is transaction-scoped, held until the caller's
    transaction ends. Raises :class:`~outbox.OperationBusy`,
    :class:`~outbox.OperationNotFound`, :class:`~outbox.StaleResolution` and
    :class:`~outbox.ResolutionRefused` (``field`` names the argument), writing nothing.
    """
    return await _run(
        session,
        lambda s: _resolve(
            s,
            op_id,
            applied=applied,
            remote_ref=remote_ref,
            replay=replay,
            by=by,
            note=note,
            expect_attempts=expect_attempts,
            payload_hash=payload_hash,
            force=force,
        ),
    )


async def approve(
    session: AsyncExecutor,
    op_id: UUID | str,
    *,
    by: str,
    payload_hash: str,
    note: str | None = None,
) -> Operation:
    """Approve an ``awaiting_approval`` operation: it moves to ``planned``, due at once.

    :func:`outbox.approve`, run by it, with the same arguments, rules and errors:
    ``payload_hash`` must be the stored payload's (the approver saw exactly this payload),
    ``by`` is recorded with the time, and an approval is single-use. It joins the caller's
    transaction and does not commit. Raises, writing nothing: :class:`~outbox.ApprovalRefused`
    (``field``), :class:`~outbox.ApprovalMismatch`, :class:`~outbox.AlreadyDecided` ("already
    decided by X at T", or expired) and :class:`~outbox.OperationNotFound`.
    """
    return await _run(
        session,
        lambda s: approval.approve(s, op_id, by=by, payload_hash=payload_hash, note=note),
    )


async def reject(session: AsyncExecutor, op_id: UUID | str, *, by: str, reason: str) -> Operation:
    """Refuse an ``awaiting_approval`` operation: it moves to ``cancelled`` and is never sent.

    :func:`outbox.reject`, run by it: ``by`` and ``reason`` are required and recorded with
    the time; it joins the caller's transaction and does not commit. Raises, writing nothing:
    :class:`~outbox.ApprovalRefused`, :class:`~outbox.AlreadyDecided`,
    :class:`~outbox.OperationNotFound`.
    """
    return await _run(session, lambda s: approval.reject(s, op_id, by=by, reason=reason))


async def wait(
    operation_id: UUID | str,
    timeout: float = 30.0,
    *,
    engine: AsyncEngine | str | None = None,
    poll_interval: float = 1.0,
    through_approval: bool = False,
) -> Operation:
    """Wait, without blocking the event loop, until the operation is terminal or needs a
    human, and return it.

    An operation ``awaiting_approval`` waits for a person too, so it is returned as it is;
    with ``through_approval=True`` the wait goes on through the approval to the real outcome.

    Sleeps on PostgreSQL ``LISTEN`` (a settled move sends a ``NOTIFY`` for an operation that
    someone waits for: ``outbox.waiters``), re-reading the row at most every
    ``poll_interval`` seconds in case a notification is missed: no busy loop. The waiters of
    one event loop share one listener on ``engine`` (an ``AsyncEngine``, whose pool lends
    it two connections until :func:`close`; a URL, or by default the configured database,
    for which it opens its own two): two connections however many wait, and no thread.
    It writes nothing but the ``outbox.waiters`` row of each waited operation, removed when
    its last waiter returns or is cancelled. Raises
    :class:`~outbox.WaitTimeout` (carrying the operation as last seen) after ``timeout``
    seconds, and :class:`~outbox.OperationNotFound`.
    """
    op_id = _as_uuid(operation_id)
    with database_errors():
        return await _wait(op_id, timeout, engine, poll_interval, through_approval=through_approval)


async def _wait(
    op_id: UUID,
    timeout: float,
    engine: AsyncEngine | str | None,
    poll_interval: float,
    *,
    through_approval: bool,
) -> Operation:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        shared = await listener.listener_for(engine)
        try:
            async with shared.watching(op_id) as woken:
                while True:
                    woken.clear()  # before the read: a NOTIFY after it wakes the sleep below
                    current = await shared.read(op_id)
                    if current is None:
                        raise OperationNotFound(f"no operation {op_id}", operation_id=op_id)
                    if current.is_settled and not (
                        through_approval and current.state is State.AWAITING_APPROVAL
                    ):
                        return current
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise WaitTimeout(
                            f"operation {op_id} is still {current.state.value} after {timeout:g}s",
                            operation=current,
                        )
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(min(remaining, _next_poll(loop, poll_interval))):
                            await woken.wait()
                    if shared.closed:
                        break  # closed under us: carry on with the loop's next listener
        except listener.ListenerClosed:
            pass


class AsyncSaga:
    """A saga opened by :func:`saga` on the caller's async session: add its steps with
    :meth:`step` (:class:`outbox.Saga`'s, run by it)."""

    def __init__(
        self, session: AsyncExecutor, key: str, state: SagaState, agent: str = api.SHARED_AGENT
    ) -> None:
        self._session = session
        self.key = key
        self.state = state
        #: The agent whose saga key it is.
        self.agent = agent

    def __repr__(self) -> str:
        return f"AsyncSaga(key={self.key!r}, state={self.state.value!r})"

    async def step(
        self,
        name: str,
        *,
        tool: str,
        target: str,
        payload: Mapping[str, Any],
        compensate: Compensate | None = None,
        pivot: bool = False,
        group: str | None = None,
    ) -> Operation:
        """Add step ``name`` (or find it again) and return its operation; joins the session's
        transaction and never commits. :meth:`outbox.Saga.step`, run by it, with the same
        arguments, rules and errors (``IntentConflict``, ``SagaNotRunning``, ``InvalidIntent``)."""
        key, agent = self.key, self.agent
        return await _run(
            self._session,
            lambda s: sagas.saga(s, key, agent=agent).step(
                name,
                tool=tool,
                target=target,
                payload=payload,
                compensate=compensate,
                pivot=pivot,
                group=group,
            ),
        )


async def saga(
    session: AsyncExecutor,
    saga_key: str,
    *,
    requested_by: str | None = None,
    agent: str | None = None,
) -> AsyncSaga:
    """Open ``agent``'s saga ``saga_key`` (default: ``requested_by``'s, else the shared
    scope), creating it ``running`` if it does not exist; joins the caller's transaction and
    never commits. :func:`outbox.saga`, run by it."""
    opened = await _run(
        session, lambda s: sagas.saga(s, saga_key, requested_by=requested_by, agent=agent)
    )
    return AsyncSaga(session, opened.key, opened.state, opened.agent)


async def declare_saga(
    session: AsyncExecutor,
    saga_key: str,
    steps: Sequence[StepSpec],
    *,
    requested_by: str | None = None,
    agent: str | None = None,
) -> DeclaredSaga:
    """Open ``saga_key`` with exactly these steps, or find it again; joins the caller's
    transaction and never commits. :func:`outbox.declare_saga`, run by it."""
    return await _run(
        session,
        lambda s: sagas.declare_saga(s, saga_key, steps, requested_by=requested_by, agent=agent),
    )


async def get_saga(
    session: AsyncExecutor, saga_key: str, *, agent: str = api.SHARED_AGENT
) -> SagaView | None:
    """``agent``'s saga with this key, its steps and trail, or ``None``
    (:func:`outbox.get_saga`)."""
    return await _run(session, lambda s: sagas.get_saga(s, saga_key, agent=agent))


async def list_sagas(
    session: AsyncExecutor,
    *,
    state: SagaState | str | None = None,
    limit: int = 50,
    agent: str | None = None,
    after: SagaPosition | None = None,
) -> list[SagaSummary]:
    """Sagas, newest first, optionally only ``agent``'s (:func:`outbox.list_sagas`)."""
    return await _run(
        session,
        lambda s: sagas.list_sagas(s, state=state, limit=limit, agent=agent, after=after),
    )


async def cancel_saga(
    session: AsyncExecutor,
    saga_key: str,
    *,
    by: str,
    reason: str,
    agent: str = api.SHARED_AGENT,
) -> SagaView:
    """Cancel ``agent``'s running saga: its held steps cancelled, its confirmed steps undone
    (:func:`outbox.cancel_saga`, run by it); joins the caller's transaction, never commits."""
    return await _run(
        session, lambda s: sagas.cancel_saga(s, saga_key, by=by, reason=reason, agent=agent)
    )


def _next_poll(loop: asyncio.AbstractEventLoop, poll_interval: float) -> float:
    """Seconds to the next re-read: on the loop clock's grid of ``poll_interval``, at least
    ``poll_interval`` away, so that the waiters polling at one interval re-read together,
    in one statement (:meth:`outbox.listener.SettledListener.read` batches them), not one each."""
    if poll_interval <= 0:
        return 0.0
    now = loop.time()
    return math.ceil((now + poll_interval) / poll_interval) * poll_interval - now


async def close() -> None:
    """Close the running event loop's shared :func:`wait` listeners and their connections.

    Call it before the loop ends (``asyncio.run`` ends them itself, by cancelling their
    tasks). A later :func:`wait` on the same loop opens a new one.
    """
    await listener.close()
