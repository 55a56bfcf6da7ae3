"""The FastAPI app of ``outbox api``: the HTTP API under ``/v1``, health, metrics, docs.

:func:`create_app` builds it from the settings and an async engine; the CLI runs it on
uvicorn. The operator console (:mod:`outbox.web.console`) mounts its pages on this same app
at ``/``; everything the API answers lives under ``/v1``, ``/healthz``,
``/readyz``, ``/metrics``, ``/openapi.json`` and ``/docs``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import __version__, aio, migrate, tracing
from outbox.config import Settings, get_settings
from outbox.db import create_async_engine, create_engine, database_url
from outbox.web import console, health, operations, problems, sagas
from outbox.web.auth import TokenCache
from outbox.web.context import ApiContext
from outbox.web.observe import Observe, RequestMetrics

DESCRIPTION = """\
Enqueue consequential actions from any language, read and long-poll them, and decide the ones
that wait for a person: the same rules as the Python API (`outbox.enqueue`, `outbox.approve`,
`outbox.resolve`…). Every `/v1` request carries `Authorization: Bearer <token>` (`outbox tokens
create NAME --scope agent|operator`); every error is an RFC 9457 problem document
(`application/problem+json`). See docs/api.md.
"""


def create_app(
    settings: Settings | None = None,
    *,
    engine: AsyncEngine | None = None,
    metrics_dir: Path | None = None,
) -> FastAPI:
    """The API app on ``engine`` (default: an engine on the configured database, disposed
    when the app shuts down), with ``settings`` (default: from the environment).

    ``metrics_dir``: when several worker processes serve the same socket (``outbox api
    --workers N``), prometheus_client's multiprocess directory (PROMETHEUS_MULTIPROC_DIR,
    set before this process imported prometheus_client): ``/metrics`` then sums the request
    metrics of every worker, living or dead, whichever worker answers the scrape.
    """
    settings = settings if settings is not None else get_settings()
    # With tracing asked for: FastAPI's request spans (and SQLAlchemy's with OUTBOX_OTEL_SQL=1,
    # before the engines exist); the SDK itself is set up when the app starts (lifespan).
    instrumented = tracing.wanted()
    if instrumented:
        tracing.instrument_with(["sqlalchemy"])
    owned = engine is None
    engine = engine or create_async_engine(
        database_url(settings), pool_size=10, max_overflow=20, pool_pre_ping=False
    )
    # The same database as ``engine``, for the enqueue (outbox.web.operations): its URL.
    sync_engine = create_engine(
        engine.url.render_as_string(hide_password=False),
        pool_size=10,
        max_overflow=20,
        pool_pre_ping=False,
    )
    ctx = ApiContext(engine=engine, sync_engine=sync_engine, settings=settings, head=migrate.head())
    closing: list[console.signins.Signins] = []

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Approvals and resolutions as spans, when the OTEL_* variables ask for tracing.
        tracing.setup("outbox-api")
        yield
        tracing.shutdown()
        await aio.close()  # the long-polls' shared LISTEN, and its two connections
        for signins in closing:  # the console's sign-in engine and hashing threads
            await signins.close()
        ctx.sync_engine.dispose()
        if owned:
            await ctx.engine.dispose()

    app = FastAPI(
        title="agent-outbox",
        version=__version__,
        description=DESCRIPTION,
        openapi_url="/openapi.json",
        docs_url="/docs",
        redoc_url=None,
        lifespan=lifespan,
        # operationId: the route's function name (create_operation, approve_operation…), the
        # names a client generated from the document gives its calls (docs/api.md).
        generate_unique_id_function=lambda route: route.name,
    )
    app.state.outbox = ctx
    app.state.tokens = TokenCache(settings.api_token_cache)
    problems.install(app)
    app.include_router(operations.router)
    app.include_router(operations.operator_router)
    app.include_router(sagas.router)
    app.include_router(sagas.operator_router)
    app.include_router(health.router)
    metrics = RequestMetrics()

    @app.get("/metrics", include_in_schema=False)
    async def serve_metrics() -> Response:
        return Response(generate_latest(scraped()), media_type=CONTENT_TYPE_LATEST)

    def scraped() -> CollectorRegistry:
        if metrics_dir is None:
            return metrics.registry
        # A fresh registry per scrape, as prometheus_client's multiprocess mode asks: the
        # collector reads every process's files (counters and histograms are summed).
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(metrics_dir))  # type: ignore[no-untyped-call]
        return registry

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = problems.problem_openapi(FastAPI.openapi(app))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    # The operator console's pages at / (docs/console.md); its sign-in on a pool of its own.
    closing.append(
        console.install(
            app,
            settings,
            database_url=engine.url.render_as_string(hide_password=False),
            registry=metrics.registry,
        )
    )
    app.add_middleware(Observe, metrics=metrics, max_body_bytes=settings.api_max_body_bytes)
    if instrumented:
        tracing.instrument_app(app)
    return app
