"""``/healthz`` (the process answers) and ``/readyz`` (the database answers, at the schema
this package ships): what a load balancer or an orchestrator probes, without a token."""

from __future__ import annotations

from fastapi import APIRouter, Request
from sqlalchemy.exc import DBAPIError

from outbox import migrate
from outbox.web.context import context
from outbox.web.models import Health
from outbox.web.problems import Problem, documented

router = APIRouter(tags=["health"])


@router.get(
    "/healthz", response_model=Health, response_model_exclude_none=True, summary="The process is up"
)
async def healthz() -> Health:
    """Always 200 while the process serves requests; reads nothing."""
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Health,
    summary="The database is reachable and its schema current",
    responses=documented(503),
)
async def readyz(request: Request) -> Health:
    """200 when the database answers and its outbox schema is at this package's head
    revision; 503 (a problem naming which) otherwise."""
    ctx = context(request)
    try:
        async with ctx.engine.connect() as conn:
            revision = await conn.run_sync(migrate.current_on)
    except (DBAPIError, OSError):
        raise Problem(
            503,
            "the database cannot be reached",
            slug="not-ready",
            headers={"Retry-After": "1"},
            database="unreachable",
        ) from None
    if revision != ctx.head:
        raise Problem(
            503,
            f"the schema is at {revision or 'nothing'}, this API needs {ctx.head}: "
            "run `outbox db upgrade`",
            slug="not-ready",
            headers={"Retry-After": "5"},
            database="reachable",
            schema_revision=revision,
            head=ctx.head,
        )
    return Health(status="ok", database="reachable", schema_revision=revision, head=ctx.head)
