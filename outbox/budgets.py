"""Budgets: at most N operations, or a declared cost, per budget key and sliding window.

A budget (``[budgets."name"]`` in ``OUTBOX_CONFIG``, or :func:`outbox.tools.budget`) names the
tools it covers, what one key is (``requested_by``, or ``metadata.<key>`` such as a
conversation), a window, and ``max_operations`` and/or ``max_cost`` (the cost read from a
numeric ``payload.<path>``). ``enqueue`` refuses an intent over any of its tool's budgets with
:class:`~outbox.errors.BudgetExceeded`, writing nothing.

Every worker writes its loaded budgets to ``outbox.budgets`` when it starts
(:func:`publish_budgets_committed`), so an agent process that loads no configuration enforces
them too: ``enqueue`` learns that its tool is budgeted from its own INSERT (which then inserts
nothing), takes a transaction-scoped advisory lock per (budget, key) in the caller's
transaction, counts the key's usage inside the window (``outbox.budget_usage``, database clock)
in a statement of its own (so its snapshot sees every enqueue committed before the lock was
granted: exact across processes, under READ COMMITTED), and inserts the operation with its
usage rows. An unbudgeted tool costs no statement more. docs/budgets.md has the rules.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine

from outbox import sql, webhooks
from outbox.errors import BudgetExceeded, ConfigError, InvalidIntent
from outbox.locks import advisory_key
from outbox.logs import Action
from outbox.models import Executor, IntentKey, WebhookEvent
from outbox.sql.budgets import BudgetUsage

log = logging.getLogger(__name__)

__all__ = [
    "BUDGETS",
    "NO_KEY",
    "Budget",
    "BudgetTable",
    "BudgetUsage",
    "publish_budgets_committed",
    "usage",
]

#: Advisory-lock namespace of budget keys (:func:`outbox.locks.advisory_key`).
BUDGET_NAMESPACE = "outbox.budget"
#: The key of an intent without the value a budget counts by (no ``requested_by``, or no such
#: metadata key): such intents share one key rather than escaping the budget.
NO_KEY = ""
#: A budget name: letters, digits, ``.``, ``_``, ``-`` (it appears in metrics and webhooks).
BUDGET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: ``requested_by`` or ``metadata.<key>``.
BY = re.compile(r"requested_by|metadata\.[A-Za-z0-9_-]{1,64}")
#: ``payload.<dotted path>``.
COST_PATH = re.compile(r"payload(\.[A-Za-z0-9_-]{1,64}){1,8}")


@dataclass(frozen=True, kw_only=True)
class Budget:
    """One budget: at most ``max_operations`` operations and/or ``max_cost`` of cost per key
    (``by``) within any ``window_s`` seconds, over the operations of ``tools``."""

    name: str
    tools: tuple[str, ...]
    #: ``requested_by`` or ``metadata.<key>``: intents with the same value share the budget.
    by: str = "requested_by"
    #: The sliding window, in seconds (the database clock).
    window_s: float
    max_operations: int | None = None
    #: ``payload.<path>``: a number in each payload, the operation's cost.
    cost: str | None = None
    max_cost: float | None = None

    def __post_init__(self) -> None:
        tools: object = self.tools
        if isinstance(tools, str):
            object.__setattr__(self, "tools", (tools,))
        elif isinstance(tools, list):
            object.__setattr__(self, "tools", tuple(tools))
        for problem in self._problems():
            raise ConfigError(f"budget {self.name!r}: {problem}", budget=self.name)

    def _problems(self) -> Iterator[str]:
        if not isinstance(self.name, str) or not BUDGET_NAME.fullmatch(self.name):
            yield "name: letters, digits, '.', '_' or '-', at most 128 characters"
        if not self.tools or not all(isinstance(t, str) and t for t in self.tools):
            yield "tools: a non-empty list of tool names"
        if not isinstance(self.by, str) or not BY.fullmatch(self.by):
            yield f'by: "requested_by" or "metadata.<key>", not {self.by!r}'
        yield from _positive("window_s", self.window_s)
        if self.max_operations is not None and (
            isinstance(self.max_operations, bool) or not isinstance(self.max_operations, int)
        ):
            yield f"max_operations: an integer, not {self.max_operations!r}"
        elif self.max_operations is not None:
            yield from _positive("max_operations", self.max_operations)
        if self.max_cost is not None:
            yield from _positive("max_cost", self.max_cost)
        if self.cost is not None and (
            not isinstance(self.cost, str) or not COST_PATH.fullmatch(self.cost)
        ):
            yield f'cost: a path into the payload such as "payload.amount", not {self.cost!r}'
        if self.max_cost is not None and self.cost is None:
            yield "max_cost: needs cost, the payload path of each operation's cost"
        if self.cost is not None and self.max_cost is None:
            yield "cost: needs max_cost, the most cost per window"
        if self.max_operations is None and self.max_cost is None:
            yield "declare max_operations, or cost and max_cost"

    def key_of(self, requested_by: str | None, metadata: Mapping[str, Any]) -> str:
        """The budget key of an intent (:data:`NO_KEY` when the intent has no such value)."""
        if self.by == "requested_by":
            return requested_by if requested_by is not None else NO_KEY
        value = metadata.get(self.by.removeprefix("metadata."))
        if value is None:
            return NO_KEY
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)

    def cost_of(self, payload: Mapping[str, Any]) -> float:
        """The cost of one operation: the number at :attr:`cost` (0 without a cost budget).
        Raises :class:`InvalidIntent` naming the path when it is missing or not a number."""
        if self.cost is None:
            return 0.0
        value: Any = payload
        for part in self.cost.split(".")[1:]:
            value = value.get(part) if isinstance(value, Mapping) else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidIntent(
                f"budget {self.name!r} reads each operation's cost from {self.cost}: it must "
                "be a number; nothing was written",
                field=self.cost,
            )
        if value < 0 or not math.isfinite(value):
            raise InvalidIntent(
                f"{self.cost} must be a finite number, not negative (budget {self.name!r})",
                field=self.cost,
            )
        return float(value)


def _positive(name: str, value: object) -> Iterator[str]:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        yield f"{name}: a positive number, not {value!r}"
    elif not math.isfinite(value):
        yield f"{name}: a finite number, not {value!r}"


@dataclass
class BudgetTable:
    """The budgets this process declared (its ``OUTBOX_CONFIG`` and :func:`~outbox.tools.budget`
    calls), which a worker publishes at start. ``enqueue`` enforces the published ones."""

    _budgets: dict[str, Budget] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def register(self, budget: Budget) -> Budget:
        """Add ``budget``; another declaration of its name raises :class:`ConfigError`."""
        with self._lock:
            existing = self._budgets.get(budget.name)
            if existing is not None and existing != budget:
                raise ConfigError(
                    f"budget {budget.name!r} is declared twice, differently", budget=budget.name
                )
            self._budgets[budget.name] = budget
        return budget

    def all(self) -> list[Budget]:
        """The declared budgets, by name."""
        return [self._budgets[name] for name in sorted(self._budgets)]

    def clear(self) -> None:
        """Forget every declaration (tests)."""
        with self._lock:
            self._budgets.clear()


def unknown_tools(budgets: Iterable[Budget], known: Iterable[str]) -> list[str]:
    """One problem per tool a budget names that is not in ``known``, naming the budget."""
    names = set(known)
    loaded = ", ".join(sorted(names)) or "none"
    return [
        f'budgets."{b.name}".tools: unknown tool {t!r} (loaded tools: {loaded})'
        for b in budgets
        for t in b.tools
        if t not in names
    ]


#: The process-wide table of declared budgets.
BUDGETS = BudgetTable()


def publish_budgets_committed(engine: Engine, budgets: Sequence[Budget]) -> int:
    """Write each budget to ``outbox.budgets`` (insert, or update a changed one) and commit.

    A budget no longer declared is left in force: a worker started without the file must not
    lift everyone's budgets (docs/budgets.md says how to remove one)."""
    with engine.begin() as conn:
        sql.budgets.upsert_budgets(conn, [_definition(b) for b in budgets])
    return len(budgets)


def _definition(budget: Budget) -> sql.budgets.BudgetDefinition:
    return sql.budgets.BudgetDefinition(
        name=budget.name,
        tools=list(budget.tools),
        counted_by=budget.by,
        window_s=float(budget.window_s),
        max_operations=budget.max_operations,
        cost_path=budget.cost,
        max_cost=None if budget.max_cost is None else float(budget.max_cost),
    )


def from_definition(row: sql.budgets.BudgetDefinition) -> Budget:
    """The :class:`Budget` a published row describes."""
    return Budget(
        name=row.name,
        tools=tuple(row.tools),
        by=row.counted_by,
        window_s=row.window_s,
        max_operations=row.max_operations,
        cost=row.cost_path,
        max_cost=row.max_cost,
    )


def usage(executor: Executor) -> list[BudgetUsage]:
    """Every published budget's keys with any use inside their window, by budget and key
    (the database clock). Reads in the caller's transaction and writes nothing."""
    return sql.budgets.usage(executor)


# --- enforcement (called by outbox.api) --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Demand:
    """What one intent asks of one budget key."""

    budget: Budget
    key: str
    cost: float


def demands(
    budgets: Sequence[Budget],
    *,
    requested_by: str | None,
    metadata: Mapping[str, Any],
    payload: Mapping[str, Any],
) -> list[Demand]:
    """What one intent asks of each of its tool's budgets."""
    return [Demand(b, b.key_of(requested_by, metadata), b.cost_of(payload)) for b in budgets]


def take_locks(executor: Executor, wanted: Iterable[Demand]) -> None:
    """Take the transaction-scoped lock of every (budget, key), in one order (no deadlock)."""
    keys = sorted({advisory_key(BUDGET_NAMESPACE, f"{d.budget.name}\x00{d.key}") for d in wanted})
    sql.budgets.lock_keys(executor, keys)


def check(executor: Executor, intents: Sequence[tuple[IntentKey | None, Sequence[Demand]]]) -> None:
    """Raise :class:`BudgetExceeded` for the first (budget, key) that the ``intents`` (their
    agents' intent keys and demands, in order) would take over its limit, counting the usage
    committed inside the window; call with the keys' locks held (:func:`take_locks`), in a
    statement after the lock's. An intent whose key is recorded already asks nothing: it
    will get its operation back, and is never refused nor counted twice."""
    all_demands = [d for _key, demands in intents for d in demands]
    pairs = sorted({(d.budget.name, d.key, d.budget.window_s) for d in all_demands})
    counted = sql.budgets.count_usage(
        executor,
        budgets=[p[0] for p in pairs],
        keys=[p[1] for p in pairs],
        windows=[p[2] for p in pairs],
        intent_keys=[key for key, _demands in intents if key is not None],
    )
    used = {(row.budget, row.key): row for row in counted.keys}
    wanted = [d for key, demands in intents if key not in counted.recorded for d in demands]
    asked: dict[tuple[str, str], tuple[int, float]] = {}
    for demand in wanted:
        b = demand.budget
        now = used.get((b.name, demand.key))
        count0, cost0 = (now.operations, now.cost) if now is not None else (0, 0.0)
        count, cost = asked.get((b.name, demand.key), (count0, cost0))
        if b.max_operations is not None and count + 1 > b.max_operations:
            raise _exceeded(demand, "operations", limit=b.max_operations, used=count, asked=1)
        if b.max_cost is not None and cost + demand.cost > b.max_cost:
            raise _exceeded(demand, "cost", limit=b.max_cost, used=cost, asked=demand.cost)
        asked[(b.name, demand.key)] = (count + 1, cost + demand.cost)


def _exceeded(
    demand: Demand, what: str, *, limit: float, used: float, asked: float
) -> BudgetExceeded:
    budget = demand.budget
    remaining = max(0, limit - used)
    key = demand.key or "(none)"
    return BudgetExceeded(
        f"budget {budget.name!r} exceeded for {budget.by} {key!r}: {_n(used)} of {_n(limit)} "
        f"{what} used in the last {_n(budget.window_s)}s, {_n(remaining)} left"
        + (f", {_n(asked)} asked" if what == "cost" else "")
        + "; nothing was written",
        budget=budget.name,
        key=demand.key,
        by=budget.by,
        window_s=budget.window_s,
        measure=what,
        limit=limit,
        used=used,
        remaining=remaining,
        asked=asked,
    )


def _n(value: float) -> str:
    return f"{value:g}"


def record_refusal_committed(executor: Executor, exc: BudgetExceeded) -> None:
    """Log a refusal and count it, with the ``budget_exhausted`` webhook once per key and
    window, in a transaction of its own on the caller's engine.

    Why not the caller's transaction: the refusal is raised in it and the caller will
    usually roll it back, taking the count and the webhook row with it. The own transaction
    touches only ``outbox.budget_alerts`` and the webhook table, no lock the caller holds.
    A failure there is logged and leaves the refusal as it is.
    """
    log.info(
        "enqueue refused: budget %r exceeded (%s)",
        exc.budget,
        exc.measure,
        extra={"action": Action.BUDGET_EXCEEDED, "budget": exc.budget},
    )
    engine = _engine_of(executor)
    if engine is None:
        return
    try:
        with engine.begin() as conn:
            first = sql.budgets.mark_exhausted(
                conn, budget=exc.budget, key=exc.key, window_s=exc.window_s
            )
            if first is not None:  # the first refusal of this key in a window
                webhooks.record_guard_event(
                    conn,
                    WebhookEvent.BUDGET_EXHAUSTED,
                    subject=subject(exc.budget, exc.key),
                    data=_alert(exc),
                    at=first,
                )
    except Exception as error:  # noqa: BLE001 -- the refusal stands whatever the alert does
        log.warning(
            "could not record budget %r as exhausted: %s",
            exc.budget,
            type(error).__name__,
            extra={"action": Action.BUDGET_ALERT_FAILED, "budget": exc.budget},
        )


def subject(budget: str, key: str) -> str:
    """What a ``budget_exhausted`` webhook is about: ``budget:<name>:<key>``."""
    return f"budget:{budget}:{key}"


def _alert(exc: BudgetExceeded) -> dict[str, Any]:
    """The ``data`` of a ``budget_exhausted`` webhook: the budget, the key and the counts."""
    return {
        "budget": exc.budget,
        "by": exc.by,
        "key": exc.key,
        "window_s": exc.window_s,
        "measure": exc.measure,
        "limit": exc.limit,
        "used": exc.used,
        "remaining": exc.remaining,
    }


def _engine_of(executor: Executor) -> Engine | None:
    """The engine behind the caller's session or connection (for a transaction of our own)."""
    if isinstance(executor, Connection):
        return executor.engine
    bind = executor.get_bind()
    return bind.engine if isinstance(bind, Connection | Engine) else None
