"""The database broker's statement: kombu's SQLAlchemy transport keeps its messages in
``outbox_kombu_message`` (``outbox.workers.app.BROKER_MESSAGE_TABLE``, which the test of this
package checks the statement names) and only hides the ones it delivered."""

from __future__ import annotations

from sqlalchemy import text

from outbox.models import Executor

_PRUNE_CONSUMED = text("DELETE FROM outbox_kombu_message WHERE visible = false")


def prune_consumed_messages(executor: Executor) -> int:
    """Delete the messages the broker already delivered (invisible ones); how many went."""
    result = executor.execute(_PRUNE_CONSUMED)
    return int(result.rowcount)  # type: ignore[attr-defined]
