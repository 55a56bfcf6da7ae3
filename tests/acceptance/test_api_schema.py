"""The HTTP API fuzzed by schemathesis from its own OpenAPI document, against a live
`outbox api` on a real PostgreSQL: no server error, every response valid against the schema;
the document itself valid OpenAPI, every `$ref` in it resolving, and a client generated from it
(openapi-python-client) working."""

from __future__ import annotations

import importlib
import subprocess
import sys
import unittest
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from openapi_spec_validator import validate
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.control import SkipTest
from schemathesis.core.result import Err, Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import tokens
from outbox.approval import publish_policies_committed
from outbox.contracts import ToolContract
from outbox.models import TokenScope
from outbox.states import State
from tests.acceptance.test_cli_sagas import compensated_saga
from tests.api_server import ApiServer, api_environment, running_api
from tests.factories import make_operation, reload

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@pytest.fixture(scope="module")
def server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """A live `outbox api` whose long-polls are capped at half a second."""
    home = tmp_path_factory.mktemp("api-schema")
    env = api_environment(database_url, home, OUTBOX_API_MAX_WAIT="0.5")
    with running_api(env, home / "api.log") as running:
        yield running


@pytest.fixture(scope="module")
def operator_token(_session_engine: Engine) -> str:
    """An operator token (it may call every route), a known tool, operations in the states a
    decision can meet, and a saga, so that generated requests reach past the 404s and lists
    are not empty."""
    # The saga's tools, its undo tools too: an unpublished one is refused.
    published = ("chat.post", "deploy.create_release", "deploy.delete_release", "lb.point")
    publish_policies_committed(_session_engine, [ToolContract(name=n) for n in published])
    for state in (State.AWAITING_APPROVAL, State.NEEDS_HUMAN, State.PLANNED, State.CONFIRMED):
        make_operation(_session_engine, state)
    compensated_saga(_session_engine, "s-fuzzed")
    with Session(_session_engine) as session, session.begin():
        return tokens.create_token(session, name="fuzzer", scope=TokenScope.OPERATOR).token


#: Generated requests per API operation and generation mode: enough to reach every member
#: and status, few enough for the suite (about 400 requests, some seconds).
EXAMPLES = 25


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_generated_request_gets_a_valid_non_5xx_answer(
    server: ApiServer, operator_token: str, mode: GenerationMode
) -> None:
    """Each generated request, valid or not, is answered without a 5xx, as the schema says."""
    # The schema's own document, served by the live server (not a copy of it).
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    # Whatever schemathesis would leave unchecked (a response whose schema does not resolve,
    # a parameter it cannot use) is a failure here, not a quiet skip.
    assert [warning.message for warning in schema.iter_schema_warnings()] == []
    headers = {"Authorization": f"Bearer {operator_token}"}
    results = list(schema.get_all_operations())
    invalid = [result.err() for result in results if isinstance(result, Err)]
    assert invalid == [], "the served OpenAPI document is invalid"
    operations = [result.ok() for result in results if isinstance(result, Ok)]
    assert len(operations) >= 9
    without_input = {o.label for o in operations if not list(o.iter_parameters())}
    assert without_input == {"GET /healthz", "GET /readyz"}
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.label in without_input:
            continue  # nothing to make invalid (/healthz, /readyz): Hypothesis finds no input

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def answered_as_documented(case: Case[Any]) -> None:
            case.call_and_validate(headers=headers, checks=CHECKS)

        try:
            answered_as_documented()
        except (SkipTest, unittest.SkipTest) as skipped:  # schemathesis's, Hypothesis's
            pytest.fail(f"{operation.label} was skipped, not tested: {skipped}")


# --- the document -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def document(server: ApiServer) -> dict[str, Any]:
    """The OpenAPI document the live server serves."""
    served: dict[str, Any] = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    return served


def test_the_served_document_is_valid_openapi(document: dict[str, Any]) -> None:
    """openapi-spec-validator finds nothing wrong with the served document."""
    validate(document)


def _refs(node: object) -> Iterator[str]:
    """Every ``$ref`` value anywhere in ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)


def _follow(document: dict[str, Any], ref: str) -> object:
    """The node a local JSON pointer ``ref`` names (KeyError if nothing is there)."""
    assert ref.startswith("#/"), f"{ref} is not a local reference"
    node: Any = document
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def test_every_ref_in_the_document_resolves(document: dict[str, Any]) -> None:
    """Each ``$ref`` of the served document names a schema the document holds."""
    refs = list(_refs(document))
    problem = "#/components/schemas/Problem"
    assert refs.count(problem) >= 50  # every error response of every route
    unresolved = []
    for ref in sorted(set(refs)):
        try:
            target = _follow(document, ref)
        except KeyError:
            unresolved.append(ref)
        else:
            assert isinstance(target, dict), ref
            assert target, ref
    assert unresolved == []


# --- a generated client -----------------------------------------------------------------------

#: openapi-python-client's settings: no formatter run on the generated code (ruff is in the
#: dev tools, but formatting is not what the test is about).
GENERATOR_CONFIG = "post_hooks: []\n"


def generated_client(document_url: str, where: Path) -> ModuleType:
    """The package openapi-python-client generates from ``document_url``, imported; refusing
    any warning (a response or schema it would have left out)."""
    package = f"outbox_client_{uuid.uuid4().hex[:8]}"
    config = where / "generator.yaml"
    config.write_text(GENERATOR_CONFIG, encoding="utf-8")
    generator = Path(sys.executable).with_name("openapi-python-client")
    done = subprocess.run(
        [
            str(generator),
            "generate",
            "--url",
            document_url,
            "--meta",
            "none",
            "--output-path",
            str(where / package),
            "--config",
            str(config),
            "--fail-on-warning",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
    sys.path.insert(0, str(where))
    try:
        return importlib.import_module(package)
    finally:
        sys.path.remove(str(where))


def test_a_generated_client_enqueues_reads_and_approves_an_operation(
    server: ApiServer, engine: Engine, tmp_path: Path
) -> None:
    """A client generated from the served document by openapi-python-client enqueues an
    operation that needs approval, reads it, and approves it."""
    publish_policies_committed(engine, [ToolContract(name="chat.post")])
    with Session(engine) as session, session.begin():
        agent = tokens.create_token(session, name="gen-agent", scope=TokenScope.AGENT).token
        operator = tokens.create_token(session, name="gen-ops", scope=TokenScope.OPERATOR).token
    client = generated_client(f"{server.url}/openapi.json", tmp_path)
    calls = importlib.import_module(f"{client.__name__}.api.operations")
    models = importlib.import_module(f"{client.__name__}.models")
    create, get, approve = (
        importlib.import_module(f"{calls.__name__}.{name}")
        for name in ("create_operation", "get_operation", "approve_operation")
    )
    with (
        client.AuthenticatedClient(base_url=server.url, token=agent) as as_agent,
        client.AuthenticatedClient(base_url=server.url, token=operator) as as_operator,
    ):
        intent = models.EnqueueRequest(
            tool="chat.post",
            target="#ops",
            payload=models.EnqueueRequestPayload.from_dict({"text": "deploy done"}),
            require_approval=True,
        )
        created = create.sync_detailed(client=as_agent, body=intent, idempotency_key="gen-1")
        assert created.status_code == 201, created.content
        op = created.parsed
        assert isinstance(op, models.OperationOut)
        assert op.state is models.State.AWAITING_APPROVAL

        read = get.sync(op.id, client=as_agent)
        assert isinstance(read, models.OperationOut)
        assert (read.id, read.payload_hash) == (op.id, op.payload_hash)

        refused = approve.sync(
            op.id, client=as_agent, body=models.ApproveRequest(payload_hash=op.payload_hash)
        )
        assert isinstance(refused, models.Problem)
        assert refused.status == 403

        approved = approve.sync(
            op.id, client=as_operator, body=models.ApproveRequest(payload_hash=op.payload_hash)
        )
        assert isinstance(approved, models.OperationOut), approved
        assert (approved.state, approved.decided_by) == (models.State.PLANNED, "gen-ops")
    assert reload(engine, op.id).state is State.PLANNED
