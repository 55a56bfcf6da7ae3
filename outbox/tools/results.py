"""What a tool call or a lookup can conclude, as types (never parsed from messages).

Dispatch results say what happened to *this* request; lookup results say what the remote
knows about the operation. Anything a tool cannot classify with certainty is ambiguous or
inconclusive: the outbox then inspects instead of guessing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Applied:
    """The remote holds the effect; ``remote_ref`` identifies it there (never empty)."""

    remote_ref: str
    result: Any = None

    def __post_init__(self) -> None:
        if not self.remote_ref:
            raise ValueError("Applied needs a non-empty remote_ref")


@dataclass(frozen=True)
class Rejected:
    """The remote refused this request authoritatively (a declared refusal, e.g. 422)."""

    reason: str
    result: Any = None


@dataclass(frozen=True)
class Ambiguous:
    """The request may or may not have been applied: timeout after sending, reset, 5xx…"""

    reason: str


@dataclass(frozen=True)
class NotDelivered:
    """Provably no byte of the request reached the remote (e.g. connection refused)."""

    reason: str


@dataclass(frozen=True)
class NotSent(NotDelivered):
    """The send deadline passed before the first byte: the request was not made.

    Produced by :func:`outbox.tools.run_dispatch` when the tool raised
    :class:`outbox.errors.SendDeadlinePassed`; the dispatcher moves the attempt back to
    ``planned`` ("not sent", no backoff), as when its own check before the call fails.
    """


@dataclass(frozen=True)
class NotApplied:
    """Lookup: the remote declares it has no effect for this operation."""

    reason: str = "not applied"


@dataclass(frozen=True)
class FailedRemotely:
    """Lookup: the remote declares the operation failed there."""

    reason: str


@dataclass(frozen=True)
class Inconclusive:
    """Lookup: no conclusion (an error, an unexpected answer); ask again later."""

    reason: str


DispatchResult = Applied | Rejected | Ambiguous | NotDelivered
LookupResult = Applied | NotApplied | FailedRemotely | Inconclusive
