"""The API's cache of checked tokens: trusted for its TTL, then checked again; off at 0."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from uuid import uuid4

import pytest

from outbox.models import ApiToken, TokenScope
from outbox.web.auth import TokenCache


def _token() -> ApiToken:
    now = datetime.now(UTC)
    return ApiToken(uuid4(), "agent-a", TokenScope.AGENT, now, None, None, agent="agent-a")


def test_a_checked_token_is_trusted_until_its_ttl_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within the TTL the cache answers; once it has passed, it no longer does."""
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    cache = TokenCache(ttl_s=5.0)
    token = _token()
    cache.put("digest", token)
    clock[0] = 104.9
    assert cache.get("digest") is token
    clock[0] = 105.0
    assert cache.get("digest") is None


def test_a_ttl_of_zero_keeps_nothing() -> None:
    """With OUTBOX_API_TOKEN_CACHE=0 every request checks its token in the database."""
    cache = TokenCache(ttl_s=0)
    cache.put("digest", _token())
    assert cache.get("digest") is None
