"""The operator console: server-rendered pages at ``/`` of the ``outbox api`` process
(docs/console.md).

Operators sign in with an account ``outbox operators add NAME`` made (argon2id), see the
overview, the queue of what waits for a person, and each operation, and approve, reject or
resolve from its page, under their own name. Jinja2 templates, one stylesheet, no script.
"""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.middleware.sessions import SessionMiddleware

from outbox import operators
from outbox.config import Settings
from outbox.db import create_async_engine
from outbox.signins import Throttle
from outbox.web.console import session, signins
from outbox.web.console.routes import router

__all__ = ["install"]


def install(
    app: FastAPI, settings: Settings, *, database_url: str, registry: CollectorRegistry
) -> signins.Signins:
    """Mount the console's pages on ``app`` and its signed session cookie (HttpOnly,
    SameSite=Strict; Secure when the API serves HTTPS or sits behind a TLS proxy). The
    sign-in's own resources (its engine on ``database_url``, its hashing threads, its
    counters in ``registry``): the caller closes them at shutdown."""
    secret = settings.console_secret.get_secret_value() if settings.console_secret else None
    checks = signins.PasswordChecks(
        threads=settings.console_hash_threads,
        queue=settings.console_hash_queue,
        rate=settings.console_hash_rate,
    )
    checks.warm(operators.dummy_hash)
    made = signins.Signins(
        throttle=Throttle(  # its state: outbox.signin_failures
            limit=settings.console_signin_limit,
            window_s=settings.console_signin_window,
            lockout_s=settings.console_signin_lockout,
        ),
        checks=checks,
        engine=create_async_engine(
            database_url,
            pool_size=signins.POOL_SIZE,
            max_overflow=0,
            pool_timeout=signins.POOL_TIMEOUT_S,
            pool_pre_ping=False,
        ),
        metrics=signins.SigninMetrics(registry),
    )
    app.state.console_signins = made
    app.include_router(router)
    app.add_middleware(
        SessionMiddleware,
        secret_key=session.session_secret(secret),
        session_cookie=session.COOKIE,
        max_age=session.MAX_AGE_S,
        same_site="strict",
        https_only=settings.api_tls_cert is not None or settings.api_behind_proxy,
    )
    return made
