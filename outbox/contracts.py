"""What the core knows about tools: their names and their contracts, in a plain table.

The executable tools live in ``outbox.tools``; they register their :class:`ToolContract`
here, so the core (``enqueue``'s check for unknown tools, operator resolution's in-flight
horizon) never imports the layer above. A contract is validated when it is built:
contradictory values are refused with a :class:`ConfigError` naming the tool and the field.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from outbox.errors import ConfigError
from outbox.guards import Breaker, Concurrency, Rate
from outbox.payloads import schema_problem

#: Slack between "the last byte a dispatcher may send" and "a request can no longer land":
#: covers scheduling delays and the remote's own queueing.
INFLIGHT_MARGIN_S = 5.0
#: Clock skew allowed between the database and a remote with a dedup window, in the floor of
#: ``dedup margin_s``: NTP keeps servers within milliseconds, and 30 s is a week of a broken
#: sync at a typical quartz drift of 50 ppm.
DEDUP_SKEW_ALLOWANCE_S = 30.0
#: How long an operation may wait for a person's approval before the sweep cancels it, unless
#: the tool says otherwise: a working day and a night, so a request made in the evening can
#: still be approved the next morning.
DEFAULT_APPROVAL_TTL_S = 86400.0
#: The values of a tool's ``approval`` (TOML key and ``@tool`` keyword).
APPROVAL_VALUES = ("none", "required")


@dataclass(frozen=True, kw_only=True)
class DedupContract:
    """The remote promises: one key with one payload within ``window_s`` is one effect."""

    #: How long after the first request the remote remembers a key.
    window_s: float
    #: Safety margin taken off the window's end: covers the replay's own travel time (a
    #: replay committed `sent` just before the end may leave ``send_deadline_s`` later and
    #: land ``timeout_s`` after that) and clock skew between the database and the remote:
    #: at least ``send_deadline_s + timeout_s + DEDUP_SKEW_ALLOWANCE_S``.
    margin_s: float = 300.0
    #: True if the remote also deduplicates *concurrent* same-key requests, so a replay may
    #: leave while the previous attempt could still be in flight.
    concurrent_safe: bool = False


@dataclass(frozen=True, kw_only=True)
class ToolContract:
    """The knobs of one tool (the same names as the TOML keys, without ``_s`` for Python)."""

    name: str
    #: Total deadline of one call, all phases together; no retries inside a call.
    timeout_s: float = 10.0
    #: Longest time from the `sent` commit to the first byte; later, the call is not made.
    send_deadline_s: float = 2.0
    #: After this long, a request sent at ``sent_at`` can no longer land at the remote.
    inflight_horizon_s: float = 600.0
    #: Inconclusive lookups before falling through to the dedup rule or a human.
    max_checks: int = 12
    #: Attempts (sends) before the operation goes to a human.
    max_attempts: int = 5
    #: Whether the tool can ask the remote if the effect happened.
    has_lookup: bool = False
    #: The remote's deduplication contract, if it has one.
    dedup: DedupContract | None = None
    #: Whether every operation of this tool waits for a person's approval before any send.
    approval_required: bool = False
    #: How long such an operation may wait for it; then the sweep cancels it.
    approval_ttl_s: float = DEFAULT_APPROVAL_TTL_S
    #: The JSON Schema every payload must match (checked at enqueue by a process that knows
    #: this contract), or ``None`` for any JSON object. Also what the MCP server and the
    #: framework adapters show a model as the payload's parameters.
    input_schema: Mapping[str, Any] | None = None
    #: What the action does, in a sentence or two for the models and people choosing it (the
    #: MCP server and the framework adapters put it first in the tool's description).
    description: str | None = None
    #: The circuit breaker (docs/guards.md), or ``None``: no breaker.
    breaker: Breaker | None = None
    #: The rate limit of sends, or ``None``: no limit.
    rate: Rate | None = None
    #: The cap on attempts in ``sent`` at once, or ``None``: no cap.
    concurrency: Concurrency | None = None

    @property
    def guarded(self) -> bool:
        """Whether any guard is declared (the dispatcher's hot path skips them all if not)."""
        return self.breaker is not None or self.rate is not None or self.concurrency is not None

    def __post_init__(self) -> None:
        for problem in self._problems():
            raise ConfigError(f"tool {self.name!r}: {problem}")

    def _problems(self) -> Iterator[str]:
        positive = {
            "timeout_s": self.timeout_s,
            "send_deadline_s": self.send_deadline_s,
            "inflight_horizon_s": self.inflight_horizon_s,
            "max_checks": self.max_checks,
            "max_attempts": self.max_attempts,
            "approval_ttl_s": self.approval_ttl_s,
        }
        for name, value in positive.items():
            if value <= 0:
                yield f"{name} must be positive, not {value}"
        floor = self.send_deadline_s + self.timeout_s + INFLIGHT_MARGIN_S
        if self.inflight_horizon_s < floor:
            yield (
                f"inflight_horizon_s ({self.inflight_horizon_s:g}) must be at least "
                f"send_deadline_s + timeout_s + {INFLIGHT_MARGIN_S:g}s margin ({floor:g}): "
                "before that a request may still be on its way"
            )
        yield from self._dedup_problems()
        for guard in (self.breaker, self.rate, self.concurrency):
            if guard is not None:
                yield from guard.problems()
        if self.input_schema is not None:
            problem = schema_problem(self.input_schema)
            if problem is not None:
                yield problem

    def _dedup_problems(self) -> Iterator[str]:
        dedup = self.dedup
        if dedup is None:
            return
        if dedup.margin_s < 0:
            yield f"dedup margin_s must not be negative, not {dedup.margin_s:g}"
        floor = self.send_deadline_s + self.timeout_s + DEDUP_SKEW_ALLOWANCE_S
        if 0 <= dedup.margin_s < floor:
            yield (
                f"dedup margin_s ({dedup.margin_s:g}) must be at least send_deadline_s "
                f"({self.send_deadline_s:g}) + timeout_s ({self.timeout_s:g}) + "
                f"{DEDUP_SKEW_ALLOWANCE_S:g}s clock-skew allowance ({floor:g}): a replay "
                "leaving at the end of the window must land before the remote forgets the key"
            )
        if dedup.window_s <= dedup.margin_s:
            yield (
                f"dedup window_s ({dedup.window_s:g}) must exceed its margin_s ({dedup.margin_s:g})"
            )


def approval_required(value: object, tool: str) -> bool:
    """``approval = "required"`` → True, ``"none"`` → False; anything else raises
    :class:`ConfigError` naming the tool and the field."""
    if value not in APPROVAL_VALUES:
        raise ConfigError(
            f"tool {tool!r}: approval must be one of {', '.join(map(repr, APPROVAL_VALUES))}, "
            f"not {value!r}"
        )
    return value == "required"


@dataclass
class ContractTable:
    """The tools this process knows. ``loaded`` is False until a registry has been loaded:
    until then ``enqueue`` accepts any tool name (a pure agent process needs no tools)."""

    _contracts: dict[str, ToolContract] = field(default_factory=dict)
    loaded: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def register(self, contract: ToolContract) -> None:
        """Add or replace the contract of ``contract.name``."""
        with self._lock:
            self._contracts[contract.name] = contract

    def get(self, name: str) -> ToolContract | None:
        """The contract of tool ``name``, or ``None``."""
        return self._contracts.get(name)

    def names(self) -> list[str]:
        """Registered tool names, sorted."""
        return sorted(self._contracts)

    def mark_loaded(self) -> None:
        """Declare the table complete: from now on unknown tools are refused."""
        self.loaded = True

    def clear(self) -> None:
        """Forget every contract (tests)."""
        with self._lock:
            self._contracts.clear()
            self.loaded = False


#: The process-wide table.
CONTRACTS = ContractTable()
