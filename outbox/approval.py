"""Approval before send: a person's word on an operation before any request leaves.

A tool that declares ``approval = "required"`` (or a call to ``enqueue`` with
``require_approval=True``) creates its operation in ``awaiting_approval``: the relay never
publishes it and the database refuses to let it be sent without an approval of its stored
payload (``ck_operations_approval_before_send``). An operator approves it with :func:`approve`
(→ ``planned``, due at once), bound to the payload hash they saw, or refuses it with
:func:`reject` (→ ``cancelled``); nobody deciding within the tool's ``approval_ttl_s``, the
sweep cancels it (``approval expired``; :func:`expire_due_and_commit`).

Because an agent process usually loads no tools, each tool's policy reaches ``enqueue``
through ``outbox.tool_policies``, written by every process that loads the tools
(:func:`publish_policies_committed`); ``enqueue`` reads it in its INSERT.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

from sqlalchemy import Connection, Engine

from outbox import sql, tracing, transitions
from outbox.api import _as_uuid
from outbox.contracts import ToolContract
from outbox.db import translated
from outbox.errors import (
    AlreadyDecided,
    ApprovalMismatch,
    ApprovalRefused,
    OperationNotFound,
    StaleTransition,
)
from outbox.models import Executor, Operation, iso_utc
from outbox.sql.approval import ToolPolicy
from outbox.states import State
from outbox.transitions import Moved

__all__ = [
    "ExpiryResult",
    "approve",
    "approve_command",
    "expire_due_and_commit",
    "publish_policies_committed",
    "reject",
    "reject_command",
]


@translated
def approve(
    session: Executor,
    op_id: UUID | str,
    *,
    by: str,
    payload_hash: str,
    note: str | None = None,
) -> Operation:
    """Approve an ``awaiting_approval`` operation: it moves to ``planned``, due at once.

    ``payload_hash`` must be the operation's stored payload hash (the approver saw exactly
    this payload); ``by`` (who) is required and is recorded with the time, in the row and in
    its event, with ``note``. An approval is single-use: the operation leaves
    ``awaiting_approval`` and cannot be approved again.

    This function joins the transaction of ``session`` (a SQLAlchemy ``Session`` or
    ``Connection``) and does not begin, commit or roll back: the approval exists if and only
    if the caller commits. Of two approvers racing, the second waits for the first's row lock
    and then gets :class:`AlreadyDecided`.

    Raises, writing nothing: :class:`ApprovalRefused` (``field`` names an empty ``by`` or
    ``payload_hash``); :class:`ApprovalMismatch` for another hash; :class:`AlreadyDecided`
    when someone decided already ("already decided by X at T"), the approval expired (it is
    refused even before the sweep has cancelled it: the sweep does that), or the operation is
    in another state; :class:`OperationNotFound`.
    """
    operation_id = _as_uuid(op_id)
    by = _required(operation_id, "by", by, "who approves it")
    digest = _required(operation_id, "payload_hash", payload_hash, "the hash you approved")
    digest = digest.lower()
    detail = {"by": by, "note": note, "payload_hash": digest}
    reason = f"approved by {by}" + (f": {note}" if note else "")
    move = transitions.approve(
        operation_id, decided_by=by, approved_payload_hash=digest, reason=reason, detail=detail
    )
    moved = _apply(session, move, given_hash=digest)
    sql.approval.ring_relay(session)
    tracing.decision("outbox.approve", moved.operation, by=by)
    return moved.operation


@translated
def reject(session: Executor, op_id: UUID | str, *, by: str, reason: str) -> Operation:
    """Refuse an ``awaiting_approval`` operation: it moves to ``cancelled`` and is never sent.

    ``by`` (who) and ``reason`` (why) are required and recorded with the time. Joins the
    caller's transaction like :func:`approve` and never commits. Raises, writing nothing:
    :class:`ApprovalRefused` (``field``), :class:`AlreadyDecided`, :class:`OperationNotFound`.
    """
    operation_id = _as_uuid(op_id)
    by = _required(operation_id, "by", by, "who rejects it")
    why = _required(operation_id, "reason", reason, "why")
    move = transitions.reject(
        operation_id,
        decided_by=by,
        reason=f"rejected by {by}: {why}",
        detail={"by": by, "reason": why},
    )
    rejected = _apply(session, move, given_hash=None).operation
    tracing.decision("outbox.reject", rejected, by=by)
    return rejected


def approve_command(operation: Operation) -> str:
    """The ``outbox ops approve`` line an approver copies, bound to the payload's hash."""
    return f"outbox ops approve {operation.id} --by NAME --payload-hash {operation.payload_hash}"


def reject_command(operation: Operation) -> str:
    """The ``outbox ops reject`` line an approver copies."""
    return f"outbox ops reject {operation.id} --by NAME --reason TEXT"


# --- the sweep's expiry, and the policies -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExpiryResult:
    """What :func:`expire_due_and_commit` did."""

    #: Operations moved to ``cancelled`` (``approval expired``).
    expired: int
    #: Operations decided by someone else between the read and the move: left as they are.
    missed: int


def expire_due_and_commit(conn: Connection, *, limit: int = 500) -> ExpiryResult:
    """Cancel every ``awaiting_approval`` operation whose approval expired (database clock),
    up to ``limit``, each in a transaction of its own with its ``approval_expired`` webhook.

    Each move is a compare-and-set that checks the expiry again, so an approval committed in
    between wins. ``conn`` must have no transaction open.
    """
    with conn.begin():
        due = sql.approval.expired_approvals(conn, limit=limit)
    expired = 0
    for operation_id in due:
        done = transitions.apply_and_commit(conn, transitions.expire_approval(operation_id))
        expired += isinstance(done, Moved)
    return ExpiryResult(expired=expired, missed=len(due) - expired)


def publish_policies_committed(engine: Engine, contracts: Iterable[ToolContract]) -> int:
    """Write each tool's approval policy and ``input_schema`` to ``outbox.tool_policies`` and
    commit: ``enqueue`` in any process (one that loads no tools too) reads them there, refusing
    an unknown tool and a payload the schema refuses. Returns how many tools."""
    policies = [
        ToolPolicy(c.name, c.approval_required, c.approval_ttl_s, c.input_schema) for c in contracts
    ]
    with engine.begin() as conn:
        sql.approval.upsert_policies(conn, policies)
    return len(policies)


# --- why a decision was refused ---------------------------------------------------------------


def _required(operation_id: UUID, field: str, value: object, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ApprovalRefused(
            f"operation {operation_id}: --{field.replace('_', '-')} / {field} must say {what}, "
            "for the audit trail; nothing was changed",
            operation_id=operation_id,
            field=field,
        )
    return value.strip()


def _apply(session: Executor, move: transitions.Move, *, given_hash: str | None) -> Moved:
    try:
        return transitions.apply(session, move)
    except StaleTransition as missed:
        # The compare-and-set matched nothing; the row as it is now says why.
        current = sql.intents.get_operation(session, move.operation_id)
        if current is None:
            raise OperationNotFound(
                f"no operation {move.operation_id}", operation_id=move.operation_id
            ) from missed
        raise _why_refused(session, current, given_hash) from missed


def _why_refused(
    executor: Executor, current: Operation, given_hash: str | None
) -> ApprovalMismatch | AlreadyDecided:
    expired_at = current.approval_expires_at
    if current.state is State.AWAITING_APPROVAL:
        if given_hash is not None and given_hash != current.payload_hash:
            return ApprovalMismatch(
                f"payload hash mismatch on operation {current.id}: you approved "
                f"{given_hash[:12]}…, the stored payload's hash is {current.payload_hash[:12]}…; "
                "nothing was changed: show it again with `outbox ops show "
                f"{current.id}` and approve what it says",
                operation_id=current.id,
                given=given_hash,
                expected=current.payload_hash,
            )
        return _decided(
            current,
            f"its approval expired at {_at(expired_at)} (the sweep cancels it)",
            expired_at=expired_at,
        )
    if current.decided_by is not None and current.decided_at is not None:
        verdict = "approved" if current.approved_payload_hash is not None else "rejected"
        return _decided(
            current,
            f"already decided by {current.decided_by} at {_at(current.decided_at)} "
            f"({verdict}; it is now {current.state.value})",
        )
    if _expired_by_sweep(executor, current):
        return _decided(
            current,
            f"its approval expired at {_at(expired_at)} and it is cancelled",
            expired_at=expired_at,
        )
    return _decided(current, f"it is {current.state.value}, not awaiting approval")


def _expired_by_sweep(executor: Executor, current: Operation) -> bool:
    events = sql.intents.list_events(executor, current.id)
    return any(e.from_state is State.AWAITING_APPROVAL and e.actor == "sweep" for e in events)


def _decided(current: Operation, why: str, *, expired_at: datetime | None = None) -> AlreadyDecided:
    return AlreadyDecided(
        f"operation {current.id}: {why}; nothing was changed",
        operation_id=current.id,
        state=current.state,
        decided_by=current.decided_by,
        decided_at=current.decided_at,
        expired_at=expired_at,
    )


def _at(moment: datetime | None) -> str:
    return iso_utc(moment) if moment is not None else "?"
