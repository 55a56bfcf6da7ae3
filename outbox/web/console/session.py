"""The console's session: who is signed in, the per-session CSRF token, and the sign-in
throttle.

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
from collections import OrderedDict, deque
from dataclasses import dataclass

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
    process (said in a log line: sessions then end when the process restarts, and each
    replica signs its own)."""
    if configured:
        return configured
    log.warning(
        "OUTBOX_CONSOLE_SECRET is unset: this process made a random key for console "
        "sessions; they end when it restarts and are not shared between replicas",
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


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a sign-in is refused before its password is checked: which limit, for how long."""

    what: str
    retry_after_s: int


class Throttle:
    """Failed sign-ins per name and per client address, in this process.

    After ``limit`` failures within ``window_s`` for a key, that key is refused until
    ``lockout_s`` after its last failure; a success clears the name's failures. In memory
    (a restart forgets them), bounded to ``max_keys`` keys (the stalest are dropped).
    """

    def __init__(
        self,
        *,
        limit: int = 5,
        window_s: float = 900.0,
        lockout_s: float = 60.0,
        max_keys: int = 10_000,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.lockout_s = lockout_s
        self.max_keys = max_keys
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, key: str, now: float) -> deque[float]:
        found = self._failures.get(key)
        if found is None:
            return deque()
        while found and now - found[0] > self.window_s:
            found.popleft()
        if not found:
            del self._failures[key]
        return found

    def refusal(self, *, name: str, address: str) -> Refusal | None:
        """A :class:`Refusal` if this name or this address is locked out now, else ``None``."""
        now = time.monotonic()
        for what, key in (("this name", f"name:{name}"), ("this address", f"addr:{address}")):
            recent = self._recent(key, now)
            if len(recent) >= self.limit:
                left = recent[-1] + self.lockout_s - now
                if left > 0:
                    return Refusal(what=what, retry_after_s=max(1, round(left + 0.5)))
        return None

    def failed(self, *, name: str, address: str) -> None:
        """Count a failed sign-in against the name and the address."""
        now = time.monotonic()
        for key in (f"name:{name}", f"addr:{address}"):
            self._recent(key, now)
            self._failures.setdefault(key, deque(maxlen=self.limit * 4)).append(now)
            self._failures.move_to_end(key)
        while len(self._failures) > self.max_keys:
            self._failures.popitem(last=False)

    def succeeded(self, *, name: str) -> None:
        """Forget the name's failures (the address's stay: one address guessing many names)."""
        self._failures.pop(f"name:{name}", None)
