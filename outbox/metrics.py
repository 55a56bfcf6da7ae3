"""Prometheus metrics read from the outbox's own tables, on each scrape (docs/metrics.md).

:class:`OutboxCollector` is a custom prometheus_client collector, registered on its own
:class:`~prometheus_client.CollectorRegistry` (never the process-wide one, so importing this
module exports nothing by itself). Each scrape runs one short read-only transaction with a
``statement_timeout``; every age is computed from the database's clock, never the host's.

Two kinds of numbers:

* **Gauges read from the tables** on every scrape: operations by state and tool, the oldest
  wait per live state, webhook deliveries by status. They are right whenever the exporter
  started, and several exporters agree.
* **Counters folded from** ``outbox.events``: transitions, escalations, and the dispatch latency
  histogram. The collector keeps a cursor on ``events.id`` and each scrape folds only the events
  committed since the last one (at most ``event_batch`` of them, so a scrape stays short after
  a burst; the rest wait for the next scrape). The cursor starts at the newest event when the
  exporter starts, so the counters count *since the exporter started*; Prometheus' ``rate()``
  and ``increase()`` handle the reset a restart causes.

Identity values are handed out when a row is inserted, not when it commits: a transaction
holding event 10 may commit after event 11 was folded. An id the cursor passed without seeing
is remembered as a *gap* and looked up again on later scrapes until it appears or
``gap_grace_s`` passes (an id can stay missing for good: a rolled-back transaction leaves
one). So a slow transaction's events are counted late, not lost.

If the database cannot be reached the scrape still answers, with ``outbox_database_up 0``
and the counters folded so far; the exporter never dies of a database error.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError

from outbox import sql
from outbox.logs import Action
from outbox.models import DeliveryStatus
from outbox.saga_rules import SagaState
from outbox.sql.budgets import BudgetTotals
from outbox.states import ALLOWED, Actor, State

log = logging.getLogger(__name__)

#: The port ``outbox metrics`` listens on by default (the OpenTelemetry Prometheus exporter's).
DEFAULT_PORT = 9464
DEFAULT_HOST = "127.0.0.1"

#: Upper bounds (seconds) of the dispatch latency buckets: a fast remote call up to a
#: dispatcher held past OUTBOX_SENT_MAX_AGE (an hour by default).
DISPATCH_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1800.0, 3600.0,
)  # fmt: skip

#: Label value of ``from_state`` for the event recording an enqueue (it has no previous state).
NO_STATE = "none"

#: The live states whose oldest wait is exported: how long the oldest operation in that state
#: has waited for whoever moves it on, measured from the column that says since when.
#:
#: * ``planned``: ``available_at``, due since (a row backing off is not waiting yet); waits
#:   for the relay to publish it and a dispatcher to take it. Partial index: one probe.
#: * ``sent``: ``sent_at``; waits for its dispatcher's outcome (or the sweep, past
#:   OUTBOX_SENT_TIMEOUT). Partial index: one probe.
#: * ``unknown``: ``updated_at``, in the state since (a check leaves it alone); waits for the
#:   reconciler. Read through the partial index on ``next_check_at``: every unknown row.
#: * ``needs_human``: ``updated_at``, in the queue since; waits for a person. Partial index.
#: * ``awaiting_approval``: ``updated_at``, waiting for an approval since. Read through the
#:   partial index on ``approval_expires_at``: every row awaiting approval.
OLDEST_STATES = (
    State.PLANNED,
    State.SENT,
    State.UNKNOWN,
    State.NEEDS_HUMAN,
    State.AWAITING_APPROVAL,
)

#: The decisions on an approval, by the move out of ``awaiting_approval`` that records each.
_DECISIONS = {
    (State.PLANNED.value, Actor.OPERATOR.value): "approved",
    (State.CANCELLED.value, Actor.OPERATOR.value): "rejected",
    (State.CANCELLED.value, Actor.SWEEP.value): "expired",
}


@dataclass
class _Histogram:
    """One label set of a histogram: per-bucket (not cumulative) counts and the sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(DISPATCH_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(DISPATCH_BUCKETS, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        bounds = [*(repr(bound) for bound in DISPATCH_BUCKETS), "+Inf"]
        cumulative, running = [], 0
        for bound, count in zip(bounds, self.counts, strict=True):
            running += count
            cumulative.append((bound, float(running)))
        return cumulative


@dataclass
class _Snapshot:
    """What one scrape read from the tables (``None``: that part could not be read)."""

    operations: list[tuple[str, str, int]] | None = None
    oldest: dict[State, float] | None = None
    check_overdue: float | None = None
    webhooks: dict[str, tuple[int, int]] | None = None
    events_behind: int | None = None
    budgets: list[BudgetTotals] | None = None
    #: The guards' stored state (docs/guards.md).
    breakers: list[sql.guards.BreakerListed] | None = None
    buckets: list[sql.guards.BucketListed] | None = None
    in_flight: list[sql.guards.InFlight] | None = None
    #: Sagas by state (docs/sagas.md).
    sagas: dict[str, int] | None = None


#: ``outbox_guard_breaker_state``'s value per breaker state.
BREAKER_STATE_VALUES = {"closed": 0.0, "open": 1.0, "half_open": 2.0}


class OutboxCollector:
    """Reads the outbox's metrics from the database on each ``collect()`` (one scrape).

    Thread-safe: prometheus_client's HTTP server answers each request in its own thread, so
    scrapes are serialised by a lock (a scrape is a few index probes and one table scan).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        event_batch: int = 50_000,
        statement_timeout_s: float = 5.0,
        gap_grace_s: float = 600.0,
        max_gaps: int = 10_000,
        unknown_operations: UnknownOperationListener | None = None,
    ) -> None:
        if event_batch < 1 or max_gaps < 0 or statement_timeout_s <= 0 or gap_grace_s < 0:
            raise ValueError("event_batch must be >= 1, the timeout > 0, the gap limits >= 0")
        self.engine = engine
        self.event_batch = event_batch
        self.statement_timeout_s = statement_timeout_s
        self.gap_grace_s = gap_grace_s
        self.max_gaps = max_gaps
        #: The workers' reports of messages for operations not in this database (None: not
        #: counted by this collector).
        self.unknown_operations = unknown_operations
        self._lock = threading.Lock()
        #: The highest event id folded; ``None`` until the database first answered.
        self._cursor: int | None = None
        #: Event ids the cursor passed without seeing, with when they were first missed
        #: (``time.monotonic()``); insertion order is age order.
        self._gaps: dict[int, float] = {}
        self._transitions: Counter[tuple[str, str, str]] = Counter(
            {
                (NO_STATE, State.PLANNED.value, "agent"): 0,
                (NO_STATE, State.AWAITING_APPROVAL.value, "agent"): 0,
            }
            | {
                (from_state.value, to_state.value, actor.value): 0
                for (from_state, to_state), actors in ALLOWED.items()
                for actor in actors
            }
        )
        self._escalations = 0
        self._decisions: Counter[str] = Counter(dict.fromkeys(_DECISIONS.values(), 0))
        self._dispatch: dict[tuple[str, str], _Histogram] = {
            (to_state.value, actor.value): _Histogram()
            for (from_state, to_state), actors in ALLOWED.items()
            if from_state is State.SENT
            for actor in actors
        }

    # --- the incremental part -----------------------------------------------------------

    def baseline(self) -> bool:
        """Start counting from the newest committed event, if not started yet.

        Called when the exporter starts; if the database does not answer then, the first
        scrape that reaches it starts the count instead. Returns whether a cursor is set.
        """
        with self._lock:
            if self._cursor is None:
                try:
                    with self.engine.connect() as conn:
                        self._cursor = sql.metrics.newest_event_id(conn)
                except Exception as exc:  # noqa: BLE001 -- the exporter outlives any outage
                    log.warning(
                        "cannot read the newest event yet: %s",
                        _first_line(exc),
                        extra={"action": Action.METRICS_BASELINE_FAILED},
                    )
            return self._cursor is not None

    def _fold_new_events(self, conn: Connection) -> int:
        """Fold the events committed since the last scrape; how many are left for later."""
        if self._cursor is None:
            self._cursor = sql.metrics.newest_event_id(conn)
            return 0
        cursor = self._cursor
        rows = sql.metrics.new_events(
            conn, cursor=cursor, batch=self.event_batch, gaps=list(self._gaps)
        )
        now = time.monotonic()
        expected = cursor + 1
        for row in rows:
            if row.id <= cursor:
                self._gaps.pop(row.id, None)
            else:
                if row.id > expected:
                    self._remember_gaps(expected, row.id, now)
                expected = row.id + 1
            self._count(row)
        self._cursor = expected - 1
        while self._gaps and now - next(iter(self._gaps.values())) > self.gap_grace_s:
            del self._gaps[next(iter(self._gaps))]
        newest = sql.metrics.newest_event_id(conn)
        if newest < self._cursor:
            # The newest events are gone (the table was emptied or restored from a backup):
            # count from what is there now, or nothing would be counted until ids caught up.
            log.warning(
                "outbox.events ends at id %d, before the exporter's cursor %d: counting from it",
                newest,
                self._cursor,
                extra={"action": Action.METRICS_CURSOR_RESET},
            )
            self._cursor = newest
            self._gaps.clear()
        return newest - self._cursor

    def _remember_gaps(self, start: int, stop: int, now: float) -> None:
        for missing in range(max(start, stop - self.max_gaps), stop):
            self._gaps[missing] = now
        while len(self._gaps) > self.max_gaps:
            del self._gaps[next(iter(self._gaps))]

    def _count(self, row: sql.metrics.NewEvent) -> None:
        if row.from_state == row.to_state:
            return  # a note that changed no state (a late outcome, evidence that lost a race)
        from_state = row.from_state if row.from_state is not None else NO_STATE
        self._transitions[(from_state, row.to_state, row.actor)] += 1
        if row.to_state == State.NEEDS_HUMAN.value:
            self._escalations += 1
        if from_state == State.AWAITING_APPROVAL.value:
            decision = _DECISIONS.get((row.to_state, row.actor))
            if decision is not None:
                self._decisions[decision] += 1
        if row.dispatch_s is not None:
            histogram = self._dispatch.setdefault((row.to_state, row.actor), _Histogram())
            histogram.observe(max(0.0, float(row.dispatch_s)))

    # --- one scrape -----------------------------------------------------------------------

    def _read(self, conn: Connection, snapshot: _Snapshot) -> None:
        """Fill ``snapshot`` in one read-only transaction, the cheap reads first."""
        with conn.begin():
            sql.metrics.set_read_only(conn)
            sql.metrics.set_scrape_limits(conn, statement_timeout_s=self.statement_timeout_s)
            snapshot.events_behind = self._fold_new_events(conn)
            oldest = sql.metrics.oldest_waits(conn)
            snapshot.oldest = {
                state: _age(oldest.now, oldest.since[state]) for state in OLDEST_STATES
            }
            snapshot.check_overdue = _age(oldest.now, oldest.check_due)
            snapshot.webhooks = {
                status: (count.n, count.tried)
                for status, count in sql.metrics.webhook_counts(conn).items()
            }
            # Per budget, never per key: keys (requesters, conversations) are unbounded.
            snapshot.budgets = sql.budgets.totals(conn)
            snapshot.breakers = sql.guards.list_breakers(conn)
            snapshot.buckets = sql.guards.list_buckets(conn)
            snapshot.in_flight = sql.guards.list_in_flight(conn)
            snapshot.sagas = sql.sagas.count_by_state(conn)
            # Last: the only read that scans a whole table, so its timeout loses nothing else.
            snapshot.operations = [
                (count.state, count.tool, count.n) for count in sql.metrics.operation_counts(conn)
            ]

    def _scrape(self) -> tuple[_Snapshot, bool]:
        """Read everything it can; (what was read, whether the database was reachable)."""
        snapshot = _Snapshot()
        try:
            conn = self.engine.connect()
        except Exception as exc:  # noqa: BLE001 -- an unreachable database is a metric
            _log_failure(exc)
            return snapshot, False
        with conn:
            try:
                self._read(conn, snapshot)
            except DBAPIError as exc:
                _log_failure(exc)
                return snapshot, not exc.connection_invalidated
            except Exception as exc:  # noqa: BLE001 -- a scrape answers whatever fails
                _log_failure(exc)
        return snapshot, True

    def collect(self) -> Iterator[Metric]:
        """One scrape: read the tables, fold new events, yield every family."""
        with self._lock:
            started = time.perf_counter()
            snapshot, reachable = self._scrape()
            elapsed = time.perf_counter() - started
            complete = snapshot.operations is not None
            families = _families()
            families["database_up"].add_metric([], 1.0 if reachable else 0.0)
            families["scrape_error"].add_metric([], 0.0 if complete else 1.0)
            families["scrape_duration"].add_metric([], elapsed)
            self._add_counters(families)
            _add_snapshot(families, snapshot)
        yield from families.values()

    def describe(self) -> Iterable[Metric]:
        """The families this collector yields, without samples (no database access)."""
        return list(_families().values())

    def _add_counters(self, families: dict[str, Any]) -> None:
        for move, count in sorted(self._transitions.items()):
            families["transitions"].add_metric(list(move), float(count))
        families["escalations"].add_metric([], float(self._escalations))
        for decision, count in sorted(self._decisions.items()):
            families["approvals"].add_metric([decision], float(count))
        if self.unknown_operations is not None:
            for task, count in sorted(self.unknown_operations.counts().items()):
                families["unknown_operations"].add_metric([task], float(count))
        for outcome in sorted(self._dispatch):
            histogram = self._dispatch[outcome]
            families["dispatch"].add_metric(list(outcome), histogram.buckets(), histogram.total)


def _families() -> dict[str, Any]:
    return {
        "database_up": GaugeMetricFamily(
            "outbox_database_up", "1 if this scrape reached the database, else 0."
        ),
        "scrape_error": GaugeMetricFamily(
            "outbox_scrape_error",
            "1 if this scrape could not read every table metric (see the exporter's log).",
        ),
        "scrape_duration": GaugeMetricFamily(
            "outbox_scrape_duration_seconds", "How long this scrape's database reads took."
        ),
        "operations": GaugeMetricFamily(
            "outbox_operations",
            "Operations in the table, by state and tool (a GROUP BY over the whole table).",
            labels=["state", "tool"],
        ),
        "oldest": GaugeMetricFamily(
            "outbox_oldest_age_seconds",
            "How long the oldest operation in a live state has waited in it (planned: "
            "since it was due; sent: since sent_at; unknown, needs_human: since it entered "
            "the state); 0 when there is none.",
            labels=["state"],
        ),
        "check_overdue": GaugeMetricFamily(
            "outbox_check_overdue_seconds",
            "How late the most overdue reconciler check of an unknown operation is; 0 when "
            "none is due.",
        ),
        "transitions": CounterMetricFamily(
            "outbox_transitions",
            "State changes recorded in outbox.events since the exporter started.",
            labels=["from_state", "to_state", "actor"],
        ),
        "escalations": CounterMetricFamily(
            "outbox_escalations",
            "Moves into needs_human since the exporter started.",
        ),
        "approvals": CounterMetricFamily(
            "outbox_approval_decisions",
            "Decisions on operations awaiting approval since the exporter started: approved, "
            "rejected (by an operator) or expired (cancelled by the sweep past the TTL).",
            labels=["decision"],
        ),
        "unknown_operations": CounterMetricFamily(
            "outbox_unknown_operation_messages",
            "Messages naming an operation this database does not have (another deployment's, "
            "through a broker queue both consume, or a pruned operation's), dropped by the "
            "workers, by task; reported while the exporter listened.",
            labels=["task"],
        ),
        "dispatch": HistogramMetricFamily(
            "outbox_dispatch_seconds",
            "Time from an attempt's move into sent to the move out of it, by the state it "
            "moved to and who moved it, for moves since the exporter started.",
            labels=["to_state", "actor"],
        ),
        "sagas": GaugeMetricFamily(
            "outbox_sagas",
            "Sagas by state (running, compensating, completed, compensated, needs_human, "
            "cancelled).",
            labels=["state"],
        ),
        "webhooks": GaugeMetricFamily(
            "outbox_webhook_deliveries",
            "Escalation webhook deliveries in the table, by status.",
            labels=["status"],
        ),
        "webhooks_retrying": GaugeMetricFamily(
            "outbox_webhook_deliveries_retrying",
            "Pending webhook deliveries that failed at least once and wait for a retry.",
        ),
        "budget_operations": GaugeMetricFamily(
            "outbox_budget_operations",
            "Operations counted by each budget inside its window, all keys together "
            "(cancelled ones left out).",
            labels=["budget"],
        ),
        "budget_cost": GaugeMetricFamily(
            "outbox_budget_cost",
            "Cost counted by each cost budget inside its window, all keys together.",
            labels=["budget"],
        ),
        "budget_keys": GaugeMetricFamily(
            "outbox_budget_keys",
            "Keys (requesters, conversations...) with any use of each budget inside its window.",
            labels=["budget"],
        ),
        "budget_fullest": GaugeMetricFamily(
            "outbox_budget_fullest_ratio",
            "The largest share of a limit any one key of each budget has used in its window "
            "(1: some key is exhausted).",
            labels=["budget"],
        ),
        "budget_refusals": CounterMetricFamily(
            "outbox_budget_refusals",
            "Enqueues each budget refused (BudgetExceeded), as recorded in the database.",
            labels=["budget"],
        ),
        "breaker_state": GaugeMetricFamily(
            "outbox_guard_breaker_state",
            "A circuit breaker's state: 0 closed, 1 open, 2 half-open (one probe out), by "
            "scope (dispatch, lookup) and key (tool or tool:target); a key appears once it "
            "has counted a failure.",
            labels=["scope", "key"],
        ),
        "rate_ahead": GaugeMetricFamily(
            "outbox_guard_rate_ahead_seconds",
            "How far a rate limit's bucket (GCRA theoretical arrival time) is ahead of now: "
            "0 when its whole burst is free; past (burst - 1) / per_second sends are held.",
            labels=["key"],
        ),
        "in_flight": GaugeMetricFamily(
            "outbox_guard_in_flight",
            "Attempts in sent now, by tool and target (what a concurrency cap counts).",
            labels=["tool", "target"],
        ),
        "events_behind": GaugeMetricFamily(
            "outbox_exporter_events_behind",
            "Events committed but not yet folded into the counters (a burst beyond one batch).",
        ),
    }


def _add_guards(families: dict[str, Any], snapshot: _Snapshot) -> None:
    for breaker in snapshot.breakers or []:
        key = f"{breaker.tool}:{breaker.target}" if breaker.target else breaker.tool
        value = BREAKER_STATE_VALUES.get(breaker.state, -1.0)
        families["breaker_state"].add_metric([breaker.scope, key], value)
    for bucket in snapshot.buckets or []:
        key = f"{bucket.tool}:{bucket.target}" if bucket.target else bucket.tool
        families["rate_ahead"].add_metric([key], bucket.tat_ahead_s)
    for flight in snapshot.in_flight or []:
        families["in_flight"].add_metric([flight.tool, flight.target], float(flight.in_flight))


def _add_snapshot(families: dict[str, Any], snapshot: _Snapshot) -> None:
    _add_guards(families, snapshot)
    if snapshot.events_behind is not None:
        families["events_behind"].add_metric([], float(snapshot.events_behind))
    for budget in snapshot.budgets or []:
        families["budget_operations"].add_metric([budget.budget], float(budget.operations))
        families["budget_cost"].add_metric([budget.budget], budget.cost)
        families["budget_keys"].add_metric([budget.budget], float(budget.keys))
        families["budget_fullest"].add_metric([budget.budget], budget.fullest)
        families["budget_refusals"].add_metric([budget.budget], float(budget.refusals))
    if snapshot.operations is not None:
        counts = {(state, tool): n for state, tool, n in snapshot.operations}
        # Every state for every tool present, so a state that empties reads 0, not absent.
        for tool in sorted({tool for _state, tool in counts}):
            for state in State:
                value = float(counts.get((state.value, tool), 0))
                families["operations"].add_metric([state.value, tool], value)
    if snapshot.sagas is not None:
        # Every state, so a state that empties reads 0, not absent.
        for saga_state in SagaState:
            count = float(snapshot.sagas.get(saga_state.value, 0))
            families["sagas"].add_metric([saga_state.value], count)
    if snapshot.oldest is not None:
        for state, age in snapshot.oldest.items():
            families["oldest"].add_metric([state.value], age)
    if snapshot.check_overdue is not None:
        families["check_overdue"].add_metric([], snapshot.check_overdue)
    if snapshot.webhooks is not None:
        for status in DeliveryStatus:
            count, _tried = snapshot.webhooks.get(status.value, (0, 0))
            families["webhooks"].add_metric([status.value], float(count))
        retrying = snapshot.webhooks.get(DeliveryStatus.PENDING.value, (0, 0))[1]
        families["webhooks_retrying"].add_metric([], float(retrying))


def _age(now: datetime, since: datetime | None) -> float:
    """Seconds from ``since`` to ``now`` (both the database's clock); 0 if none or ahead."""
    if since is None:
        return 0.0
    return max(0.0, (now - since).total_seconds())


def _first_line(exc: BaseException) -> str:
    text_ = str(getattr(exc, "orig", None) or exc).strip()
    return text_.splitlines()[0] if text_ else type(exc).__name__


def _log_failure(exc: BaseException) -> None:
    log.warning(
        "metrics scrape failed: %s",
        _first_line(exc),
        extra={"action": Action.METRICS_SCRAPE_FAILED, "error": type(exc).__name__},
    )


# --- the workers' reports -----------------------------------------------------------------


class UnknownOperationListener:
    """Counts the workers' reports of a message naming an operation this database does not
    have (``NOTIFY outbox_unknown_operation``), on a connection of its own, in a thread.

    No table keeps them (the operation is not here to hang an event on), so the count is of
    the reports made while this exporter listened: like the event counters it starts at 0
    with the exporter, and it misses reports made while it was down or reconnecting (the
    workers' log lines, action ``dispatch_unknown_operation`` / ``lookup_unknown_operation``,
    are the full record). Every listening exporter receives every report.
    """

    #: The tasks that report; any other payload is counted as ``other``.
    TASKS = ("dispatch", "lookup")

    def __init__(self, engine: Engine, *, poll_s: float = 0.5, retry_s: float = 5.0) -> None:
        self.engine = engine
        self.poll_s = poll_s
        self.retry_s = retry_s
        #: Set while the connection LISTENs (reports from then on are counted).
        self.listening = threading.Event()
        self._counts: Counter[str] = Counter(dict.fromkeys(self.TASKS, 0))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="outbox-metrics-unknown-operations", daemon=True
        )

    def start(self) -> None:
        """Start listening in the background (reconnecting after any failure)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop listening and wait for the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def counts(self) -> dict[str, int]:
        """Reports received so far, by task."""
        with self._lock:
            return dict(self._counts)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._listen()
            except Exception as exc:  # noqa: BLE001 -- the exporter outlives any outage
                log.warning(
                    "cannot listen for unknown-operation reports: %s",
                    _first_line(exc),
                    extra={"action": Action.METRICS_LISTEN_FAILED},
                )
            self.listening.clear()
            self._stop.wait(self.retry_s)

    def _listen(self) -> None:
        conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            sql.notify.listen_unknown_operations(conn)
            driver = conn.connection.driver_connection
            self.listening.set()
            log.info(
                "counting unknown-operation reports",
                extra={
                    "action": Action.METRICS_LISTENING,
                    "channel": sql.notify.UNKNOWN_OPERATION_CHANNEL,
                },
            )
            while not self._stop.is_set():
                for notify in driver.notifies(timeout=self.poll_s):  # type: ignore[union-attr]
                    # A pooled connection may still hold another channel's notification
                    # (a waiter's, received before its UNLISTEN): not a report.
                    if notify.channel != sql.notify.UNKNOWN_OPERATION_CHANNEL:
                        continue
                    task = notify.payload if notify.payload in self.TASKS else "other"
                    with self._lock:
                        self._counts[task] += 1
        finally:
            # Never back to the pool: a pooled session still listening would queue every
            # report until some scrape happened to read on it.
            conn.invalidate()
            conn.close()


# --- serving ------------------------------------------------------------------------------


@dataclass
class MetricsServer:
    """A running metrics endpoint (prometheus_client's threaded WSGI server)."""

    collector: OutboxCollector
    listener: UnknownOperationListener
    registry: CollectorRegistry
    server: WSGIServer
    thread: threading.Thread

    @property
    def host(self) -> str:
        """The address it listens on."""
        return str(self.server.server_address[0])

    @property
    def port(self) -> int:
        """The port it listens on (the real one when asked for port 0)."""
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        """Where Prometheus scrapes it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def shutdown(self) -> None:
        """Stop serving, close the socket and wait for the serving thread."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
        self.listener.stop()


def serve_metrics(
    engine: Engine,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    **collector_options: Any,
) -> MetricsServer:
    """Serve the outbox's metrics on ``http://host:port/metrics`` from a background thread.

    Starts counting events now (or at the first scrape that reaches the database). Returns
    the handle; call ``shutdown()`` to stop. Raises ``OSError`` if the port cannot be bound.
    """
    listener = UnknownOperationListener(engine)
    collector = OutboxCollector(engine, unknown_operations=listener, **collector_options)
    collector.baseline()
    registry = CollectorRegistry()
    registry.register(collector)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError:
        listener.stop()
        raise
    listener.start()
    return MetricsServer(
        collector=collector, listener=listener, registry=registry, server=server, thread=thread
    )
