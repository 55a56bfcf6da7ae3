"""Celery's task events as Flower reads them: a queue on a deployment's event exchange of a
real broker."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kombu import Connection, Exchange, Queue

from outbox.config import load_settings
from outbox.deployment import deployment_name
from outbox.workers.app import celery_settings

Event = dict[str, Any]


def event_exchange(database_url: str) -> str:
    """The event exchange of the deployment on ``database_url`` (each has its own)."""
    settings = load_settings(database_url=database_url)
    return str(celery_settings(settings, deployment=deployment_name(settings))["event_exchange"])


class TaskEvents:
    """A queue bound to a deployment's event exchange (:func:`event_exchange`) for task
    events, declared on entry (so it sees every event sent after that) and deleted with its
    connection on exit."""

    def __init__(self, broker_url: str, exchange: str) -> None:
        self._connection = Connection(broker_url)
        self._queue = Queue(
            exchange=Exchange(exchange, type="topic"),
            routing_key="task.#",
            exclusive=True,
            auto_delete=True,
        )(self._connection.default_channel)

    def __enter__(self) -> TaskEvents:
        self._queue.declare()
        return self

    def __exit__(self, *_: object) -> None:
        self._connection.release()

    def collect(self, *, until: Callable[[list[Event]], bool], timeout: float) -> list[Event]:
        """The task events received until ``until(events)`` holds or ``timeout`` seconds
        pass. A worker buffers its events and sends them as one message holding a list;
        those are returned one by one."""
        events: list[Event] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not until(events):
            message = self._queue.get(no_ack=True)
            if message is None:
                time.sleep(0.05)
                continue
            body = message.decode()
            events.extend(body if isinstance(body, list) else [body])
        return events


def types(events: list[Event]) -> set[str]:
    """The event types among ``events`` (``task-sent``, ``task-received``, ...)."""
    return {str(event.get("type")) for event in events}
