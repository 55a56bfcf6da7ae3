"""The Celery app: queues, serialisation and delivery settings, from ``OUTBOX_*`` config.

``app`` is created unconfigured at import; its configuration is read from the settings the
first time Celery needs it (``on_configure``), and importing this module connects to nothing.
The app with every task registered (this layer's and the reconcilers') is assembled in
:mod:`outbox.cli.celery_app`, the one that ``outbox worker`` and ``celery -A`` run.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, Task
from kombu import Exchange, Queue

from outbox.config import Settings, get_settings
from outbox.contracts import CONTRACTS
from outbox.db import DATABASE_ERRORS, database_url
from outbox.deployment import deployment_name
from outbox.errors import DatabaseUnavailable
from outbox.logs import Action, describe_error
from outbox.workers import dbbroker

#: Durable queues, one per kind of work: the names code and ``-Q`` use (each the alias of
#: the deployment's own queue, see :func:`task_queues`).
QUEUES = ("dispatch", "lookup", "human", "reconcile")

#: Task names (stable: they are in messages in flight during an upgrade).
DISPATCH_TASK = "outbox.dispatch"
LOOKUP_TASK = "outbox.lookup"
SWEEP_TASK = "outbox.sweep"
ESCALATE_TASK = "outbox.escalate"
#: Advance the sagas of settled operations (``outbox.reconcilers.sagas``), sent by name by
#: the dispatch task: the workers layer does not import the reconcilers.
SAGA_TASK = "outbox.saga"

#: The app's setting holding its deployment's name (for log lines; Celery ignores it).
OUTBOX_DEPLOYMENT_KEY = "outbox_deployment"

#: The database broker's tables (kombu's SQLAlchemy transport), named so nobody mistakes them.
BROKER_QUEUE_TABLE = "outbox_kombu_queue"
BROKER_MESSAGE_TABLE = "outbox_kombu_message"

#: Seconds a task may run beyond its tool's send deadline + timeout before Celery kills it
#: (default of ``OUTBOX_TASK_TIME_LIMIT_SLACK``). The limit is per message, but a message
#: starts an operation only if its whole attempt fits in what is left (outbox/workers/tasks.py).
TIME_LIMIT_SLACK_S = 30.0
#: RabbitMQ's default consumer_timeout is 30 minutes; a hard limit far below it means an
#: unacknowledged message is never taken back from a worker that is merely slow.
MAX_TIME_LIMIT_S = 15 * 60.0


def broker_url(settings: Settings) -> str:
    """``OUTBOX_BROKER_URL``, or the database itself (kombu's SQLAlchemy transport)."""
    if settings.broker_url is not None:
        return settings.broker_url.get_secret_value()
    return f"{dbbroker.ALIAS}+{database_url(settings)}"


def uses_database_broker(url: str) -> bool:
    """Whether ``url`` is the database broker (no publisher confirms, no redelivery:
    correctness rests on the relay and the sweep)."""
    return url.startswith(f"{dbbroker.ALIAS}+")


def task_queues(deployment: str) -> list[Queue]:
    """The deployment's queues, ``outbox.<deployment>.<kind>``, each aliased by its kind.

    Two deployments sharing a broker (one RabbitMQ vhost) then never consume each other's
    messages. The alias is what routes, ``-Q`` and ``apply_async(queue=...)`` name, so only
    this function knows the names on the broker.
    """
    queues = []
    for kind in QUEUES:
        name = f"outbox.{deployment}.{kind}"
        queues.append(Queue(name, Exchange(name), routing_key=name, alias=kind))
    return queues


def celery_settings(
    settings: Settings, *, deployment: str, time_limit_s: float | None = None
) -> dict[str, Any]:
    """The Celery configuration for ``settings`` in ``deployment`` (a plain dict, for tests
    and docs; :func:`outbox.deployment.deployment_name` gives the deployment)."""
    url = broker_url(settings)
    # The database broker carries no events to another process (kombu's virtual exchanges
    # and bindings live in each process's memory): nobody could read them, so none are sent,
    # whatever OUTBOX_TASK_EVENTS says. Each cost every message four events built and routed
    # to nowhere (sent, received, started, succeeded).
    task_events = settings.task_events and not uses_database_broker(url)
    conf: dict[str, Any] = {
        "broker_url": url,
        "broker_connection_retry_on_startup": True,
        # JSON only: a message is an operation id, never code.
        "task_serializer": "json",
        "accept_content": ["json"],
        "result_serializer": "json",
        # The outbox table holds every outcome; Celery keeps none.
        "task_ignore_result": True,
        "result_backend": None,
        # A message is acknowledged only after the dispatch function returns, and given back
        # if the worker process dies; prefetch 1 keeps messages on the broker, not in a
        # worker's memory, so a stuck worker does not hoard them.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_queues": task_queues(deployment),
        "task_default_queue": "dispatch",
        "task_routes": {
            DISPATCH_TASK: {"queue": "dispatch"},
            LOOKUP_TASK: {"queue": "lookup"},
            SWEEP_TASK: {"queue": "reconcile"},
            ESCALATE_TASK: {"queue": "human"},
            SAGA_TASK: {"queue": "reconcile"},
        },
        # Remote control (Flower's buttons, `celery inspect`) and task events of their own:
        # on a shared vhost another deployment's Flower neither sees nor commands these
        # workers, and two workers named alike (celery@host) do not fight for one pidbox.
        "control_exchange": f"outbox.{deployment}",
        "event_exchange": f"outbox.{deployment}.celeryev",
        OUTBOX_DEPLOYMENT_KEY: deployment,
        "task_time_limit": min(time_limit_s or MAX_TIME_LIMIT_S, MAX_TIME_LIMIT_S),
        "worker_hijack_root_logger": False,
        # Flower's task pages read these events; each costs a publish per task and state
        # (sent, received, started, succeeded), so operators may turn them off (RabbitMQ).
        "worker_send_task_events": task_events,
        "task_send_sent_event": task_events,
    }
    if settings.broker_url is None:
        conf["broker_transport_options"] = {
            "queue_tablename": BROKER_QUEUE_TABLE,
            "message_tablename": BROKER_MESSAGE_TABLE,
            # kombu passes the options on to create_engine: its errors show no parameters.
            "hide_parameters": True,
            # Between polls when no NOTIFY rings (outbox.workers.dbbroker drops it before
            # create_engine sees the options).
            "polling_interval": settings.broker_poll_interval,
        }
    return conf


def time_limit_for(contract_timeouts: list[float], slack_s: float = TIME_LIMIT_SLACK_S) -> float:
    """A hard task time limit covering the slowest tool's send deadline plus its timeout."""
    slowest = max(contract_timeouts, default=0.0)
    return min(slowest + slack_s, MAX_TIME_LIMIT_S)


log = logging.getLogger(__name__)


class OutboxTask(Task):  # type: ignore[misc]
    """Every outbox task: a database error (a restart under a running worker) is one line,
    never the driver's statement text nor a traceback.

    The task logs it once (``task_database_error``: the task, its error class and first
    line), then raises :class:`DatabaseUnavailable` with that line, an exception the task
    ``throws``: Celery records the failure and logs it in one line, without a traceback.
    Nothing is lost: the relay publishes a planned row again, the sweep checks the rest.
    """

    throws = (DatabaseUnavailable,)

    def __call__(self, *args: object, **kwargs: object) -> object:
        """Run the task, each database error turned into one line."""
        try:
            return super().__call__(*args, **kwargs)
        except DATABASE_ERRORS as exc:
            error = describe_error(exc)
            log.warning(
                "%s failed on the database: %s",
                self.name,
                error,
                extra={
                    "action": Action.TASK_DATABASE_ERROR,
                    "task": self.name,
                    "error": error,
                },
            )
            raise DatabaseUnavailable(f"{self.name}: {error}") from None


class OutboxCelery(Celery):  # type: ignore[misc]
    """Celery configured from ``OUTBOX_*`` settings the first time it is used."""

    def on_configure(self) -> None:
        """Load the tools (they set the time limit), then apply :func:`celery_settings`."""
        # Deferred: loading tools imports user modules, which may import this app.
        from outbox.tools import load_tools  # noqa: PLC0415

        settings = get_settings()
        load_tools(settings)
        contracts = [CONTRACTS.get(name) for name in CONTRACTS.names()]
        limit = time_limit_for(
            [c.send_deadline_s + c.timeout_s for c in contracts if c is not None],
            settings.task_time_limit_slack,
        )
        self.conf.update(
            celery_settings(settings, deployment=deployment_name(settings), time_limit_s=limit)
        )


app = OutboxCelery("outbox", include=["outbox.workers.tasks"], task_cls=OutboxTask)
