"""agent-outbox: a durable outbox for the consequential actions of AI agents.

Record an intent in the same transaction as the agent's own state; a relay and dispatch
workers deliver it once, with the operation id as idempotency key; ambiguous outcomes are
looked up, replayed only under the remote's dedup contract, or put before a human.
"""

from importlib import metadata

from outbox.api import Intent, cancel, enqueue, enqueue_many, find, get, wait
from outbox.approval import approve, reject
from outbox.errors import (
    AlreadyDecided,
    ApprovalMismatch,
    ApprovalRefused,
    BudgetExceeded,
    ConfigError,
    DatabaseUnavailable,
    IntentAlreadyDone,
    IntentConflict,
    InvalidIntent,
    InvalidSagaRequest,
    NotCancellable,
    OperationBusy,
    OperationNotFound,
    OutboxError,
    ResolutionRefused,
    SagaNotFound,
    SagaNotRunning,
    SchemaNotReady,
    StaleResolution,
    StaleTransition,
    TransitionError,
    TransitionNotAllowed,
    WaitTimeout,
)
from outbox.models import Event, Operation, PrunedIntent
from outbox.resolve import resolve
from outbox.sagas import (
    Compensate,
    DeclaredSaga,
    Saga,
    SagaEvent,
    SagaPosition,
    SagaState,
    SagaStep,
    SagaSummary,
    SagaView,
    StepSpec,
    cancel_saga,
    declare_saga,
    get_saga,
    list_sagas,
    saga,
)
from outbox.states import Actor, State

#: The installed distribution's version (``agent-outbox`` in pyproject.toml); a source tree
#: imported without being installed has none.
try:
    __version__ = metadata.version("agent-outbox")
except metadata.PackageNotFoundError:  # pragma: no cover -- only without an install
    __version__ = "0+unknown"

__all__ = [
    "Actor",
    "AlreadyDecided",
    "ApprovalMismatch",
    "ApprovalRefused",
    "BudgetExceeded",
    "Compensate",
    "ConfigError",
    "DatabaseUnavailable",
    "DeclaredSaga",
    "Event",
    "Intent",
    "IntentAlreadyDone",
    "IntentConflict",
    "InvalidIntent",
    "InvalidSagaRequest",
    "NotCancellable",
    "Operation",
    "OperationBusy",
    "OperationNotFound",
    "OutboxError",
    "PrunedIntent",
    "ResolutionRefused",
    "Saga",
    "SagaEvent",
    "SagaNotFound",
    "SagaNotRunning",
    "SagaPosition",
    "SagaState",
    "SagaStep",
    "SagaSummary",
    "SagaView",
    "SchemaNotReady",
    "StaleResolution",
    "StaleTransition",
    "State",
    "StepSpec",
    "TransitionError",
    "TransitionNotAllowed",
    "WaitTimeout",
    "__version__",
    "approve",
    "cancel",
    "cancel_saga",
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
