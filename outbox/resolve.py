"""Operator resolution: a person's verdict on an operation no component can decide.

An operation waits in ``unknown`` or ``needs_human`` when nothing automatic can tell whether
its effect exists at the remote. An operator who has found out (in the remote's own console,
by asking its owners) records the answer with :func:`resolve`: it applied (``confirmed``), it
did not and must not be sent again (``failed``), or it did not and may be sent again with the
same key and payload (back to ``planned``).

A verdict is written only under four safeguards (DESIGN.md, "Operator resolution"): the
operation's advisory lock, so no dispatcher, sweep or lookup is deciding at the same moment; a
compare-and-set on the attempt the operator saw; the payload hash the operator approved; and,
for "not applied", the tool's in-flight horizon, so a request from the last attempt cannot
still land after a person said it never would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any
from uuid import UUID

from outbox import sql, tracing, transitions
from outbox.api import _as_uuid
from outbox.approval import approve_command, reject_command
from outbox.contracts import CONTRACTS, ToolContract
from outbox.db import translated
from outbox.errors import (
    OperationBusy,
    OperationNotFound,
    ResolutionRefused,
    StaleResolution,
    StaleTransition,
)
from outbox.locks import operation_lock_key
from outbox.models import Executor, Operation
from outbox.states import Actor, State

#: The states an operator may resolve (DESIGN.md, "Allowed transitions": operator).
RESOLVABLE_STATES = frozenset({State.UNKNOWN, State.NEEDS_HUMAN})

# What to tell an operator who tries to resolve an operation in another state: one entry for
# every state outside RESOLVABLE_STATES (tests/integration/test_resolve.py checks each).
_TERMINAL = "it is terminal: nothing may move it again"
_NOT_RESOLVABLE_HINTS: Mapping[State, Callable[[Operation], str]] = {
    State.PLANNED: lambda _op: (
        "it is waiting to be sent; cancel it with `outbox ops cancel` if it must not be"
    ),
    State.SENT: lambda _op: "a dispatcher is sending it now; wait for its outcome",
    State.CONFIRMED: lambda _op: _TERMINAL,
    State.FAILED: lambda _op: _TERMINAL,
    State.CANCELLED: lambda _op: _TERMINAL,
    State.AWAITING_APPROVAL: lambda op: (
        "it waits for a person's approval and was never sent, so there is no outcome to "
        f"record: approve it with `{approve_command(op)}` or reject it with "
        f"`{reject_command(op)}` (over HTTP: POST /v1/operations/{op.id}/approve with its "
        "payload_hash, or /reject with a reason)"
    ),
}


@translated
def resolve(
    session: Executor,
    op_id: UUID | str,
    *,
    applied: bool,
    remote_ref: str | None = None,
    replay: bool = False,
    by: str,
    note: str,
    expect_attempts: int | None = None,
    payload_hash: str | None = None,
    force: bool = False,
) -> Operation:
    """Record an operator's verdict on an ``unknown`` or ``needs_human`` operation.

    ``applied=True`` with the remote's ``remote_ref`` → ``confirmed``. ``applied=False`` →
    ``failed`` (``maybe_applied`` cleared, ``note`` kept as ``last_error``); with
    ``replay=True`` → ``planned`` instead: the dispatcher sends the same payload again under
    the same operation id (the idempotency key), and ``maybe_applied`` is cleared. ``by``
    (who) and ``note`` (why) are required and go into the event, with ``force``.

    This function joins the transaction of ``session`` (a SQLAlchemy ``Session`` or
    ``Connection``) and does not begin, commit or roll back: the verdict exists if and only
    if the caller commits. It takes the operation's advisory lock as a transaction-scoped
    lock, held until the caller's transaction ends.

    Raises, writing nothing:

    - :class:`OperationBusy` when a dispatcher, the sweep, a lookup or another operator holds
      the operation's lock (try again);
    - :class:`OperationNotFound`;
    - :class:`StaleResolution` when ``expect_attempts`` is not the row's attempt number (a
      new attempt started since the operator looked), or the row moved meanwhile;
    - :class:`ResolutionRefused` when the operation is in another state, ``payload_hash`` is
      not the stored hash, an argument is missing or contradictory (``field`` names it), or
      ``applied`` is False and the tool's in-flight horizon has not passed since the last
      attempt was sent (``retry_after_s`` says how long to wait), unless ``force``.
    """
    operation_id = _as_uuid(op_id)
    _check_request(operation_id, applied=applied, remote_ref=remote_ref, replay=replay)
    _check_audit(operation_id, by=by, note=note)
    # Transaction-scoped: the lock lasts exactly as long as the uncommitted verdict and goes
    # with its commit or rollback, nothing for the caller to release; a dispatcher's or the
    # sweep's session lock on the same key makes it fail, and the other way round.
    if not sql.locks.try_xact_lock(session, operation_lock_key(operation_id)):
        raise _busy(session, operation_id)
    current = sql.intents.get_operation(session, operation_id)
    if current is None:
        raise OperationNotFound(f"no operation {operation_id}", operation_id=operation_id)
    _check_resolvable(current)
    _check_seen(current, expect_attempts, payload_hash)
    if not applied and not force:
        _check_horizon(session, current)
    verdict = _verdict(
        current,
        applied=applied,
        replay=replay,
        remote_ref=remote_ref,
        reason=f"resolved by {by}: {note}",
        note=note,
        detail={"by": by, "note": note, "forced": force, "applied": applied, "replay": replay},
    )
    try:
        resolved = transitions.apply(session, verdict).operation
    except StaleTransition as exc:
        # Under our lock only a writer that takes no lock can get here first; same answer.
        raise _stale(operation_id, current.attempts, exc.actual) from exc
    tracing.decision("outbox.resolve", resolved, by=by)
    return resolved


def waiting_reasons(executor: Executor, operation_ids: Iterable[UUID]) -> dict[UUID, str]:
    """Why each operation is where it is: the reason of the move into its current state.

    Events that changed no state (a late outcome, evidence that lost a race) are passed
    over, so a ``needs_human`` operation shows why it went to a human. Operations without
    such an event (none, in practice) are missing from the result.
    """
    ids = list(operation_ids)
    if not ids:
        return {}
    return sql.resolve.entry_reasons(executor, ids)


# --- checks --------------------------------------------------------------------------------


def _check_request(
    operation_id: UUID, *, applied: bool, remote_ref: str | None, replay: bool
) -> None:
    """Refuse a verdict that contradicts itself, naming the argument."""
    if applied and not (remote_ref or "").strip():
        raise ResolutionRefused(
            f"operation {operation_id}: resolving as applied needs the remote's reference to "
            "the effect (--remote-ref / remote_ref); nothing was changed",
            operation_id=operation_id,
            field="remote_ref",
        )
    if applied and replay:
        raise ResolutionRefused(
            f"operation {operation_id}: --replay / replay goes only with --not-applied: an "
            "applied operation is confirmed, never sent again; nothing was changed",
            operation_id=operation_id,
            field="replay",
        )
    if not applied and remote_ref is not None:
        raise ResolutionRefused(
            f"operation {operation_id}: --remote-ref / remote_ref goes only with --applied: an "
            "operation that did not apply has no effect at the remote; nothing was changed",
            operation_id=operation_id,
            field="remote_ref",
        )


def _check_audit(operation_id: UUID, *, by: str, note: str) -> None:
    """Refuse a verdict nobody signed or explained: the audit trail must say who and why."""
    for field, value, what in (("by", by, "who resolves it"), ("note", note, "why")):
        if not isinstance(value, str) or not value.strip():
            raise ResolutionRefused(
                f"operation {operation_id}: --{field} / {field} must say {what}, for the audit "
                "trail; nothing was changed",
                operation_id=operation_id,
                field=field,
            )


def _check_resolvable(current: Operation) -> None:
    if current.state not in RESOLVABLE_STATES:
        raise ResolutionRefused(
            f"operation {current.id} is {current.state.value} at attempt {current.attempts}; "
            f"only unknown or needs_human operations can be resolved "
            f"({_NOT_RESOLVABLE_HINTS[current.state](current)}); nothing was changed",
            operation_id=current.id,
        )


def _check_seen(current: Operation, expect_attempts: int | None, payload_hash: str | None) -> None:
    """The compare-and-set on what the operator looked at: the attempt, and the payload."""
    if expect_attempts is not None and expect_attempts != current.attempts:
        raise _stale(current.id, expect_attempts, (current.state, current.attempts))
    if payload_hash is not None and payload_hash.strip().lower() != current.payload_hash:
        raise ResolutionRefused(
            f"payload hash mismatch: you approved {payload_hash.strip()}, the operation's "
            f"payload is {current.payload_hash}; nothing was changed",
            operation_id=current.id,
            field="payload_hash",
        )


def _check_horizon(executor: Executor, current: Operation) -> None:
    """Refuse "not applied" while a request from the last attempt could still land."""
    contract = CONTRACTS.get(current.tool)
    horizon_s = (contract or ToolContract(name=current.tool)).inflight_horizon_s
    found = sql.resolve.horizon(executor, current.id, horizon_s)
    if found.passed:
        return
    source = (
        f"tool {current.tool!r}'s in-flight horizon ({horizon_s:g}s)"
        if contract is not None
        else f"the default in-flight horizon ({horizon_s:g}s; tool {current.tool!r} is not "
        "registered in this process: see OUTBOX_TOOLS and OUTBOX_CONFIG)"
    )
    raise ResolutionRefused(
        f"operation {current.id}: {source} has not passed since attempt {current.attempts} was "
        f"sent, so that request could still land at the remote; try again in "
        f"{max(1, round(found.remaining_s))}s, or pass --force / force=True if you know it cannot; "
        "nothing was changed",
        operation_id=current.id,
        retry_after_s=found.remaining_s,
    )


def _verdict(
    current: Operation,
    *,
    applied: bool,
    replay: bool,
    remote_ref: str | None,
    reason: str,
    note: str,
    detail: Mapping[str, Any],
) -> transitions.Move:
    """The operator's move: from where the row is now, at the attempt they saw."""
    op_id, state, attempt, actor = current.id, current.state, current.attempts, Actor.OPERATOR
    if applied:
        return transitions.confirm(
            op_id,
            from_state=state,
            actor=actor,
            attempt=attempt,
            reason=reason,
            detail=detail,
            remote_ref=(remote_ref or "").strip(),
        )
    if replay:
        # Same row, same key, same payload: only the state and bookkeeping move back.
        return transitions.replan(
            op_id,
            from_state=state,
            actor=actor,
            attempt=attempt,
            reason=reason,
            detail=detail,
            not_applied=True,
        )
    return transitions.fail(
        op_id,
        from_state=state,
        actor=actor,
        attempt=attempt,
        reason=reason,
        detail=detail,
        last_error=note,
    )


# --- errors --------------------------------------------------------------------------------


def _busy(executor: Executor, operation_id: UUID) -> OperationBusy:
    # Our connection did not get the lock, so it may read who holds it (None if just freed).
    holder = sql.locks.lock_holder_pid(executor, operation_lock_key(operation_id))
    by_whom = f" (PostgreSQL backend pid {holder})" if holder is not None else ""
    return OperationBusy(
        f"another component{by_whom} is working on operation {operation_id} right now; "
        "try again; nothing was changed",
        operation_id=operation_id,
        holder_pid=holder,
    )


def _stale(operation_id: UUID, seen_attempt: int, actual: tuple[object, int]) -> StaleResolution:
    state, attempt = actual
    now = state.value if isinstance(state, State) else str(state)
    if attempt > seen_attempt:
        moved = f"moved on to attempt {attempt} since the operator looked at attempt {seen_attempt}"
    elif attempt < seen_attempt:
        moved = f"is at attempt {attempt}, not at attempt {seen_attempt} as the operator said"
    else:
        moved = f"was moved at attempt {attempt} while the operator was deciding"
    return StaleResolution(
        f"operation {operation_id} {moved} (it is now {now}); nothing was changed: show it "
        f"again with `outbox ops show {operation_id}` and decide on what it says now",
        operation_id=operation_id,
        expected=(None, seen_attempt),
        actual=actual,
    )
