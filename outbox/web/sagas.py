"""``/v1/sagas``: declare a saga whole (:func:`outbox.declare_saga`), read sagas
(docs/sagas.md) through the Python API (:func:`outbox.get_saga`, :func:`outbox.list_sagas`)
on the request's connection, and cancel one (:func:`outbox.cancel_saga`). A saga key is its
agent's, as an intent key is: an agent token declares and reads its own agent's sagas (another
agent's same key is another saga, never named in an answer); an operator token reads every
saga, choosing the agent with ``?agent=`` when several use one key. Only an operator cancels,
as with operations; the token's name is recorded as who did.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import JSONResponse
from sqlalchemy import Connection
from starlette.concurrency import run_in_threadpool

from outbox import api, sagas
from outbox.models import ApiToken, TokenScope
from outbox.saga_rules import SagaState
from outbox.storable import unstorable_text
from outbox.web.auth import Caller, CallerRoute, OperatorRoute
from outbox.web.context import context
from outbox.web.models import SagaCancelRequest, SagaDeclareRequest, SagaList, SagaOut, Text
from outbox.web.operations import require_known_tool
from outbox.web.problems import Problem, documented

# Every route authenticates its caller before reading the request (outbox.web.auth); the
# cancel only an operator's.
router = APIRouter(prefix="/v1", tags=["sagas"], route_class=CallerRoute)
operator_router = APIRouter(prefix="/v1", tags=["sagas"], route_class=OperatorRoute)

#: Most sagas one list answers.
MAX_SAGAS = 500

AgentQuery = Annotated[
    Text | None,
    Query(
        description="The agent whose saga (an operator's choice when agents share a key; "
        "an agent token reads its own)."
    ),
]


@router.post(
    "/sagas",
    status_code=201,
    response_model=SagaOut,
    summary="Declare a saga: its steps in order, each with how to undo it, in one request",
    responses={
        200: {"model": SagaOut, "description": "The same saga was declared already."},
        **documented(400, 401, 409, 413, 415, 422, 429),
    },
)
async def declare_saga(request: Request, caller: Caller, body: SagaDeclareRequest) -> JSONResponse:
    """``outbox.declare_saga`` under the token's name, in one transaction: 201 with the new
    saga; 200 with it as it is now for the same key and the same steps (retry freely); 422
    naming what differs for the same key with other steps (``steps``, ``steps[1].payload``).
    The key is the token's agent's: another agent's same key is another saga. Its steps
    then run as the Python
    API's do: each released when the one before is confirmed, undone in reverse order if a
    later one is refused."""
    ctx = context(request)
    specs = [
        sagas.StepSpec(
            name=step.name,
            tool=step.tool,
            target=step.target,
            payload=step.payload,
            compensate=(
                sagas.Compensate(
                    step.compensate.tool, step.compensate.target, step.compensate.payload
                )
                if step.compensate is not None
                else None
            ),
            pivot=step.pivot,
            group=step.group,
        )
        for step in body.steps
    ]

    def record() -> sagas.DeclaredSaga:
        with ctx.sync_engine.begin() as conn:
            for index, step in enumerate(body.steps):
                require_known_tool(ctx, conn, step.tool, field=f"steps[{index}].tool")
                if step.compensate is not None:
                    require_known_tool(
                        ctx, conn, step.compensate.tool, field=f"steps[{index}].compensate.tool"
                    )
            return sagas.declare_saga(
                conn, body.saga_key, specs, requested_by=caller.name, agent=caller.agent
            )

    # In a worker thread, on a sync connection, as the enqueue is.
    done = await run_in_threadpool(record)
    if done.created:
        return JSONResponse(
            done.saga.to_dict(),
            201,
            headers={"Location": f"/v1/sagas/{quote(body.saga_key, safe='')}"},
        )
    return JSONResponse(done.saga.to_dict())


@router.get(
    "/sagas/{key:path}",
    response_model=SagaOut,
    summary="Read one saga: its state and why, its steps in order, its audit trail",
    responses=documented(400, 401, 404, 409, 422),
)
async def get_saga(
    request: Request,
    caller: Caller,
    key: Annotated[Text, Path(description="The saga key.")],
    agent: AgentQuery = None,
) -> JSONResponse:
    """The saga as it is; an agent reads only its own agent's (else 404)."""
    ctx = context(request)
    async with ctx.engine.begin() as conn:
        found = await conn.run_sync(
            lambda sync: sagas.get_saga(sync, key, agent=_agent_of(sync, caller, key, agent))
        )
    if found is None:
        raise Problem(404, f"no saga {key!r}", slug="saga-not-found")
    return JSONResponse(found.to_dict())


def _agent_of(conn: Connection, caller: ApiToken, key: str, asked: str | None) -> str:
    """Whose saga ``key`` a request means: an agent token's own agent's, whatever it asks
    (another agent's saga is not there for it); an operator's ``asked``, else the one agent
    that has a saga under ``key`` (409 naming them when several do)."""
    if caller.scope is not TokenScope.OPERATOR:
        if asked is not None and asked != caller.agent:
            raise Problem(404, f"no saga {key!r}", slug="saga-not-found")
        return caller.agent
    if asked is not None:
        return asked
    agents = sagas.agents_of_saga_key(conn, key)
    if len(agents) > 1:
        named = ", ".join(repr(a) for a in agents)
        raise Problem(
            409,
            f"saga key {key!r} names {len(agents)} sagas, one per agent ({named}): choose "
            "one with ?agent=",
            slug="saga-key-ambiguous",
            field="agent",
        )
    return agents[0] if agents else api.SHARED_AGENT


@operator_router.post(
    "/sagas/{key:path}/cancel",
    response_model=SagaOut,
    summary="Cancel a running saga: its unsent steps are cancelled, its confirmed ones undone",
    responses=documented(400, 401, 403, 404, 409, 413, 415, 422),
)
async def cancel_saga(
    request: Request,
    caller: Caller,
    key: Annotated[Text, Path(description="The saga key.")],
    body: SagaCancelRequest,
    agent: AgentQuery = None,
) -> JSONResponse:
    """``outbox.cancel_saga`` under the operator token's name: the held and unsent steps are
    cancelled and the saga moves to ``compensating`` (its confirmed steps are undone in
    reverse order once every step in flight is decided). 409 ``saga-not-running`` when it
    finished, compensates already or waits for a person; nothing is written then."""
    ctx = context(request)
    async with ctx.engine.begin() as conn:
        done = await conn.run_sync(
            lambda sync: sagas.cancel_saga(
                sync,
                key,
                by=caller.name,
                reason=body.reason,
                actor=sagas.OPERATOR,
                agent=_agent_of(sync, caller, key, agent),
            )
        )
    return JSONResponse(done.to_dict())


@router.get(
    "/sagas",
    response_model=SagaList,
    summary="List sagas, newest first, by keyset pages",
    responses=documented(400, 401, 422),
)
async def list_sagas(
    request: Request,
    caller: Caller,
    *,
    state: Annotated[SagaState | None, Query(description="Only sagas in this state.")] = None,
    agent: AgentQuery = None,
    limit: Annotated[int, Query(ge=1, le=MAX_SAGAS, description="At most this many.")] = 50,
    cursor: Annotated[
        str | None, Query(description="next_cursor of the previous page (opaque).")
    ] = None,
) -> JSONResponse:
    """Sagas matching the filter, newest first; an agent sees only its own agent's.
    ``next_cursor`` is set when the page is full: pass it as ``cursor`` for the next one."""
    after = _decode_cursor(cursor) if cursor is not None else None
    ctx = context(request)
    async with ctx.engine.begin() as conn:
        # An operator reads every saga (or one agent's); an agent its own agent's.
        mine = agent if caller.scope is TokenScope.OPERATOR else caller.agent
        found = await conn.run_sync(
            lambda sync: sagas.list_sagas(sync, state=state, limit=limit, agent=mine, after=after)
        )
    more = _encode_cursor(found[-1].position) if len(found) == limit else None
    return JSONResponse({"items": [summary.to_dict() for summary in found], "next_cursor": more})


def _encode_cursor(last: sagas.SagaPosition) -> str:
    raw = json.dumps([last.created_at.isoformat(), last.key, last.agent], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).rstrip(b"=").decode()


def _decode_cursor(cursor: str) -> sagas.SagaPosition:
    invalid = Problem(
        400,
        "cursor is not one this API gave: pass next_cursor from the previous page as is",
        slug="invalid-cursor",
        field="cursor",
    )
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        at, key, agent = json.loads(raw)
        when = datetime.fromisoformat(at)
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        raise invalid from None
    texts = (key, agent)
    # Text PostgreSQL cannot store (a NUL, a lone surrogate "\ud800") is no cursor either.
    if not all(isinstance(t, str) and unstorable_text(t) is None for t in texts):
        raise invalid
    if when.tzinfo is None:
        raise invalid
    return sagas.SagaPosition(when, key, agent)
