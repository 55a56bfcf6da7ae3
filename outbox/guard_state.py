"""The guards at work, against their state in PostgreSQL (:mod:`outbox.sql.guards`).

* :func:`admission` is what the dispatcher's `sent` move asks in its own statement
  (:func:`outbox.transitions.apply_admitted_and_commit`): the breaker, the concurrency cap (a
  count of ``sent`` rows under the key's transaction lock), then the rate (a GCRA step);
  :func:`refusal` turns a refusal into a :class:`Hold`, so a refused attempt takes no token.
* :func:`admit` is the same in the transaction of the ``sent`` commit, with the probe's
  claim, while a breaker is not closed. It returns ``None`` (send) or a :class:`Hold`; the
  caller rolls back, so a refused attempt takes no token and no probe.
* :func:`record_outcome_committed` counts an attempt's outcome against its breaker.
* :func:`report` and :func:`reset` are ``outbox guards list`` and ``outbox guards reset``.

Declarations and arithmetic are in :mod:`outbox.guards`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any
from uuid import UUID

from sqlalchemy import Connection

from outbox import webhooks
from outbox.contracts import ToolContract
from outbox.errors import ConfigError
from outbox.guards import (
    CLOSED_ROW,
    Breaker,
    BreakerRow,
    BreakerState,
    GuardKey,
    Verdict,
    next_breaker,
)
from outbox.logs import Action
from outbox.models import Executor, WebhookEvent, iso_utc
from outbox.sql import guards as sql

log = logging.getLogger(__name__)

#: The dispatcher's breakers; lookups have their own (``LOOKUP``), keyed the same.
DISPATCH = "dispatch"
LOOKUP = "lookup"
#: Slack on a probe's lease beyond its send deadline and timeout: past the lease a probe that
#: never reported (its worker killed) no longer blocks the next one.
PROBE_MARGIN_S = 5.0
#: How long an operation waits while another worker's probe is out: short, since a
#: successful probe lets the backlog through at once.
WAIT_FOR_PROBE_S = 1.0


@dataclass
class Observed:
    """What an admission saw that counting the attempt's outcome may reuse: a breaker that
    was quiet (closed, no failure counted) needs no read after a success."""

    breaker_quiet: bool = False


@dataclass(frozen=True)
class Hold:
    """Why an operation may not be sent now, and in how many seconds to try again."""

    guard: str  #: ``breaker``, ``concurrency`` or ``rate``
    key: GuardKey
    delay_s: float
    reason: str


def admission(contract: ToolContract, target: str) -> sql.Admission:
    """The guards ``contract`` declares, keyed for ``target``, as an admission asks them."""
    breaker, cap, rate = contract.breaker, contract.concurrency, contract.rate
    b_key = GuardKey.of(contract.name, target, breaker.per) if breaker else None
    c_key = GuardKey.of(contract.name, target, cap.per) if cap else None
    r_key = GuardKey.of(contract.name, target, rate.per) if rate else None
    return sql.Admission(
        breaker=(b_key.tool, b_key.target) if b_key else None,
        cap=(c_key.tool, c_key.target, cap.max_in_flight) if cap and c_key else None,
        rate=(r_key.tool, r_key.target, rate.interval_s, rate.burst) if rate and r_key else None,
    )


def breaker_refused(admitted: sql.Admitted) -> bool:
    """Whether the admission found the breaker not closed: only :func:`admit` (in a
    transaction with the move) may then claim its probe."""
    return admitted.breaker.state not in (None, BreakerState.CLOSED)


def refusal(
    contract: ToolContract, target: str, admitted: sql.Admitted, *, probe: bool = False
) -> Hold | None:
    """The :class:`Hold` for an admission's answer by the cap or the rate (``None``: send).
    ``probe``: the attempt is a breaker's probe, sent whatever the rate says (no token was
    taken)."""
    cap, rate = contract.concurrency, contract.rate
    in_flight = admitted.in_flight
    if cap is not None and (in_flight or 0) >= cap.max_in_flight:
        c_key = GuardKey.of(contract.name, target, cap.per)
        reason = (
            f"held: {in_flight} attempts of {c_key} in flight (max_in_flight {cap.max_in_flight})"
        )
        delay = cap.retry_s * (1 + random.random())  # noqa: S311 -- jitter
        return Hold("concurrency", c_key, delay, reason)
    if rate is not None and not admitted.token and not probe:
        r_key = GuardKey.of(contract.name, target, rate.per)
        reason = f"held: rate of {r_key} ({rate.per_second:g}/s) reached"
        return Hold("rate", r_key, max(admitted.wait_s, 0.001), reason)
    return None


def admit(
    conn: Executor,
    contract: ToolContract,
    *,
    operation_id: UUID,
    target: str,
    observed: Observed | None = None,
) -> Hold | None:
    """Whether an attempt of ``operation_id`` may be sent now, in the caller's transaction
    (the one that commits ``sent``; never commits). ``None``: send (a probe claimed, a token
    taken); else the :class:`Hold`: the caller rolls back and holds the operation.

    One statement (:func:`outbox.sql.guards.admit`: with a cap, the key's lock is held until
    the caller's transaction ends), and one more while a breaker is not closed (its probe's
    claim). The dispatcher asks this only when the breaker is not closed; otherwise the
    admission is part of the `sent` move's own statement
    (:func:`outbox.transitions.apply_admitted_and_commit`)."""
    admitted = sql.admit(conn, admission(contract, target))
    if observed is not None:
        observed.breaker_quiet = admitted.breaker_quiet
    probe = False
    if contract.breaker is not None and breaker_refused(admitted):
        key = GuardKey.of(contract.name, target, contract.breaker.per)
        held = _breaker_admits(conn, contract, key, admitted.breaker, operation_id, scope=DISPATCH)
        if held is not None:
            return held
        probe = True  # the one probe: sent whatever the rate says (no token was taken)
    return refusal(contract, target, admitted, probe=probe)


def _breaker_admits(
    conn: Executor,
    contract: ToolContract,
    key: GuardKey,
    seen: sql.BreakerSeen,
    operation_id: UUID,
    *,
    scope: str,
) -> Hold | None:
    """A breaker that is not closed: this attempt is its probe (one across every worker,
    once the open spell is over), or it is held."""
    probe_s = contract.send_deadline_s + contract.timeout_s + PROBE_MARGIN_S
    if sql.claim_probe(
        conn, scope, key.tool, key.target, operation_id=operation_id, probe_s=probe_s
    ):
        log.info(
            "breaker %s half-open: %s is its probe",
            key,
            operation_id,
            extra={"action": Action.GUARD_PROBE, "guard_key": str(key)},
        )
        return None
    if seen.state == BreakerState.OPEN and seen.open_until and seen.open_until > seen.now:
        wait = (seen.open_until - seen.now).total_seconds() + random.random()  # noqa: S311
        return Hold("breaker", key, wait, f"held: circuit of {key} open until {seen.open_until}")
    return Hold("breaker", key, WAIT_FOR_PROBE_S, f"held: circuit of {key} half-open, probe out")


def lookup_admit_committed(
    conn: Connection, contract: ToolContract, *, operation_id: UUID, target: str
) -> Hold | None:
    """Whether a lookup of ``operation_id`` may ask the remote now, by the tool's lookup
    breaker (keyed as its dispatch breaker, judged by inconclusive lookups); commits a
    probe's claim. ``None``: ask; else the :class:`Hold` (the check is deferred)."""
    breaker = contract.breaker
    if breaker is None:
        return None
    key = GuardKey.of(contract.name, target, breaker.per)
    with _transaction(conn):
        seen = sql.breaker_seen(conn, LOOKUP, key.tool, key.target)
        if seen is None or seen.state == BreakerState.CLOSED:
            return None
        return _breaker_admits(conn, contract, key, seen, operation_id, scope=LOOKUP)


def lookup_verdict(applied_or_declared: bool) -> Verdict:
    """A lookup that got an answer the tool declares (applied, not applied, failed) is a
    success; an inconclusive one (an error, an unexpected answer) a failure."""
    return Verdict.SUCCESS if applied_or_declared else Verdict.FAILURE


def verdict_of(outcome: str) -> Verdict:
    """How a dispatch outcome (``confirmed``, ``failed``, ``unknown``, ``replanned``,
    ``not_sent``) counts for a breaker: the remote answered, it did not, or it says nothing."""
    if outcome in ("confirmed", "failed"):
        return Verdict.SUCCESS
    if outcome in ("unknown", "replanned"):
        return Verdict.FAILURE
    return Verdict.NEUTRAL


@contextmanager
def _transaction(conn: Connection) -> Iterator[None]:
    """One real transaction on ``conn``, whether it is in AUTOCOMMIT mode (the dispatcher's
    lock connection) or not; AUTOCOMMIT is restored after."""
    autocommit = conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT"
    if not autocommit:
        with conn.begin():
            yield
        return
    conn.commit()
    conn.execution_options(isolation_level=conn.default_isolation_level)
    try:
        with conn.begin():
            yield
    finally:
        conn.execution_options(isolation_level="AUTOCOMMIT")


def record_outcome_committed(
    conn: Connection,
    breaker: Breaker,
    *,
    scope: str,
    key: GuardKey,
    verdict: Verdict,
    operation_id: UUID,
    quiet_at_admission: bool = False,
) -> BreakerState | None:
    """Count ``verdict`` against the breaker of ``key`` and commit; the state it moved into,
    or ``None`` if it stayed where it was. A success on a closed breaker with no failures
    and no ratio writes nothing: one indexed read, or none when the admission saw it so
    (``quiet_at_admission``; a failure counted by another worker meanwhile is then reset by
    the next success that reads it, not by this one)."""
    if verdict is Verdict.NEUTRAL:
        return None
    if (
        conn.in_transaction()
        and conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT"
    ):
        conn.commit()
    if verdict is Verdict.SUCCESS and breaker.ratio is None:
        if quiet_at_admission:
            return None
        quiet = sql.breaker_quiet(conn, scope, key.tool, key.target)
        if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
            conn.commit()
        if quiet:
            return None
    with _transaction(conn):
        read = sql.lock_breaker(conn, scope, key.tool, key.target)
        row = BreakerRow(
            BreakerState(read.state),
            read.failures,
            read.window_started_at,
            read.window_calls,
            read.window_failures,
            read.open_until,
            str(read.probe_operation_id) if read.probe_operation_id else None,
        )
        after = next_breaker(row, breaker, verdict, now=read.now, operation_id=str(operation_id))
        sql.write_breaker(
            conn,
            scope,
            key.tool,
            key.target,
            state=after.state.value,
            failures=after.failures,
            window_started_at=after.window_started_at,
            window_calls=after.window_calls,
            window_failures=after.window_failures,
            open_until=after.open_until,
            probe_operation_id=UUID(after.probe_operation_id) if after.probe_operation_id else None,
        )
        changed = _changed(row.state, after.state)
        if changed is not None:
            _announce(conn, scope, key, after, read.now)
    return changed


def _changed(before: BreakerState, after: BreakerState) -> BreakerState | None:
    if before is after:
        return None
    if after is BreakerState.OPEN and before is BreakerState.HALF_OPEN:
        return BreakerState.OPEN  # the probe failed: re-opened (no second "opened" webhook)
    return after


#: The log action of a breaker that opened (True) or closed (False).
_BREAKER_ACTIONS = {True: Action.GUARD_OPENED, False: Action.GUARD_CLOSED}


def _announce(conn: Executor, scope: str, key: GuardKey, row: BreakerRow, at: datetime) -> None:
    """Log a breaker that opened or closed, and write its ``circuit_opened`` /
    ``circuit_closed`` webhook in the same transaction (where subscribed)."""
    opened = row.state is BreakerState.OPEN
    log.warning(
        "%s circuit of %s %s",
        scope,
        key,
        "opened" if opened else "closed",
        extra={
            "action": _BREAKER_ACTIONS[opened],
            "guard_key": str(key),
            "scope": scope,
        },
    )
    data: dict[str, Any] = {"scope": scope, "tool": key.tool, "target": key.target or None}
    if opened:
        data |= {
            "failures": row.failures,
            "open_until": iso_utc(row.open_until) if row.open_until else None,
        }
    event = WebhookEvent.CIRCUIT_OPENED if opened else WebhookEvent.CIRCUIT_CLOSED
    webhooks.record_guard_event(conn, event, subject=str(key), data=data, at=at)


# --- the operator's view ----------------------------------------------------------------------


@dataclass(frozen=True)
class GuardStatus:
    """One declared guard key and its state, for ``outbox guards list``."""

    guard: str  #: ``breaker``, ``lookup_breaker``, ``rate`` or ``concurrency``
    key: str
    declared: dict[str, Any]
    state: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The JSON of one row of ``outbox guards list --json``."""
        return {
            "guard": self.guard,
            "key": self.key,
            "declared": self.declared,
            "state": self.state,
        }


def report(conn: Executor, contracts: list[ToolContract]) -> list[GuardStatus]:
    """Every declared guard of ``contracts`` with its stored state (keys per target: each
    target that has state, plus the declaration itself when none has)."""
    breakers = sql.list_breakers(conn)
    buckets = sql.list_buckets(conn)
    flights = sql.list_in_flight(conn)
    rows: list[GuardStatus] = []
    for contract in contracts:
        name = contract.name
        if (b := contract.breaker) is not None:
            declared = {"failures": b.failures, "open_s": b.open_s, "per": b.per, "ratio": b.ratio}
            for scope, guard in ((DISPATCH, "breaker"), (LOOKUP, "lookup_breaker")):
                found = [x for x in breakers if x.tool == name and x.scope == scope]
                rows += [
                    GuardStatus(guard, str(GuardKey(x.tool, x.target)), declared, _breaker_state(x))
                    for x in found
                ] or [GuardStatus(guard, _pattern(name, b.per), declared, {"state": "closed"})]
        if (r := contract.rate) is not None:
            declared = {"per_second": r.per_second, "burst": r.burst, "per": r.per}
            found_buckets = [x for x in buckets if x.tool == name]
            rows += [
                GuardStatus(
                    "rate",
                    str(GuardKey(x.tool, x.target)),
                    declared,
                    _bucket_state(x.tat_ahead_s, r.interval_s, r.burst),
                )
                for x in found_buckets
            ] or [
                GuardStatus(
                    "rate", _pattern(name, r.per), declared, {"next_slot_s": 0.0, "tokens": r.burst}
                )
            ]
        if (c := contract.concurrency) is not None:
            declared = {"max_in_flight": c.max_in_flight, "per": c.per}
            mine = [x for x in flights if x.tool == name]
            if c.per == "tool":
                total = sum(x.in_flight for x in mine)
                rows.append(GuardStatus("concurrency", name, declared, {"in_flight": total}))
            else:
                rows += [
                    GuardStatus(
                        "concurrency",
                        str(GuardKey(x.tool, x.target)),
                        declared,
                        {"in_flight": x.in_flight},
                    )
                    for x in mine
                ] or [GuardStatus("concurrency", _pattern(name, c.per), declared, {"in_flight": 0})]
    return rows


def _pattern(tool: str, per: str) -> str:
    return f"{tool}:*" if per == "target" else tool


def _breaker_state(row: sql.BreakerListed) -> dict[str, Any]:
    return {
        "state": row.state,
        "failures": row.failures,
        "opened_at": row.opened_at.isoformat() if row.opened_at else None,
        "open_until": row.open_until.isoformat() if row.open_until else None,
        "probe_operation_id": str(row.probe_operation_id) if row.probe_operation_id else None,
    }


def _bucket_state(tat_ahead_s: float, interval_s: float, burst: int) -> dict[str, Any]:
    """Tokens left now, and seconds to the next slot, from how far the bucket's theoretical
    arrival time is ahead of the database's now."""
    tokens = max(0, burst - int(-(-tat_ahead_s // interval_s)))
    next_slot = max(0.0, tat_ahead_s - (burst - 1) * interval_s)
    return {"tokens": tokens, "next_slot_s": round(next_slot, 3)}


@dataclass(frozen=True)
class ResetDone:
    """What ``outbox guards reset`` did."""

    key: str
    guards: list[str]
    at: datetime | None


def reset(
    conn: Connection, key_text: str, *, by: str, note: str, contracts: list[ToolContract]
) -> ResetDone:
    """Close the breakers of ``key_text`` (both scopes) and clear its bucket, with a row of
    ``outbox.guard_resets`` per guard naming who and why; commits. Raises ConfigError when
    no guard of a known tool has that key."""
    key = GuardKey.parse(key_text)
    known = {c.name for c in contracts if c.breaker is not None or c.rate is not None}
    if key.tool not in known:
        raise ConfigError(f"no breaker or rate limit is declared for tool {key.tool!r}")
    done: list[str] = []
    at: datetime | None = None
    with _transaction(conn):
        for scope, guard in ((DISPATCH, "breaker"), (LOOKUP, "lookup_breaker")):
            seen = sql.breaker_seen(conn, scope, key.tool, key.target)
            closed_at = sql.close_breaker(conn, scope, key.tool, key.target)
            if closed_at is not None:
                done.append(guard)
                if seen is not None and seen.state != BreakerState.CLOSED:
                    _announce(conn, scope, key, CLOSED_ROW, closed_at)
        if sql.clear_bucket(conn, key.tool, key.target):
            done.append("rate")
        for guard in done or ["breaker"]:
            at = sql.record_reset(
                conn, guard=guard, tool=key.tool, target=key.target, reset_by=by, note=note
            )
    log.warning(
        "guards of %s reset by %s: %s",
        key,
        by,
        ", ".join(done) or "nothing was stored",
        extra={"action": Action.GUARD_RESET, "guard_key": str(key)},
    )
    return ResetDone(str(key), done, at)
