"""Data in the HTTP API's URLs (issue 32, items 4, 5 and 7), against a real `outbox api`
on a real PostgreSQL: dot segments refused at the door naming the field, saga keys fully
encoded in Location, and unencodable text in a cursor, path or query parameter a 400."""

# ruff: noqa: F811 -- the fixtures of test_api.py, imported, are the tests' parameters

from __future__ import annotations

import base64
import json
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine

from tests.acceptance.test_api import (  # noqa: F401 -- the module's server and clients
    agent,
    assert_problem,
    enqueue,
    known_tool,
    operator,
    server,
)
from tests.factories import event_count, operation_count
from tests.integration.test_sagas import open_saga

pytestmark = pytest.mark.slow

AT = "2026-01-01T00:00:00+00:00"
#: Any text, with lone surrogates, NUL, separators and dots often (st.text() drops
#: surrogates, even from its alphabet: a list of characters joined keeps them).
TEXT = st.lists(st.characters() | st.sampled_from(["\ud800", "\udfff", "\x00", "/", "%", "."])).map(
    "".join
)
STEP = {"name": "release", "tool": "deploy.create_release", "target": "a", "payload": {}}


def _cursor(document: Any) -> str:
    raw = json.dumps(document).encode()  # ensure_ascii: a lone surrogate as "\ud800"
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@pytest.mark.parametrize(
    ("target", "key", "field"),
    [("..", "k-1", "target"), ("%2e%2E", "k-2", "target"), ("a", "%2E", "intent_key")],
)
def test_a_dot_segment_target_or_key_is_422_naming_it(
    agent: httpx.Client, engine: Engine, target: str, key: str, field: str
) -> None:
    """POST /v1/operations with a `..` target or a `%2E` Idempotency-Key is 422 naming the
    field, and writes nothing."""
    problem = assert_problem(enqueue(agent, key, target=target), 422, "path segment")
    assert problem["field"] == field
    assert (operation_count(engine), event_count(engine)) == (0, 0)


def test_a_saga_key_with_a_dot_segment_is_422_naming_it(
    agent: httpx.Client, engine: Engine
) -> None:
    """POST /v1/sagas with the key `harmless/../victim` is 422 naming saga_key; nothing
    is written."""
    declared = agent.post("/v1/sagas", json={"saga_key": "harmless/../victim", "steps": [STEP]})
    assert assert_problem(declared, 422, "path segment")["field"] == "saga_key"
    assert operation_count(engine) == 0


def test_a_saga_key_with_a_slash_is_one_encoded_segment_in_location(
    agent: httpx.Client,
) -> None:
    """A saga declared with the key `team/a b` answers Location /v1/sagas/team%2Fa%20b,
    which reads that saga back."""
    declared = agent.post("/v1/sagas", json={"saga_key": "team/a b", "steps": [STEP]})
    assert declared.status_code == 201, declared.text
    assert declared.headers["location"] == "/v1/sagas/team%2Fa%20b"
    again = agent.get(declared.headers["location"])
    assert (again.status_code, again.json()["key"]) == (200, "team/a b")


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/sagas?cursor=" + _cursor([AT, "\ud800", ""]), "cursor"),
        ("/v1/sagas?cursor=" + _cursor([AT, "k", "\udfff"]), "cursor"),
        ("/v1/sagas?agent=a%00", "agent"),
        ("/v1/sagas/a%00b", "key"),
        ("/v1/sagas/s?agent=%00", "agent"),
        ("/v1/operations?cursor=%ED%A0%80", "cursor"),
        ("/v1/operations?agent=%00", "agent"),
        ("/v1/operations?intent_key=%00", "intent_key"),
        ("/v1/operations?tool=t%00", "tool"),
        ("/v1/operations?target=%00", "target"),
    ],
)
def test_unencodable_text_in_a_cursor_path_or_query_parameter_is_400(
    operator: httpx.Client, path: str, field: str
) -> None:
    """A lone surrogate in a cursor's JSON, or a NUL in a path or query parameter, is a 400
    problem naming the parameter, never a 500."""
    problem = assert_problem(operator.get(path), 400)
    assert problem["field"] == field


def test_a_saga_cancel_with_a_nul_in_its_key_is_400(operator: httpx.Client) -> None:
    """POST /v1/sagas/a%00/cancel is a 400 naming `key`."""
    answer = operator.post("/v1/sagas/a%00/cancel", json={"reason": "x"})
    assert assert_problem(answer, 400)["field"] == "key"


def test_a_saga_key_with_a_slash_round_trips_through_the_api(
    operator: httpx.Client, engine: Engine
) -> None:
    """GET /v1/sagas/harmless%2Fx reads saga `harmless/x`, not saga `x`."""
    open_saga(engine, "x", [])
    open_saga(engine, "harmless/x", [])
    read = operator.get("/v1/sagas/harmless%2Fx")
    assert (read.status_code, read.json()["key"]) == (200, "harmless/x")


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(key=TEXT, agent=TEXT, when=st.sampled_from([AT, "2026-01-01", "x"]))
def test_any_text_in_a_saga_cursor_is_a_page_or_a_400(
    operator: httpx.Client, key: str, agent: str, when: str
) -> None:
    """Whatever text a saga cursor's JSON holds (surrogates, NUL, anything), the list is a
    page or a 400 invalid-cursor, never a 5xx."""
    answer = operator.get("/v1/sagas", params={"cursor": _cursor([when, key, agent])})
    assert answer.status_code in (200, 400), answer.text


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(key=TEXT.filter(bool), agent=st.none() | TEXT)
def test_any_text_as_a_saga_key_or_agent_parameter_is_answered_without_a_5xx(
    operator: httpx.Client, key: str, agent: str | None
) -> None:
    """Any text as the saga key of the path (encoded as one segment) or as ?agent= is
    answered with a saga, a 404 or a 400, never a 422 or a 5xx."""
    path = quote(key, safe="", errors="surrogatepass")
    query = "" if agent is None else "?agent=" + quote(agent, safe="", errors="surrogatepass")
    answer = operator.get(f"/v1/sagas/{path}{query}")
    assert answer.status_code in (200, 400, 404), answer.text
