"""The database broker's statement: kombu's SQLAlchemy transport keeps its messages in
``outbox_kombu_message`` (``outbox.workers.app.BROKER_MESSAGE_TABLE``, which the test of this
package checks the statement names) and only hides the ones it delivered."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import text

from outbox.models import Executor
from outbox.sql.notify import BROKER_CHANNEL

# The taker's connection: its takes commit without waiting for the disk (a lost one delivers a
# message again, which the dispatcher's compare-and-set makes harmless).
_TAKE_WITHOUT_FLUSH = text("SET synchronous_commit = off")

_PRUNE_CONSUMED = text("DELETE FROM outbox_kombu_message WHERE visible = false")

# A batch's messages and their NOTIFY in one statement (a data-modifying WITH runs once,
# whether or not the query reads it). kombu's column defaults are client-side, so they are
# written out: the id from its sequence, visible, version 1.
_INSERT_MESSAGES = text(
    """
    WITH inserted AS (
        INSERT INTO outbox_kombu_message (id, visible, payload, version, queue_id)
        SELECT nextval('message_id_sequence'), true, payload, 1, :queue_id
        FROM unnest(CAST(:payloads AS text[])) AS payload
    )
    SELECT pg_notify(:channel, :queue)
    """
)

# The oldest visible message of any of the queues, removed as it is read: one statement
# (kombu's own take is a queue look-up, a SELECT ... FOR UPDATE, an UPDATE and a COMMIT).
# SKIP LOCKED: two consumers never wait on each other's row, and the second takes the next
# message instead of finding none (kombu's FOR UPDATE re-checked the row after the first
# committed and returned nothing, so that consumer slept until the next ring or poll).
# Ordered by id alone: the publishes leave kombu's timestamp column NULL, so kombu's
# (timestamp, id) order is the id's.
_TAKE_MESSAGE = text(
    """
    DELETE FROM outbox_kombu_message
    WHERE id = (
        SELECT id FROM outbox_kombu_message
        WHERE queue_id = ANY(:queue_ids) AND visible
        ORDER BY id
        LIMIT 1
        FOR UPDATE SKIP LOCKED
    )
    RETURNING queue_id, payload
    """
)


def take_without_flush(executor: Executor) -> None:
    """Let this session's commits return before their WAL reaches the disk (for the
    connection messages and operations are taken on: advice, not the truth)."""
    executor.execute(_TAKE_WITHOUT_FLUSH)


def prune_consumed_messages(executor: Executor) -> int:
    """Delete the messages the broker already delivered (invisible ones); how many went."""
    result = executor.execute(_PRUNE_CONSUMED)
    return int(result.rowcount)  # type: ignore[attr-defined]


def take_message(executor: Executor, queue_ids: Sequence[int]) -> tuple[int, str] | None:
    """Remove and return the oldest message on any of ``queue_ids``: ``(queue_id, payload)``,
    or None if they are all empty. Run it in autocommit: the message is gone when it returns,
    as kombu's own take hides it for good (a consumer that dies holding it loses it; the
    relay and the sweep, not the broker, make sure every operation is dispatched)."""
    row = executor.execute(_TAKE_MESSAGE, {"queue_ids": list(queue_ids)}).one_or_none()
    return None if row is None else (int(row[0]), str(row[1]))


def insert_messages(executor: Executor, queue_id: int, queue: str, payloads: Sequence[str]) -> None:
    """Insert ``payloads`` (kombu's serialised messages) on queue ``queue_id`` (named ``queue``)
    and NOTIFY the broker's consumers of them, in the caller's transaction (the notification
    is delivered at its commit): one statement for the lot, where kombu's own ``_put`` looks the
    queue up, inserts and commits once per message."""
    executor.execute(
        _INSERT_MESSAGES,
        {
            "queue_id": queue_id,
            "payloads": list(payloads),
            "channel": BROKER_CHANNEL,
            "queue": queue,
        },
    )
