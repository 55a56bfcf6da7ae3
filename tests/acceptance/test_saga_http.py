"""A saga declared from outside Python, with real processes against the reference service:
over HTTP (POST /v1/sagas) and over MCP (outbox_saga, the SDK's stdio client spawning
`outbox mcp`). Two releases and a last step the service refuses: both releases rolled back,
the second first; the same request again changes nothing at the service. A step whose
payload fails its tool's input_schema is refused at the door, naming it."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client, StdioServerParameters
from mcp_types import TextContent
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import tokens
from outbox.dev.service import DeployService
from outbox.models import TokenScope
from tests import saga_stack
from tests.acceptance.conftest import REPO
from tests.api_server import running_api
from tests.processes import Services, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def service() -> Iterator[DeployService]:
    """The reference service, with lookups."""
    with DeployService(port=0) as running:
        yield running


@pytest.fixture
def stack_env(
    database_url: str, engine: Engine, service: DeployService, tmp_path: Path
) -> dict[str, str]:
    """Both tools on the service, short timeouts, the database broker, on a database emptied
    first (``engine``): an operation an earlier module left planned would otherwise be sent
    to this test's service by its worker."""
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


def _refused_last(run: str) -> dict[str, Any]:
    """Two releases, then a rollback of a release that does not exist: the service refuses
    it (422), so the saga undoes both releases."""
    a, b = f"p-{run}-a", f"p-{run}-b"
    refused = {
        "name": "refused",
        "tool": saga_stack.ROLLBACK_TOOL,
        "target": b,
        "payload": {"release": "rel-that-does-not-exist"},
    }
    return {"saga_key": f"mcp/{run}", "steps": [_release(a), _release(b), refused]}


@pytest.mark.timeout(240)
def test_a_saga_declared_over_mcp_answers_undone_once_settled(
    services: Services, stack_env: dict[str, str], service: DeployService
) -> None:
    """outbox_saga waits (up to OUTBOX_MCP_WAIT_S) for the saga to settle: the answer says
    it was undone, as an error, each release with its undo; the same call again, from a new
    server process, is the same saga and nothing more at the service."""
    services.start("worker", "worker", "-c", "4", "-P", "threads")
    services.start("relay", "relay")
    services.start("beat", "beat")
    run = uuid.uuid4().hex[:8]
    declared = _refused_last(run)
    env = {**stack_env, "OUTBOX_MCP_AGENT": "agent-mcp", "OUTBOX_MCP_WAIT_S": "150"}
    server = StdioServerParameters(
        command=sys.executable,
        args=["-m", "outbox", "mcp", "--log-level", "warning"],
        env=env,
        cwd=str(REPO),
    )

    async def call() -> tuple[bool | None, dict[str, Any], str]:
        async with Client(server) as client:
            result = await client.call_tool("outbox_saga", declared)
        words = " ".join(b.text for b in result.content if isinstance(b, TextContent))
        assert isinstance(result.structured_content, dict), words
        return result.is_error, result.structured_content, words

    is_error, body, words = asyncio.run(call())
    assert (is_error, body["state"], body["settled"]) == (True, "compensated", True), words
    assert words.startswith(f"Undone: saga 'mcp/{run}' did not complete")
    a, b = f"p-{run}-a", f"p-{run}-b"
    assert [(s["name"], s["state"], s["compensation_state"]) for s in body["steps"]] == [
        (f"release-{a}", "confirmed", "confirmed"),
        (f"release-{b}", "confirmed", "confirmed"),
        ("refused", "failed", None),
    ]
    ledger = [(e.kind, e.target) for e in service.ledger()]
    assert ledger == [("release", a), ("release", b), ("rollback", b), ("rollback", a)]

    again_error, again, _ = asyncio.run(call())
    assert again_error is True
    assert [s["operation_id"] for s in again["steps"]] == [s["operation_id"] for s in body["steps"]]
    assert len(service.ledger()) == 4


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


#: The release tool's payload schema, as a TOML key of the tool.
RELEASE_SCHEMA = f"""
[tools."{saga_stack.TOOL}".input_schema]
type = "object"
required = ["version"]
properties = {{ version = {{ type = "string", pattern = "^[0-9]+[.][0-9]+[.][0-9]+$" }} }}
"""


def test_a_step_payload_failing_its_tools_schema_is_a_422_naming_it_and_nothing_is_written(
    stack_env: dict[str, str], engine: Engine, tmp_path: Path
) -> None:
    """The API loads the tools with the release tool's input_schema: POST /v1/sagas whose
    second step's payload does not match is 422 invalid-intent naming
    ``steps[1].payload.version``; no saga, step or operation is written (the first step,
    valid, neither), and the saga is not found. Fixed, the same key is then 201."""
    config = Path(stack_env["OUTBOX_CONFIG"])
    config.write_text(config.read_text(encoding="utf-8") + RELEASE_SCHEMA, encoding="utf-8")
    with Session(engine) as session, session.begin():
        token = tokens.create_token(session, name="agent-schema", scope=TokenScope.AGENT).token
    run = uuid.uuid4().hex[:8]
    a, b = f"p-{run}-a", f"p-{run}-b"
    wrong = {**_release(b), "payload": {"version": "latest"}}
    body = {"saga_key": f"schema/{run}", "steps": [_release(a), wrong]}
    with (
        running_api(stack_env, tmp_path / "api.log") as api,
        httpx.Client(
            base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        ) as client,
    ):
        refused = client.post("/v1/sagas", json=body)
        assert refused.status_code == 422, refused.text
        assert refused.headers["content-type"] == "application/problem+json"
        problem = refused.json()
        assert (problem["type"], problem["field"]) == (
            "urn:agent-outbox:problem:invalid-intent",
            "steps[1].payload.version",
        )
        assert problem["detail"].startswith(f"steps[1] ('release-{b}'): payload does not match")
        assert "latest" not in problem["detail"]  # the message never quotes the values
        assert client.get(f"/v1/sagas/schema/{run}").status_code == 404
        with engine.connect() as conn:
            written = conn.execute(
                text(
                    "SELECT (SELECT count(*) FROM outbox.sagas) + (SELECT count(*) FROM "
                    "outbox.saga_steps) + (SELECT count(*) FROM outbox.operations)"
                )
            ).scalar_one()
        assert written == 0

        fixed = client.post("/v1/sagas", json={**body, "steps": [_release(a), _release(b)]})
        assert fixed.status_code == 201, fixed.text
        assert fixed.json()["requested_by"] == "agent-schema"
