"""The operator console: server-rendered pages at ``/`` of the ``outbox api`` process
(docs/console.md).

Operators sign in with an account ``outbox operators add NAME`` made (argon2id), see the
overview, the queue of what waits for a person, and each operation, and approve, reject or
resolve from its page, under their own name. Jinja2 templates, one stylesheet, no script.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.sessions import SessionMiddleware

from outbox.config import Settings
from outbox.signins import Throttle
from outbox.web.console import session
from outbox.web.console.routes import router

__all__ = ["install"]


def install(app: FastAPI, settings: Settings) -> None:
    """Mount the console's pages on ``app`` and its signed session cookie (HttpOnly,
    SameSite=Strict; Secure when the API serves HTTPS or sits behind a TLS proxy)."""
    secret = settings.console_secret.get_secret_value() if settings.console_secret else None
    app.state.console_throttle = Throttle()  # its state: outbox.signin_failures
    app.include_router(router)
    app.add_middleware(
        SessionMiddleware,
        secret_key=session.session_secret(secret),
        session_cookie=session.COOKIE,
        max_age=session.MAX_AGE_S,
        same_site="strict",
        https_only=settings.api_tls_cert is not None or settings.api_behind_proxy,
    )
