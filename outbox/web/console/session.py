"""The console's session: who is signed in, and the per-session CSRF token (the sign-in
throttle is :mod:`outbox.signins`, in PostgreSQL).

The session lives in a cookie signed by Starlette's ``SessionMiddleware`` (itsdangerous) with
OUTBOX_CONSOLE_SECRET, HttpOnly and SameSite=Strict (and Secure when the API serves HTTPS or
sits behind a TLS proxy). It holds the operator's name and a random CSRF token; every POST
must carry that token in its ``csrf`` field (compared in constant time), else 403. Each
request re-reads the account, so a removed operator's session ends at its next request.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time

from starlette.requests import Request

from outbox.logs import Action

log = logging.getLogger(__name__)

#: The session cookie's name.
COOKIE = "outbox_console"
#: A session lasts this long after sign-in, at most (then sign in again).
MAX_AGE_S = 8 * 3600
#: The form field every POST carries its CSRF token in.
CSRF_FIELD = "csrf"


def session_secret(configured: str | None) -> str:
    """The key that signs session cookies: OUTBOX_CONSOLE_SECRET, else a random one for this
    ``outbox api`` (said in a log line: sessions then end when it restarts, and each replica
    signs its own; its ``--workers`` get this one key from it)."""
    if configured:
        return configured
    log.warning(
        "OUTBOX_CONSOLE_SECRET is unset: this outbox api made a random key for console "
        "sessions (its workers share it); they end when it restarts and are not shared "
        "between replicas",
        extra={"action": Action.CONSOLE_SESSION_KEY_MADE},
    )
    return secrets.token_urlsafe(32)


def csrf_token(request: Request) -> str:
    """The session's CSRF token, made on first use (also before sign-in: the sign-in form
    carries one too)."""
    token = request.session.get(CSRF_FIELD)
    if not isinstance(token, str) or not token:
        token = secrets.token_urlsafe(32)
        request.session[CSRF_FIELD] = token
    return token


def csrf_valid(request: Request, given: object) -> bool:
    """Whether ``given`` (a form's ``csrf`` field) is this session's token."""
    expected = request.session.get(CSRF_FIELD)
    return (
        isinstance(expected, str)
        and isinstance(given, str)
        and bool(expected)
        and hmac.compare_digest(expected.encode(), given.encode())
    )


def signed_in_name(request: Request) -> str | None:
    """The operator name the session says is signed in (the caller checks it still exists)."""
    name = request.session.get("operator")
    started = request.session.get("since")
    if not isinstance(name, str) or not isinstance(started, int | float):
        return None
    if time.time() - started > MAX_AGE_S:
        return None
    return name


def sign_in(request: Request, name: str) -> None:
    """Start a session for ``name``: a fresh CSRF token, so none seen before sign-in lives on."""
    request.session.clear()
    request.session.update(
        {"operator": name, "since": time.time(), CSRF_FIELD: secrets.token_urlsafe(32)}
    )


def sign_out(request: Request) -> None:
    """End the session."""
    request.session.clear()
