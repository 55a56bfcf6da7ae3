"""A saga declared over HTTP (POST /v1/sagas) with real processes against the reference
service: two releases and a last step the service refuses; both releases rolled back, the
second first; the same request again changes nothing at the service."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import tokens
from outbox.dev.service import DeployService
from outbox.models import TokenScope
from tests import saga_stack
from tests.api_server import running_api
from tests.processes import Services, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def service() -> Iterator[DeployService]:
    """The reference service, with lookups."""
    with DeployService(port=0) as running:
        yield running


@pytest.fixture
def stack_env(database_url: str, service: DeployService, tmp_path: Path) -> dict[str, str]:
    """Both tools on the service, short timeouts, the database broker."""
    return saga_stack.stack_env(database_url, None, tmp_path, service.url)


def _release(target: str) -> dict[str, Any]:
    """A release on ``target``, undone by rolling back the release it made."""
    return {
        "name": f"release-{target}",
        "tool": saga_stack.TOOL,
        "target": target,
        "payload": {"version": "2.0.0"},
        "compensate": {
            "tool": saga_stack.ROLLBACK_TOOL,
            "target": target,
            "payload": {"release": "{remote_ref}"},
        },
    }


@pytest.mark.timeout(240)
def test_a_saga_declared_over_http_is_undone_in_reverse_once(
    services: Services,
    stack_env: dict[str, str],
    service: DeployService,
    engine: Engine,
    tmp_path: Path,
) -> None:
    """POST /v1/sagas, then GET until it settles: compensated, the two releases rolled back
    in reverse order; the same POST again: 200, the saga as it is, no new request."""
    services.start("worker", "worker", "-c", "4", "-P", "threads")
    services.start("relay", "relay")
    services.start("beat", "beat")
    with Session(engine) as session, session.begin():
        token = tokens.create_token(session, name="agent-http", scope=TokenScope.AGENT).token
    run = uuid.uuid4().hex[:8]
    a, b = f"p-{run}-a", f"p-{run}-b"
    refused = {
        "name": "refused",
        "tool": saga_stack.ROLLBACK_TOOL,
        "target": b,
        "payload": {"release": "rel-that-does-not-exist"},
    }
    body = {"saga_key": f"http/{run}", "steps": [_release(a), _release(b), refused]}
    with (
        running_api(stack_env, tmp_path / "api.log") as api,
        httpx.Client(
            base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        ) as client,
    ):
        created = client.post("/v1/sagas", json=body)
        assert created.status_code == 201, created.text
        location = created.headers["location"]

        def settled() -> bool:
            return client.get(location).json()["state"] not in ("running", "compensating")

        wait_until(settled, timeout=180, interval=0.5, what="the saga to settle")
        saga = client.get(location).json()
        assert saga["state"] == "compensated", saga
        assert [(s["name"], s["state"], s["compensation_state"]) for s in saga["steps"]] == [
            (f"release-{a}", "confirmed", "confirmed"),
            (f"release-{b}", "confirmed", "confirmed"),
            ("refused", "failed", None),
        ]
        ledger = [(e.kind, e.target) for e in service.ledger()]
        assert ledger == [("release", a), ("release", b), ("rollback", b), ("rollback", a)]

        again = client.post("/v1/sagas", json=body)
        assert again.status_code == 200, again.text
        assert again.json()["state"] == "compensated"
        assert len(service.ledger()) == 4
