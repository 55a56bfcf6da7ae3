"""agent-outbox: a durable outbox for the consequential actions of AI agents.

Record an intent in the same transaction as the agent's own state; a relay and dispatch
workers deliver it once, with the operation id as idempotency key; ambiguous outcomes are
looked up, replayed only under the remote's dedup contract, or put before a human.
"""

import importlib
import sys
import types
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

#: Where each public name lives. The package imports none of them until one is asked for (PEP
#: 562): ``outbox --version`` and a library's ``import outbox`` then cost no SQLAlchemy, no
#: pydantic settings (issue 33). The imports above, for type checkers only, say the same.
_EXPORTS: dict[str, str] = {
    "Actor": "outbox.states",
    "AlreadyDecided": "outbox.errors",
    "ApprovalMismatch": "outbox.errors",
    "ApprovalRefused": "outbox.errors",
    "BudgetExceeded": "outbox.errors",
    "Compensate": "outbox.sagas",
    "ConfigError": "outbox.errors",
    "DatabaseUnavailable": "outbox.errors",
    "DeclaredSaga": "outbox.sagas",
    "Event": "outbox.models",
    "Intent": "outbox.api",
    "IntentAlreadyDone": "outbox.errors",
    "IntentConflict": "outbox.errors",
    "InvalidIntent": "outbox.errors",
    "InvalidSagaRequest": "outbox.errors",
    "NotCancellable": "outbox.errors",
    "Operation": "outbox.models",
    "OperationBusy": "outbox.errors",
    "OperationNotFound": "outbox.errors",
    "OutboxError": "outbox.errors",
    "PrunedIntent": "outbox.models",
    "ResolutionRefused": "outbox.errors",
    "Saga": "outbox.sagas",
    "SagaEvent": "outbox.sagas",
    "SagaNotFound": "outbox.errors",
    "SagaNotRunning": "outbox.errors",
    "SagaPosition": "outbox.sagas",
    "SagaState": "outbox.sagas",
    "SagaStep": "outbox.sagas",
    "SagaSummary": "outbox.sagas",
    "SagaView": "outbox.sagas",
    "SchemaNotReady": "outbox.errors",
    "StaleResolution": "outbox.errors",
    "StaleTransition": "outbox.errors",
    "State": "outbox.states",
    "StepSpec": "outbox.sagas",
    "TransitionError": "outbox.errors",
    "TransitionNotAllowed": "outbox.errors",
    "WaitTimeout": "outbox.errors",
    "approve": "outbox.approval",
    "cancel": "outbox.api",
    "cancel_saga": "outbox.sagas",
    "declare_saga": "outbox.sagas",
    "enqueue": "outbox.api",
    "enqueue_many": "outbox.api",
    "find": "outbox.api",
    "get": "outbox.api",
    "get_saga": "outbox.sagas",
    "list_sagas": "outbox.sagas",
    "reject": "outbox.approval",
    "resolve": "outbox.resolve",
    "saga": "outbox.sagas",
    "wait": "outbox.api",
}


def __getattr__(name: str) -> Any:
    """Import a public name's module the first time the name is asked for."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    # Cached as a real attribute, so the next access skips this function.
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """The package's module type: a public name is never shadowed by a submodule's import."""

    def __setattr__(self, name: str, value: object) -> None:
        # Importing `outbox.resolve` (the module) sets the package's `resolve` to it, after
        # the module ran; eagerly importing the function last made `outbox.resolve` the
        # function whatever was imported later, and so it stays, loaded lazily or not.
        if isinstance(value, types.ModuleType) and name in _EXPORTS:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    """The public names and the loaded ones, as a package importing them eagerly would show."""
    return sorted({*globals(), *__all__})


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
