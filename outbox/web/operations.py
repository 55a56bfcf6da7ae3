"""``/v1/operations``: enqueue, read, long-poll, list, and decide, through the Python API.

Each handler runs the Python API (:mod:`outbox.api`, :mod:`outbox.approval`,
:func:`outbox.resolve`) unchanged on the request's own connection (``run_sync``, as
:mod:`outbox.aio` does), in one transaction, once its route has authenticated the caller
(:mod:`outbox.web.auth`, before the request is parsed): the same rules and the same errors,
answered as problem documents (:mod:`outbox.web.problems`). The enqueue, the
hot path, runs in a worker thread on a sync connection instead: psycopg's sync transaction
costs about half the CPU of its async one (bench/api.py, docs/performance.md). The token's
name is the identity recorded: ``requested_by`` of what it enqueues, the decider of what it
decides.

A decision (cancel, approve, reject, resolve) locks the operation's row first and compares
it with ``If-Match``: the ``ETag`` of an operation names its state and attempt number
(``"needs_human.3"``), so of two clients deciding on what they both read, the second waits
for the first's commit, then gets 412; resolve's ``expect_attempts`` is the ETag's attempt.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Annotated
from uuid import UUID

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse
from sqlalchemy import Connection
from starlette.concurrency import run_in_threadpool

from outbox import aio, api, approval, sql, trace_context
from outbox.errors import WaitTimeout
from outbox.models import ApiToken, Operation, TokenScope
from outbox.resolve import resolve
from outbox.states import State
from outbox.storable import unstorable_text
from outbox.web.auth import Caller, CallerRoute, OperatorRoute, may_read
from outbox.web.context import ApiContext, context
from outbox.web.models import (
    ApproveRequest,
    CancelRequest,
    EnqueueRequest,
    EventList,
    OperationOut,
    OperationPage,
    RejectRequest,
    ResolveRequest,
    Text,
)
from outbox.web.problems import Problem, documented

# Every route authenticates its caller before reading the request (outbox.web.auth); the
# decisions only an operator's.
router = APIRouter(prefix="/v1", tags=["operations"], route_class=CallerRoute)
operator_router = APIRouter(prefix="/v1", tags=["operations"], route_class=OperatorRoute)

IfMatch = Annotated[
    str | None,
    Header(
        alias="If-Match",
        description='The ETag you read ("<state>.<attempts>"): refused with 412 if it moved.',
    ),
]

#: Most operations one page lists.
MAX_PAGE = 500


def etag(operation: Operation) -> str:
    """The operation's entity tag: its state and attempt number, quoted (a strong ETag)."""
    return f'"{operation.state.value}.{operation.attempts}"'


def answer(operation: Operation, status: int = 200, **headers: str) -> JSONResponse:
    """The operation as JSON, with its ETag."""
    return JSONResponse(operation.to_dict(), status, headers={"ETag": etag(operation), **headers})


def _not_found(operation_id: UUID) -> Problem:
    return Problem(404, f"no operation {operation_id}", slug="operation-not-found")


# --- enqueue --------------------------------------------------------------------------------


@router.post(
    "/operations",
    status_code=201,
    response_model=OperationOut,
    summary="Record an intent (enqueue); its key is the Idempotency-Key header",
    responses={
        200: {"model": OperationOut, "description": "The same intent was recorded already."},
        **documented(400, 401, 409, 413, 415, 422, 429),
    },
)
async def create_operation(
    request: Request,
    *,
    caller: Caller,
    body: EnqueueRequest,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            description="The intent key: names the effect across retries (required).",
        ),
    ] = None,
    traceparent: Annotated[
        str | None,
        Header(
            description="The caller's W3C trace context, recorded with a new operation so "
            "that its later stages join the caller's trace (ignored when not valid).",
        ),
    ] = None,
    tracestate: Annotated[
        str | None, Header(description="The caller's W3C tracestate, with its traceparent.")
    ] = None,
) -> JSONResponse:
    """201 with the new operation; 200 with the existing one for the same key and the same
    tool, target and payload; 422 naming the differing field for the same key with other
    input; 400 without a key: an agent must name the effect it intends."""
    key = _intent_key(idempotency_key)
    ctx = context(request)
    trace = trace_context.parse(traceparent, tracestate)

    def record() -> api.Enqueued:
        with trace_context.passed(trace), ctx.sync_engine.begin() as conn:
            require_known_tool(ctx, conn, body.tool)
            intent = api.Intent(
                tool=body.tool,
                target=body.target,
                payload=body.payload,
                intent_key=key,
                metadata=body.metadata,
                requested_by=caller.name,
                require_approval=body.require_approval,
                # The key is the token's agent's: another agent's same key is another
                # operation, and nothing of it can be in this answer.
                agent=caller.agent,
            )
            return api.enqueue_intent(conn, intent)

    # In a worker thread, on a sync connection: the same enqueue at about half the CPU.
    done = await run_in_threadpool(record)
    op = done.operation
    if done.created:
        return answer(op, 201, Location=f"/v1/operations/{op.id}")
    return answer(op)


def _intent_key(header: str | None) -> str:
    if header is None:
        raise Problem(
            400,
            "the Idempotency-Key header is required: it is the intent key that names the "
            "effect across retries (the same key and intent return the same operation)",
            slug="idempotency-key-missing",
            field="Idempotency-Key",
        )
    # The IETF draft sends it as a structured-field string ("..."); a bare value is kept as is.
    if len(header) >= 2 and header[0] == header[-1] == '"':
        header = header[1:-1]
    if not header.strip():
        raise Problem(
            400,
            "the Idempotency-Key header is empty: it is the intent key that names the effect "
            "across retries, and must name one",
            slug="idempotency-key-missing",
            field="Idempotency-Key",
        )
    if len(header) > api.MAX_INTENT_KEY_LENGTH:
        raise Problem(
            422,
            f"the Idempotency-Key is {len(header)} characters; at most "
            f"{api.MAX_INTENT_KEY_LENGTH} are allowed",
            slug="invalid-intent",
            field="Idempotency-Key",
            limit=api.MAX_INTENT_KEY_LENGTH,
            size=len(header),
        )
    if unstorable_text(header) is not None:
        raise Problem(
            422,
            "the Idempotency-Key holds a character PostgreSQL cannot store (NUL)",
            slug="invalid-intent",
            field="Idempotency-Key",
        )
    return header


def require_known_tool(
    ctx: ApiContext, conn: Connection, tool: str, *, field: str = "tool"
) -> None:
    """A 422 naming ``field`` unless ``tool`` is one this deployment knows."""
    if tool in ctx.known_tools:
        return
    if not api.known_tool(conn, tool):
        raise Problem(
            422,
            f"unknown tool {tool!r}: no worker of this deployment has registered it (a tool "
            "is known once a worker that loads it has started, after `outbox tools publish`, "
            "or when the API loads the tools: OUTBOX_CONFIG / OUTBOX_TOOLS)",
            slug="unknown-tool",
            field=field,
        )
    ctx.known_tools.add(tool)


# --- read -----------------------------------------------------------------------------------


@router.get(
    "/operations/{operation_id}",
    response_model=OperationOut,
    summary="Read one operation; ?wait=S long-polls until it settles",
    responses=documented(401, 404, 422),
)
async def get_operation(
    request: Request,
    caller: Caller,
    operation_id: UUID,
    wait: Annotated[
        float,
        Query(
            ge=0,
            allow_inf_nan=False,
            description="Seconds to wait for the operation to settle (terminal, or waiting "
            "for a person); capped at OUTBOX_API_MAX_WAIT. 0: answer at once.",
        ),
    ] = 0,
    through_approval: Annotated[
        bool,
        Query(description="Wait on through an approval, to the real outcome."),
    ] = False,
) -> JSONResponse:
    """The operation as it is, or once it settles or ``wait`` seconds pass (whichever is
    first); its ETag names its state and attempts. An agent reads only its own."""
    ctx = context(request)
    async with ctx.engine.begin() as conn:
        op = await conn.run_sync(lambda sync: api.get(sync, operation_id))
    if op is None or not may_read(caller, op):
        raise _not_found(operation_id)
    if wait > 0 and not _settled(op, through_approval=through_approval):
        try:
            # One shared LISTEN per process (outbox.aio): no thread and no connection per waiter.
            op = await aio.wait(
                op.id,
                timeout=min(wait, ctx.settings.api_max_wait),
                engine=ctx.engine,
                through_approval=through_approval,
            )
        except WaitTimeout as late:
            op = late.operation if isinstance(late.operation, Operation) else op
    return answer(op)


def _settled(op: Operation, *, through_approval: bool) -> bool:
    return op.is_settled and not (through_approval and op.state is State.AWAITING_APPROVAL)


@router.get(
    "/operations",
    response_model=OperationPage,
    summary="List operations, newest first, by keyset pages",
    responses=documented(400, 401, 422),
)
async def list_operations(
    request: Request,
    caller: Caller,
    *,
    intent_key: Annotated[
        Text | None, Query(description="Only those with this key (one per agent).")
    ] = None,
    agent: Annotated[
        Text | None,
        Query(description="Only this agent's (an operator's filter; an agent sees its own)."),
    ] = None,
    state: Annotated[State | None, Query(description="Only operations in this state.")] = None,
    tool: Annotated[Text | None, Query(description="Only operations of this tool.")] = None,
    target: Annotated[Text | None, Query(description="Only operations on this target.")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="At most this many.")] = 50,
    cursor: Annotated[
        str | None, Query(description="next_cursor of the previous page (opaque).")
    ] = None,
) -> JSONResponse:
    """Operations matching every filter, newest first; an agent sees only its own."""
    before = _decode_cursor(cursor) if cursor is not None else None
    ctx = context(request)
    async with ctx.engine.begin() as conn:
        own = agent if caller.scope is TokenScope.OPERATOR else caller.agent
        found = await conn.run_sync(
            lambda sync: sql.web.page_operations(
                sync,
                limit=limit,
                before_id=before,
                intent_key=intent_key,
                state=state,
                tool=tool,
                target=target,
                agent=own,
            )
        )
    more = _encode_cursor(found[-1].id) if len(found) == limit else None
    return JSONResponse({"items": [op.to_dict() for op in found], "next_cursor": more})


def _encode_cursor(last: UUID) -> str:
    return base64.urlsafe_b64encode(last.bytes).rstrip(b"=").decode()


def _decode_cursor(cursor: str) -> UUID:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        return UUID(bytes=raw)
    except (binascii.Error, ValueError):
        raise Problem(
            400,
            "cursor is not one this API gave: pass next_cursor from the previous page as is",
            slug="invalid-cursor",
            field="cursor",
        ) from None


@router.get(
    "/operations/{operation_id}/events",
    response_model=EventList,
    summary="An operation's audit trail, oldest first",
    responses=documented(401, 404, 422),
)
async def list_events(request: Request, caller: Caller, operation_id: UUID) -> JSONResponse:
    """Every state change of the operation: who made it, why, when."""
    ctx = context(request)
    async with ctx.engine.begin() as conn:
        op = await conn.run_sync(lambda sync: api.get(sync, operation_id))
        if op is None or not may_read(caller, op):
            raise _not_found(operation_id)
        trail = await conn.run_sync(lambda sync: sql.intents.list_events(sync, operation_id))
    return JSONResponse({"items": [event.to_dict() for event in trail]})


# --- decide ---------------------------------------------------------------------------------

_DECISION_ERRORS = documented(400, 401, 403, 404, 409, 412, 413, 415, 422)

#: A decision: the Python API call, on the request's (sync) connection, by the caller, with
#: the attempt number If-Match named (None without one).
Decision = Callable[[Connection, ApiToken, int | None], Operation]


async def _decide(
    request: Request,
    caller: ApiToken,
    operation_id: UUID,
    if_match: str | None,
    decide: Decision,
) -> JSONResponse:
    """Lock the row, compare it with If-Match, run ``decide(sync_conn, caller, attempts)``
    (the caller is an operator: an :class:`OperatorRoute` checked it)."""
    ctx = context(request)
    async with ctx.engine.begin() as conn:
        current = await conn.run_sync(lambda sync: sql.web.lock_operation(sync, operation_id))
        if current is None:
            raise _not_found(operation_id)
        seen = _check_if_match(if_match, current)
        op: Operation = await conn.run_sync(lambda sync: decide(sync, caller, seen))
    return answer(op)


def _check_if_match(header: str | None, current: Operation) -> int | None:
    """The attempt number the client saw (None without If-Match); 412 if the row moved."""
    if header is None:
        return None
    tags = [tag.strip() for tag in header.split(",")]
    if "*" in tags:
        return None
    now = etag(current)
    if now in tags:
        return current.attempts
    raise Problem(
        412,
        f"operation {current.id} is now {current.state.value} at attempt {current.attempts} "
        f"(ETag {now}), not what If-Match says ({header}); nothing was changed: read it "
        "again and decide on what it says now",
        slug="stale",
        headers={"ETag": now},
        operation_id=str(current.id),
        state=current.state.value,
        attempts=current.attempts,
    )


@operator_router.post(
    "/operations/{operation_id}/cancel",
    response_model=OperationOut,
    summary="Cancel a planned operation (or one awaiting approval)",
    responses=_DECISION_ERRORS,
)
async def cancel_operation(
    request: Request,
    caller: Caller,
    operation_id: UUID,
    if_match: IfMatch = None,
    body: CancelRequest | None = None,
) -> JSONResponse:
    """Withdraw it while no attempt can have reached the remote (``outbox.cancel``)."""
    why = body.reason if body is not None and body.reason else None

    def decide(sync: Connection, caller: ApiToken, _seen: int | None) -> Operation:
        reason = f"cancelled by {caller.name}" + (f": {why}" if why else "")
        return api.cancel(sync, operation_id, reason=reason)

    return await _decide(request, caller, operation_id, if_match, decide)


@operator_router.post(
    "/operations/{operation_id}/approve",
    response_model=OperationOut,
    summary="Approve an operation awaiting approval, bound to its payload hash",
    responses=_DECISION_ERRORS,
)
async def approve_operation(
    request: Request,
    caller: Caller,
    operation_id: UUID,
    body: ApproveRequest,
    if_match: IfMatch = None,
) -> JSONResponse:
    """It moves to ``planned`` and is sent next (``outbox.approve``); the token's name is the
    approver."""

    def decide(sync: Connection, caller: ApiToken, _seen: int | None) -> Operation:
        return approval.approve(
            sync, operation_id, by=caller.name, payload_hash=body.payload_hash, note=body.note
        )

    return await _decide(request, caller, operation_id, if_match, decide)


@operator_router.post(
    "/operations/{operation_id}/reject",
    response_model=OperationOut,
    summary="Reject an operation awaiting approval: it is cancelled, never sent",
    responses=_DECISION_ERRORS,
)
async def reject_operation(
    request: Request,
    caller: Caller,
    operation_id: UUID,
    body: RejectRequest,
    if_match: IfMatch = None,
) -> JSONResponse:
    """``outbox.reject``; the token's name is the decider."""

    def decide(sync: Connection, caller: ApiToken, _seen: int | None) -> Operation:
        return approval.reject(sync, operation_id, by=caller.name, reason=body.reason)

    return await _decide(request, caller, operation_id, if_match, decide)


@operator_router.post(
    "/operations/{operation_id}/resolve",
    response_model=OperationOut,
    summary="Record an operator's verdict on an unknown or needs_human operation",
    responses=_DECISION_ERRORS,
)
async def resolve_operation(
    request: Request,
    caller: Caller,
    operation_id: UUID,
    body: ResolveRequest,
    if_match: IfMatch = None,
) -> JSONResponse:
    """applied → ``confirmed`` (with remote_ref); not applied → ``failed``, or with replay →
    ``planned`` again (``outbox.resolve``). If-Match's attempt is ``expect_attempts``."""

    def decide(sync: Connection, caller: ApiToken, seen: int | None) -> Operation:
        return resolve(
            sync,
            operation_id,
            applied=body.applied,
            remote_ref=body.remote_ref,
            replay=body.replay,
            by=caller.name,
            note=body.note,
            expect_attempts=seen,
            payload_hash=body.payload_hash,
            force=body.force,
        )

    return await _decide(request, caller, operation_id, if_match, decide)
