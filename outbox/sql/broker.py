"""The database broker's statement: kombu's SQLAlchemy transport keeps its messages in
``outbox_kombu_message`` (``outbox.workers.app.BROKER_MESSAGE_TABLE``, which the test of this
package checks the statement names) and only hides the ones it delivered."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table, insert, text

from outbox.models import Executor

_PRUNE_CONSUMED = text("DELETE FROM outbox_kombu_message WHERE visible = false")


def prune_consumed_messages(executor: Executor) -> int:
    """Delete the messages the broker already delivered (invisible ones); how many went."""
    result = executor.execute(_PRUNE_CONSUMED)
    return int(result.rowcount)  # type: ignore[attr-defined]


def insert_messages(
    executor: Executor, table: Table, queue_id: int, payloads: Sequence[str]
) -> None:
    """Insert ``payloads`` (kombu's serialised messages) on queue ``queue_id`` of kombu's
    message ``table``, in the caller's transaction: one statement for the lot (psycopg sends
    the rows in one pipeline), where kombu's own ``_put`` looks the queue up, inserts and
    commits once per message. The table's column defaults (``visible``, ``version``, the id's
    sequence) are kombu's own."""
    rows: list[dict[str, Any]] = [{"payload": p, "queue_id": queue_id} for p in payloads]
    executor.execute(insert(table), rows)
