"""The HTTP API fuzzed by schemathesis from its own OpenAPI document, against a live
`outbox api` on a real PostgreSQL: no server error, every response valid against the schema."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
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
from tests.factories import make_operation

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
    headers = {"Authorization": f"Bearer {operator_token}"}
    results = list(schema.get_all_operations())
    invalid = [result.err() for result in results if isinstance(result, Err)]
    assert invalid == [], "the served OpenAPI document is invalid"
    operations = [result.ok() for result in results if isinstance(result, Ok)]
    assert len(operations) >= 9
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not list(operation.iter_parameters()):
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

        answered_as_documented()
