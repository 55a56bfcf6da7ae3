"""The console's session: who is signed in, and the per-session CSRF token (the sign-in
throttle is :mod:`outbox.signins`, in PostgreSQL).

The session lives in a cookie signed by Starlette's ``SessionMiddleware`` (itsdangerous) with
OUTBOX_CONSOLE_SECRET, HttpOnly and SameSite=Strict (and Secure when the API serves HTTPS or
sits behind a TLS proxy). It holds the operator's name, the id of the session's row in
``outbox.console_sessions`` and a random CSRF token; every POST must carry that token in its
``csrf`` field (compared in constant time), else 403. Each request reads the session's row
with its account (:func:`outbox.operators.session_operator`), so a session ends for good at
sign-out (its row is deleted: a copy of the cookie is refused), and all of an operator's end
at `outbox operators sign-out-all`, a password change or the account's removal.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from dataclasses import dataclass
from uuid import UUID

from starlette.requests import Request

from outbox.logs import Action
from outbox.operators import SESSION_MAX_AGE_S

log = logging.getLogger(__name__)

#: The session cookie's name.
COOKIE = "outbox_console"
#: A session lasts this long after sign-in, at most (then sign in again).
MAX_AGE_S = SESSION_MAX_AGE_S
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


@dataclass(frozen=True, slots=True)
class SignedIn:
    """Who the session cookie says is signed in, and its session's id (the caller checks
    that the session has not ended)."""

    name: str
    session_id: UUID


def signed_in(request: Request) -> SignedIn | None:
    """The operator and session the cookie names, if it names one younger than
    :data:`MAX_AGE_S`."""
    name = request.session.get("operator")
    started = request.session.get("since")
    session_id = request.session.get("session")
    if not isinstance(name, str) or not isinstance(started, int | float):
        return None
    if not isinstance(session_id, str) or time.time() - started > MAX_AGE_S:
        return None
    try:
        return SignedIn(name=name, session_id=UUID(session_id))
    except ValueError:
        return None


def sign_in(request: Request, name: str, session_id: UUID) -> None:
    """Start session ``session_id`` for ``name``: a fresh CSRF token, so none seen before
    sign-in lives on."""
    request.session.clear()
    request.session.update(
        {
            "operator": name,
            "session": str(session_id),
            "since": time.time(),
            CSRF_FIELD: secrets.token_urlsafe(32),
        }
    )


def sign_out(request: Request) -> None:
    """Forget the session in this browser (the caller deletes its row)."""
    request.session.clear()
