"""The HTTP API's statements (:mod:`outbox.web`): a page of operations by keyset, and the row
lock under which a conditional request (``If-Match``) compares and decides."""

from __future__ import annotations

from uuid import UUID

from sqlalchemy import bindparam, select

from outbox.models import Executor, Operation
from outbox.schema import operations
from outbox.states import State


def page_operations(
    executor: Executor,
    *,
    limit: int,
    before_id: UUID | None = None,
    intent_key: str | None = None,
    state: State | None = None,
    tool: str | None = None,
    target: str | None = None,
    agent: str | None = None,
) -> list[Operation]:
    """Up to ``limit`` operations, newest first, older than ``before_id`` (the keyset cursor:
    ids are UUIDv7, so id order is creation order), matching every filter given."""
    query = select(operations).order_by(operations.c.id.desc()).limit(limit)
    if before_id is not None:
        query = query.where(operations.c.id < before_id)
    if intent_key is not None:
        query = query.where(operations.c.intent_key == intent_key)
    if state is not None:
        query = query.where(operations.c.state == state.value)
    if tool is not None:
        query = query.where(operations.c.tool == tool)
    if target is not None:
        query = query.where(operations.c.target == target)
    if agent is not None:
        query = query.where(operations.c.agent == agent)
    return [Operation.from_row(row) for row in executor.execute(query).mappings()]


# FOR NO KEY UPDATE: the lock an UPDATE of the row takes, so a second conditional request
# waits for the first's commit and then compares with what it wrote.
_LOCK_OPERATION = (
    select(operations)
    .where(operations.c.id == bindparam("operation_id"))
    .with_for_update(key_share=True)
)


def lock_operation(executor: Executor, operation_id: UUID) -> Operation | None:
    """The operation, its row locked until the caller's transaction ends; ``None`` if none."""
    found = executor.execute(_LOCK_OPERATION, {"operation_id": operation_id}).mappings()
    row = found.one_or_none()
    return Operation.from_row(row) if row is not None else None
