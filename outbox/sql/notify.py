"""LISTEN/NOTIFY: the channels the outbox rings, and the statements that listen on them.

Channel names are identifiers, which PostgreSQL cannot take as bound parameters: each
``LISTEN`` is written out in full, and tests/unit/test_sql_in_one_place.py checks that every
statement names the channel its constant says.
"""

from __future__ import annotations

from sqlalchemy import Text, bindparam, func, select, text

from outbox.models import Executor

#: NOTIFY channel announcing that an operation settled; its payload is the operation id.
SETTLED_CHANNEL = "outbox_settled"

#: NOTIFY channel the relay listens on; rung by enqueue only while some relay is idle.
PLANNED_CHANNEL = "outbox_planned"

#: NOTIFY channel a RabbitMQ worker taking directly rings when its idle flag goes down (every
#: slot busy): a relay that left fresh rows to waiting workers looks again at once.
RELAY_CHANNEL = "outbox_relay"

#: NOTIFY channel on which a worker reports a message naming an operation this database does
#: not have; its payload is the task (``dispatch``, ``lookup``). ``outbox metrics`` counts them.
UNKNOWN_OPERATION_CHANNEL = "outbox_unknown_operation"

#: NOTIFY channel of the database broker's publishes (:mod:`outbox.doorbell`); its payload is
#: the queue's name.
BROKER_CHANNEL = "outbox_broker"

_LISTEN_SETTLED = text("LISTEN outbox_settled")

# The relay's doorbell connection also writes the idle flag, which is advice (a lost one
# costs a poll interval or a needless NOTIFY), so its commits need not wait for the disk.
_LISTEN_PLANNED = text("SET synchronous_commit = off; LISTEN outbox_planned")

_LISTEN_UNKNOWN_OPERATION = text("LISTEN outbox_unknown_operation")

# The relay's: it hears the workers' rings whether or not it listens to enqueue's bell.
_LISTEN_RELAY = text("LISTEN outbox_relay")

# A relay that leaves fresh rows to waiting workers stops hearing enqueue's bell.
_UNLISTEN_PLANNED_ONLY = text("UNLISTEN outbox_planned")
_LISTEN_PLANNED_ONLY = text("LISTEN outbox_planned")

#: Run by the doorbell's own psycopg connection (no SQLAlchemy session there), hence a string.
LISTEN_BROKER = "LISTEN outbox_broker"

#: The same, for a worker that takes due operations itself (enqueue's bell wakes it too).
LISTEN_BROKER_AND_PLANNED = "LISTEN outbox_broker; LISTEN outbox_planned"


_UNLISTEN_ALL = text("UNLISTEN *")

_UNLISTEN_PLANNED = text("UNLISTEN *; RESET synchronous_commit")


def listen_settled(executor: Executor) -> None:
    """LISTEN on :data:`SETTLED_CHANNEL` (settled moves of operations this session waits for)."""
    executor.execute(_LISTEN_SETTLED)


def listen_planned(executor: Executor) -> None:
    """LISTEN on :data:`PLANNED_CHANNEL`, with this session's commits not waiting for the
    WAL flush (``synchronous_commit = off``) until :func:`unlisten_planned`."""
    executor.execute(_LISTEN_PLANNED)


def unlisten_planned(executor: Executor) -> None:
    """Undo :func:`listen_planned`: stop listening and reset ``synchronous_commit``."""
    executor.execute(_UNLISTEN_PLANNED)


def listen_relay(executor: Executor) -> None:
    """LISTEN on :data:`RELAY_CHANNEL` (the relay: a worker's flag went down)."""
    executor.execute(_LISTEN_RELAY)


def hear_planned(executor: Executor, *, hear: bool) -> None:
    """LISTEN (``hear``) or UNLISTEN on :data:`PLANNED_CHANNEL` only, the session's other
    channels and settings left as they are."""
    executor.execute(_LISTEN_PLANNED_ONLY if hear else _UNLISTEN_PLANNED_ONLY)


def listen_unknown_operations(executor: Executor) -> None:
    """LISTEN on :data:`UNKNOWN_OPERATION_CHANNEL` (``outbox metrics`` counts the reports)."""
    executor.execute(_LISTEN_UNKNOWN_OPERATION)


def unlisten_all(executor: Executor) -> None:
    """Stop listening on every channel."""
    executor.execute(_UNLISTEN_ALL)


_NOTIFY_UNKNOWN_OPERATION = select(
    func.pg_notify(UNKNOWN_OPERATION_CHANNEL, bindparam("task", type_=Text))
)


def notify_unknown_operation(executor: Executor, task: str) -> None:
    """Tell whoever counts (``outbox metrics``) that a ``task`` message named an operation
    this database does not have. Sent with the caller's commit (now, in autocommit mode)."""
    executor.execute(_NOTIFY_UNKNOWN_OPERATION, {"task": task})
