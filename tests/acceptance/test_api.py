"""The HTTP API (`outbox api`) as a real subprocess on a real PostgreSQL, over real HTTP:
every status it promises, agent isolation, conditional decisions, long-polling, sagas."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from uuid import UUID, uuid4

import httpx
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api, migrate, resolve, tokens
from outbox.approval import publish_policies_committed
from outbox.budgets import Budget, publish_budgets_committed
from outbox.cli.db import prune_batches
from outbox.contracts import ToolContract
from outbox.db import create_engine
from outbox.models import TokenScope
from outbox.sql.retention import DedupWindows
from outbox.states import State
from tests.acceptance.conftest import clean_environment, run_outbox
from tests.acceptance.test_cli_sagas import compensated_saga
from tests.api_server import ApiServer, api_environment, running_api
from tests.conftest import Databases
from tests.factories import (
    age,
    event_count,
    events_of,
    make_operation,
    mark_published,
    operation_count,
    reload,
)
from tests.integration.test_sagas import THREE, open_saga
from tests.processes import wait_until
from tests.proxy import database_proxy

pytestmark = pytest.mark.slow

TOOL = "deploy.create_release"
PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def server(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """One `outbox api` for the module, with small limits to reach them cheaply, checking
    tokens on every request (a revocation takes effect at once)."""
    home = tmp_path_factory.mktemp("api")
    env = api_environment(
        database_url,
        home,
        OUTBOX_API_MAX_WAIT="5",
        OUTBOX_API_MAX_BODY_BYTES="8192",
        OUTBOX_MAX_PAYLOAD_BYTES="2048",
        OUTBOX_API_TOKEN_CACHE="0",  # noqa: S106 -- seconds, not a secret
    )
    with running_api(env, home / "api.log") as running:
        yield running


@pytest.fixture
def known_tool(engine: Engine) -> str:
    """A tool the deployment knows, as a worker that loads it would have written it (with the
    sagas' undo tool: an unpublished one is refused once any tool is published)."""
    published = {TOOL, "deploy.delete_release", "lb.point", "chat.post"}  # THREE's tools
    publish_policies_committed(engine, [ToolContract(name=name) for name in sorted(published)])
    return TOOL


def make_token(engine: Engine, name: str, scope: TokenScope) -> str:
    """A new API token, committed."""
    with Session(engine) as session, session.begin():
        return tokens.create_token(session, name=name, scope=scope).token


@pytest.fixture
def agent(server: ApiServer, engine: Engine, known_tool: str) -> Iterator[httpx.Client]:
    """A client holding the agent token `agent-a`."""
    token = make_token(engine, "agent-a", TokenScope.AGENT)
    with httpx.Client(base_url=server.url, headers=_bearer(token), timeout=30) as client:
        yield client


@pytest.fixture
def other_agent(server: ApiServer, engine: Engine) -> Iterator[httpx.Client]:
    """A client holding the agent token `agent-b`."""
    token = make_token(engine, "agent-b", TokenScope.AGENT)
    with httpx.Client(base_url=server.url, headers=_bearer(token), timeout=30) as client:
        yield client


@pytest.fixture
def operator(server: ApiServer, engine: Engine) -> Iterator[httpx.Client]:
    """A client holding the operator token `ops-alice`."""
    token = make_token(engine, "ops-alice", TokenScope.OPERATOR)
    with httpx.Client(base_url=server.url, headers=_bearer(token), timeout=30) as client:
        yield client


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def enqueue(
    client: httpx.Client, key: str | None, *, target: str = "project-a", **body: Any
) -> httpx.Response:
    """POST /v1/operations with ``key`` as Idempotency-Key."""
    headers = {"Idempotency-Key": key} if key is not None else {}
    intent = {"tool": TOOL, "target": target, "payload": {"version": "1.2.3"}} | body
    return client.post("/v1/operations", json=intent, headers=headers)


def assert_problem(response: httpx.Response, status: int, *fragments: str) -> dict[str, Any]:
    """``response`` is an RFC 9457 problem of ``status`` whose detail holds ``fragments``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    problem: dict[str, Any] = response.json()
    assert problem["status"] == status
    assert {"type", "title", "detail"} <= problem.keys()
    assert "Traceback" not in response.text
    for fragment in fragments:
        assert fragment in problem["detail"], problem["detail"]
    return problem


# --- enqueue ----------------------------------------------------------------------------------


def test_a_new_intent_is_201_with_its_location_and_etag(agent: httpx.Client) -> None:
    """POST with a new key answers 201, Location, ETag "planned.0", requested_by the token."""
    done = enqueue(agent, "release-1")
    assert done.status_code == 201, done.text
    op = done.json()
    assert done.headers["location"] == f"/v1/operations/{op['id']}"
    assert done.headers["etag"] == '"planned.0"'
    assert (op["intent_key"], op["state"], op["requested_by"]) == (
        "release-1",
        "planned",
        "agent-a",
    )


def test_the_callers_trace_context_headers_are_recorded_with_the_operation(
    agent: httpx.Client,
) -> None:
    """traceparent and tracestate headers are stored with a new operation; an invalid
    traceparent is ignored (W3C), and without one nothing is recorded."""
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    traced = agent.post(
        "/v1/operations",
        json={"tool": TOOL, "target": "project-a", "payload": {"version": "1.2.3"}},
        headers={"Idempotency-Key": "traced", "traceparent": traceparent, "tracestate": "k=v"},
    )
    assert traced.status_code == 201, traced.text
    assert (traced.json()["traceparent"], traced.json()["tracestate"]) == (traceparent, "k=v")
    invalid = agent.post(
        "/v1/operations",
        json={"tool": TOOL, "target": "project-a", "payload": {"version": "1.2.4"}},
        headers={"Idempotency-Key": "traced-badly", "traceparent": "00-nonsense"},
    )
    assert invalid.status_code == 201, invalid.text
    assert (invalid.json()["traceparent"], invalid.json()["tracestate"]) == (None, None)
    assert enqueue(agent, "untraced").json()["traceparent"] is None


def test_an_intent_over_its_budget_is_a_429_problem_and_writes_nothing(
    agent: httpx.Client, other_agent: httpx.Client, engine: Engine
) -> None:
    """Over its tool's budget an intent answers 429 budget-exceeded naming the budget, its
    window and what is left, writes nothing, and leaves another token's budget alone."""
    budget = Budget(name="releases", tools=(TOOL,), window_s=3600, max_operations=1)
    publish_budgets_committed(engine, [budget])
    assert enqueue(agent, "b-1").status_code == 201
    problem = assert_problem(enqueue(agent, "b-2", target="project-b"), 429, "'releases'")
    assert problem["type"] == "urn:agent-outbox:problem:budget-exceeded"
    assert (problem["budget"], problem["key"], problem["window_s"]) == ("releases", "agent-a", 3600)
    assert (problem["limit"], problem["used"], problem["remaining"]) == (1, 1, 0)
    assert enqueue(agent, "b-1").status_code == 200  # the same intent again: never refused
    assert enqueue(other_agent, "b-3").status_code == 201
    with engine.connect() as conn:
        assert api.find(conn, "b-2") is None


def test_the_same_intent_again_is_200_with_the_same_operation(
    agent: httpx.Client, engine: Engine
) -> None:
    """The same key, tool, target and payload again answers 200 with the first operation."""
    first = enqueue(agent, '"release-2"')  # the draft's quoted form is the same key
    again = enqueue(agent, "release-2")
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    assert operation_count(engine) == 1


def test_the_same_key_with_another_target_is_422_naming_it(
    agent: httpx.Client, engine: Engine
) -> None:
    """The same key with another target is 422 naming `target`; nothing is written."""
    enqueue(agent, "release-3")
    problem = assert_problem(enqueue(agent, "release-3", target="project-b"), 422, "target")
    assert (problem["field"], problem["differences"]) == ("target", ["target"])
    assert operation_count(engine) == 1


def test_no_idempotency_key_is_400(agent: httpx.Client, engine: Engine) -> None:
    """Without an Idempotency-Key the answer is 400 naming the header; nothing is written."""
    problem = assert_problem(enqueue(agent, None), 400, "Idempotency-Key")
    assert problem["field"] == "Idempotency-Key"
    assert operation_count(engine) == 0


def test_an_empty_idempotency_key_is_400_naming_the_header(
    agent: httpx.Client, engine: Engine
) -> None:
    """An empty key, bare or quoted, names no effect: 400 naming the header; nothing written."""
    for empty in ("", '""', '" "'):
        problem = assert_problem(enqueue(agent, empty), 400, "Idempotency-Key")
        assert (problem["field"], problem["type"]) == (
            "Idempotency-Key",
            "urn:agent-outbox:problem:idempotency-key-missing",
        )
    assert operation_count(engine) == 0


def test_a_too_long_idempotency_key_is_422_naming_the_header(
    agent: httpx.Client, engine: Engine
) -> None:
    """A key over 255 characters is 422 naming the header (not the core's intent_key)."""
    problem = assert_problem(enqueue(agent, "k" * 256), 422, "Idempotency-Key", "255")
    assert (problem["field"], problem["limit"], problem["size"]) == ("Idempotency-Key", 255, 256)
    assert enqueue(agent, "k" * 255).status_code == 201
    assert operation_count(engine) == 1


def test_malformed_json_is_400(agent: httpx.Client) -> None:
    """A body that is not JSON is a 400 problem."""
    sent = agent.post(
        "/v1/operations",
        content=b'{"tool": "deploy.create_release",',
        headers={"Idempotency-Key": "k", "Content-Type": "application/json"},
    )
    problem = assert_problem(sent, 400, "not valid JSON")
    assert problem["type"] == "urn:agent-outbox:problem:malformed-json"


def test_a_body_that_is_not_json_is_415_and_writes_nothing(
    agent: httpx.Client, operator: httpx.Client, engine: Engine, known_tool: str
) -> None:
    """A /v1 body sent as text or a form is 415 naming its media type (even when the text is
    JSON), nothing written; application/json with a charset and a +json type are accepted."""
    body = json.dumps({"tool": known_tool, "target": "web", "payload": {"version": "1"}})
    for media in ("text/plain", "application/x-www-form-urlencoded", "application/xml"):
        sent = agent.post(
            "/v1/operations",
            content=body.encode(),
            headers={"Idempotency-Key": f"k-{media}", "Content-Type": media},
        )
        problem = assert_problem(sent, 415, media, "application/json")
        assert problem["type"] == "urn:agent-outbox:problem:unsupported-media-type"
        assert sent.headers["accept-post"] == "application/json"
    assert operation_count(engine) == 0
    op_id = uuid4()
    decided = operator.post(
        f"/v1/operations/{op_id}/reject",
        content=b"reason=no",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert_problem(decided, 415)
    for media in ("application/json; charset=utf-8", "application/merge-patch+json"):
        sent = agent.post(
            "/v1/operations",
            content=body.encode(),
            headers={"Idempotency-Key": f"k-{media}", "Content-Type": media},
        )
        assert sent.status_code == 201, sent.text
    assert operation_count(engine) == 2


def test_json_nested_too_deeply_to_parse_is_a_400_malformed_json_problem(
    agent: httpx.Client, engine: Engine
) -> None:
    """A body whose decoding fails beyond a syntax error (nesting past the parser's depth) is
    the same 400 malformed-json problem; nothing is written."""
    depth = 3000
    nested = "[" * depth + "]" * depth
    body = f'{{"tool": "{TOOL}", "target": "t", "payload": {{"a": {nested}}}}}'
    sent = agent.post(
        "/v1/operations",
        content=body.encode(),
        headers={"Idempotency-Key": "deep", "Content-Type": "application/json"},
    )
    problem = assert_problem(sent, 400, "JSON")
    assert problem["type"] == "urn:agent-outbox:problem:malformed-json"
    assert operation_count(engine) == 0


def test_an_unknown_tool_is_422_naming_the_tool(agent: httpx.Client, engine: Engine) -> None:
    """A tool no worker registered is 422 with field `tool`; nothing is written."""
    problem = assert_problem(enqueue(agent, "k", tool="mail.send"), 422, "unknown tool 'mail.send'")
    assert problem["field"] == "tool"
    assert operation_count(engine) == 0


def test_a_wrongly_typed_member_is_422_naming_it(agent: httpx.Client) -> None:
    """A payload that is not an object is a 422 problem naming `payload`."""
    problem = assert_problem(enqueue(agent, "k", payload=[1, 2]), 422, "payload")
    assert problem["field"] == "payload"


def test_a_body_over_the_limit_is_413(agent: httpx.Client, engine: Engine) -> None:
    """A body over OUTBOX_API_MAX_BODY_BYTES is 413 before anything is read or written."""
    big = enqueue(agent, "k", payload={"blob": "x" * 10_000})
    assert_problem(big, 413, "OUTBOX_API_MAX_BODY_BYTES")
    assert operation_count(engine) == 0


def test_a_payload_over_its_limit_is_413_naming_it(agent: httpx.Client, engine: Engine) -> None:
    """A payload over OUTBOX_MAX_PAYLOAD_BYTES (in a body under the limit) is 413 `payload`."""
    problem = assert_problem(
        enqueue(agent, "k", payload={"blob": "x" * 4000}), 413, "OUTBOX_MAX_PAYLOAD_BYTES"
    )
    assert (problem["field"], problem["limit"]) == ("payload", 2048)
    assert operation_count(engine) == 0


# --- auth -------------------------------------------------------------------------------------


def test_no_token_is_401_with_a_challenge(server: ApiServer, engine: Engine) -> None:
    """Without a bearer token every /v1 route answers 401 with WWW-Authenticate."""
    for response in (
        httpx.get(f"{server.url}/v1/operations"),
        httpx.post(f"{server.url}/v1/operations", json={}),
        httpx.get(f"{server.url}/v1/operations/{uuid4()}"),
    ):
        assert_problem(response, 401, "bearer token")
        assert response.headers["www-authenticate"].startswith("Bearer")


def test_an_unknown_or_revoked_token_is_401(server: ApiServer, engine: Engine) -> None:
    """A token nobody made, and one revoked, are both refused with 401."""
    made = make_token(engine, "short-lived", TokenScope.AGENT)
    url = f"{server.url}/v1/operations"
    assert httpx.get(url, headers=_bearer(made)).status_code == 200
    with Session(engine) as session, session.begin():
        tokens.revoke_token(session, "short-lived")
    assert_problem(httpx.get(url, headers=_bearer(made)), 401, "unknown or revoked")
    assert_problem(httpx.get(url, headers=_bearer("obx_" + "a" * 43)), 401, "unknown or revoked")


#: The /v1 routes only an operator token may call (outbox.web.auth.OperatorRoute).
OPERATOR_ROUTES = {
    "POST /v1/operations/{operation_id}/cancel",
    "POST /v1/operations/{operation_id}/approve",
    "POST /v1/operations/{operation_id}/reject",
    "POST /v1/operations/{operation_id}/resolve",
    "POST /v1/sagas/{key}/cancel",
}

#: Request bodies no route accepts: not JSON at all, and JSON of no route's shape.
MALFORMED_BODIES = (b'{"tool": ', b'{"unexpected": [1]}')


def malformed_requests(server: ApiServer) -> Iterator[tuple[str, httpx.Request]]:
    """For every /v1 operation of the served OpenAPI document, requests that are wrong in
    everything but the credentials: an invalid path parameter, every query parameter invalid,
    no Idempotency-Key, a malformed body (each of MALFORMED_BODIES)."""
    document = httpx.get(f"{server.url}/openapi.json").json()
    for path, operations in document["paths"].items():
        if not path.startswith("/v1/"):
            continue
        for method, operation in operations.items():
            # A NUL is refused in every text member (outbox.web.models.Text).
            url = server.url + path.replace("{operation_id}", "not-a-uuid").replace("{key}", "k%00")
            query = {
                parameter["name"]: "not-valid\x00"
                for parameter in operation.get("parameters", [])
                if parameter["in"] == "query"
            }
            bodies = MALFORMED_BODIES if "requestBody" in operation else (None,)
            for body in bodies:
                request = httpx.Request(
                    method.upper(),
                    url,
                    params=query,
                    content=body,
                    headers={"Content-Type": "application/json"} if body else {},
                )
                yield f"{method.upper()} {path}", request


def _send(request: httpx.Request, token: str | None) -> httpx.Response:
    if token is not None:
        request.headers["Authorization"] = f"Bearer {token}"
    with httpx.Client(timeout=30) as client:
        return client.send(request)


@pytest.mark.parametrize("credentials", ["none", "unknown", "revoked"])
def test_credentials_are_checked_before_the_request_is_parsed(
    server: ApiServer, engine: Engine, credentials: str
) -> None:
    """Without a live token, every /v1 route answers 401 with the challenge, however malformed
    its path, query and body, which an operator's token shows are refused otherwise."""
    operator = make_token(engine, "ops-checker", TokenScope.OPERATOR)
    token = {"none": None, "unknown": "obx_" + "a" * 43}.get(credentials)
    if credentials == "revoked":
        token = make_token(engine, "short-lived", TokenScope.AGENT)
        with Session(engine) as session, session.begin():
            tokens.revoke_token(session, "short-lived")
    requests = list(malformed_requests(server))
    assert len({route for route, _ in requests}) >= 12
    wrong = []
    for route, request in requests:
        refused = _send(request, token)
        if (refused.status_code, refused.headers.get("www-authenticate", "")[:6]) != (
            401,
            "Bearer",
        ):
            wrong.append((route, request.content, refused.status_code, refused.text[:120]))
        else:
            assert_problem(refused, 401, "bearer token")
        malformed = _send(request, operator).status_code
        assert malformed in {400, 422}, (route, request.content, malformed)
    assert wrong == []


def test_an_agent_token_on_an_operator_route_is_403_before_the_request_is_parsed(
    server: ApiServer, engine: Engine
) -> None:
    """An agent's token gets 403 from every operator-only route however malformed the request,
    and the routes it may call answer the same request with 400 or 422."""
    agent = make_token(engine, "agent-x", TokenScope.AGENT)
    requests = list(malformed_requests(server))
    assert {route for route, _ in requests} >= OPERATOR_ROUTES
    wrong = []
    for route, request in requests:
        answer = _send(request, agent)
        expected = {403} if route in OPERATOR_ROUTES else {400, 422}
        if answer.status_code not in expected:
            wrong.append((route, request.content, answer.status_code, answer.text[:120]))
        elif answer.status_code == 403:
            assert_problem(answer, 403, "agent scope")
    assert wrong == []


def test_an_agent_token_cannot_decide(agent: httpx.Client, engine: Engine) -> None:
    """An agent's approve, reject, resolve and cancel are 403; nothing changes."""
    op = make_operation(engine, State.AWAITING_APPROVAL)
    bodies = {
        "approve": {"payload_hash": op.payload_hash},
        "reject": {"reason": "no"},
        "resolve": {"applied": True, "remote_ref": "r", "note": "n"},
        "cancel": {},
    }
    for action, body in bodies.items():
        assert_problem(agent.post(f"/v1/operations/{op.id}/{action}", json=body), 403, "agent")
    assert reload(engine, op.id).state is State.AWAITING_APPROVAL


def test_an_agent_reads_only_its_own_operations(
    agent: httpx.Client, other_agent: httpx.Client, operator: httpx.Client
) -> None:
    """Another agent's operation is 404 to read, absent from lists; an operator sees both."""
    mine = enqueue(agent, "mine").json()
    theirs = enqueue(other_agent, "theirs", target="project-b").json()
    assert agent.get(f"/v1/operations/{mine['id']}").status_code == 200
    assert_problem(agent.get(f"/v1/operations/{theirs['id']}"), 404, str(theirs["id"]))
    assert_problem(agent.get(f"/v1/operations/{theirs['id']}/events"), 404)
    assert [op["id"] for op in agent.get("/v1/operations").json()["items"]] == [mine["id"]]
    listed = agent.get("/v1/operations", params={"intent_key": "theirs"}).json()
    assert listed["items"] == []
    seen = {op["id"] for op in operator.get("/v1/operations").json()["items"]}
    assert seen == {mine["id"], theirs["id"]}


def test_the_same_key_from_two_agents_is_two_operations(
    agent: httpx.Client, other_agent: httpx.Client, engine: Engine
) -> None:
    """Two agents sending one key and one intent each get their own operation (201), and
    their own again (200)."""
    mine, theirs = enqueue(agent, "shared-key"), enqueue(other_agent, "shared-key")
    assert (mine.status_code, theirs.status_code) == (201, 201), (mine.text, theirs.text)
    assert mine.json()["id"] != theirs.json()["id"]
    assert (mine.json()["agent"], theirs.json()["agent"]) == ("agent-a", "agent-b")
    again = enqueue(other_agent, "shared-key")
    assert (again.status_code, again.json()["id"]) == (200, theirs.json()["id"])
    assert operation_count(engine) == 2


def test_another_agents_key_answers_as_a_key_nobody_used(
    agent: httpx.Client, other_agent: httpx.Client, engine: Engine
) -> None:
    """What agent b gets for a key agent a used (the same intent, another payload, a's
    operation finished and pruned) is what it gets for a fresh key: 201, the same headers,
    b's own operation, nothing of a's; a's own retry of its pruned key is already done."""
    same = enqueue(agent, "k-same").json()
    other = enqueue(agent, "k-other", payload={"version": "9.9.9"}).json()
    done = make_operation(
        engine,
        State.CONFIRMED,
        intent_key="k-pruned",
        payload={"version": "1.2.3"},
        agent="agent-a",
    )
    age(engine, done.id, 40 * 86400, "resolved_at", "updated_at", "created_at")
    windows = DedupWindows({TOOL: None})
    assert sum(prune_batches(engine, older_than_s=86400, batch_size=10, windows=windows)) == 1
    fresh = enqueue(other_agent, "k-fresh")
    secrets = [same["id"], other["id"], str(done.id), "agent-a", "rel-1"]
    for key in ("k-same", "k-other", "k-pruned"):
        theirs = enqueue(other_agent, key)
        assert theirs.status_code == fresh.status_code == 201, theirs.text
        assert sorted(theirs.headers) == sorted(fresh.headers)
        assert theirs.json()["agent"] == "agent-b"
        for secret in secrets:
            assert secret not in theirs.text
            assert secret not in str(theirs.headers)
    assert_problem(enqueue(agent, "k-pruned"), 409, str(done.id))


def test_a_new_token_of_the_same_agent_keeps_its_keys(
    server: ApiServer, agent: httpx.Client, engine: Engine
) -> None:
    """A rotation: a token made for agent-a under another name, the first one revoked, gets
    agent-a's operation back for its key, reads it and lists it."""
    first = enqueue(agent, "rotated-key").json()
    with Session(engine) as session, session.begin():
        rotated = tokens.create_token(
            session, name="agent-a-2026-12", scope=TokenScope.AGENT, agent="agent-a"
        ).token
        tokens.revoke_token(session, "agent-a")
    assert_problem(agent.get(f"/v1/operations/{first['id']}"), 401)
    with httpx.Client(base_url=server.url, headers=_bearer(rotated), timeout=30) as client:
        again = enqueue(client, "rotated-key")
        assert (again.status_code, again.json()["id"]) == (200, first["id"])
        assert client.get(f"/v1/operations/{first['id']}").status_code == 200
        listed = client.get("/v1/operations").json()["items"]
        assert [op["id"] for op in listed] == [first["id"]]
        made = enqueue(client, "after-rotation").json()
    assert (made["agent"], made["requested_by"]) == ("agent-a", "agent-a-2026-12")


def test_two_agents_racing_one_key_each_get_their_own_one_operation(
    agent: httpx.Client, other_agent: httpx.Client, engine: Engine
) -> None:
    """Twelve concurrent requests per agent with one key: one 201 and eleven 200s per agent,
    every answer its own agent's single operation, two operations in all."""
    barrier = threading.Barrier(24)

    def one(client: httpx.Client) -> httpx.Response:
        barrier.wait()
        return enqueue(client, "raced-key")

    with ThreadPoolExecutor(24) as pool:
        answers = list(pool.map(one, [agent, other_agent] * 12))
    for who in ("agent-a", "agent-b"):
        own = [r for r in answers if r.json()["agent"] == who]
        assert len(own) == 12
        assert sorted(r.status_code for r in own) == [200] * 11 + [201]
        assert len({r.json()["id"] for r in own}) == 1
    assert operation_count(engine) == 2


# --- read, list, events -----------------------------------------------------------------------


def test_an_unknown_id_is_404_and_an_unknown_route_a_404_problem(operator: httpx.Client) -> None:
    """A well-formed id nobody has is 404; so is a route that does not exist, as a problem."""
    assert_problem(operator.get(f"/v1/operations/{uuid4()}"), 404, "no operation")
    assert_problem(operator.get("/v2/nothing"), 404, "/v2/nothing")
    assert_problem(operator.get("/v1/operations/not-a-uuid"), 422, "operation_id")


def test_pages_follow_the_cursor_newest_first(agent: httpx.Client) -> None:
    """limit=2 over five operations gives pages of 2, 2 and 1, newest first, none twice."""
    made = [enqueue(agent, f"page-{n}").json()["id"] for n in range(5)]
    seen: list[str] = []
    cursor = None
    for _ in range(5):
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = agent.get("/v1/operations", params=params).json()
        seen += [op["id"] for op in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(made))


def test_a_foreign_cursor_is_400(agent: httpx.Client) -> None:
    """A cursor this API did not give is 400 naming `cursor`."""
    problem = assert_problem(agent.get("/v1/operations", params={"cursor": "!!"}), 400, "cursor")
    assert problem["field"] == "cursor"


def test_filters_select_by_state_tool_target_and_key(
    operator: httpx.Client, engine: Engine
) -> None:
    """state, tool, target and intent_key each narrow the list to what matches."""
    planned = make_operation(engine, target="t-1")
    failed = make_operation(engine, State.FAILED, target="t-2", intent_key="k-2")

    def ids(**params: str) -> list[str]:
        return [op["id"] for op in operator.get("/v1/operations", params=params).json()["items"]]

    assert ids(state="failed") == [str(failed.id)]
    assert ids(target="t-1") == [str(planned.id)]
    assert ids(intent_key="k-2", tool=TOOL) == [str(failed.id)]
    assert ids(tool="other.tool") == []


def test_events_are_the_audit_trail(agent: httpx.Client) -> None:
    """GET …/events lists the operation's moves, oldest first."""
    op = enqueue(agent, "trail").json()
    trail = agent.get(f"/v1/operations/{op['id']}/events").json()["items"]
    assert [(e["from_state"], e["to_state"], e["actor"]) for e in trail] == [
        (None, "planned", "agent")
    ]


# --- long-poll --------------------------------------------------------------------------------


def test_a_long_poll_returns_when_the_operation_settles(
    operator: httpx.Client, engine: Engine
) -> None:
    """GET ?wait=S on an unknown operation answers with it confirmed once it is resolved."""
    op = make_operation(engine, State.UNKNOWN)
    answers: list[httpx.Response] = []
    poll = threading.Thread(
        target=lambda: answers.append(operator.get(f"/v1/operations/{op.id}", params={"wait": 5}))
    )
    poll.start()
    wait_until(lambda: _waiting_on(engine, op.id), timeout=10, what="the long-poll's waiter")
    with Session(engine) as session, session.begin():
        resolve(session, op.id, applied=True, remote_ref="rel-7", by="test", note="found it")
    poll.join(timeout=30)
    assert answers[0].status_code == 200
    assert answers[0].json()["state"] == "confirmed"
    assert answers[0].headers["etag"] == f'"confirmed.{op.attempts}"'


def _waiting_on(engine: Engine, operation_id: object) -> bool:
    with engine.connect() as conn:
        found = conn.execute(
            text("SELECT count(*) FROM outbox.waiters WHERE operation_id = :id"),
            {"id": operation_id},
        )
        return bool(found.scalar_one())


def test_a_long_poll_that_runs_out_answers_the_operation_as_it_is(
    agent: httpx.Client,
) -> None:
    """?wait on an operation nobody moves answers it still planned once S has passed."""
    op = enqueue(agent, "never-moves").json()
    late = agent.get(f"/v1/operations/{op['id']}", params={"wait": 0.3})
    assert (late.status_code, late.json()["state"]) == (200, "planned")


# --- decisions --------------------------------------------------------------------------------


def test_approve_plans_it_and_records_the_token_as_decider(
    operator: httpx.Client, engine: Engine
) -> None:
    """approve with the payload hash plans it; decided_by is the token's name."""
    op = make_operation(engine, State.AWAITING_APPROVAL)
    done = operator.post(
        f"/v1/operations/{op.id}/approve",
        json={"payload_hash": op.payload_hash, "note": "read it"},
        headers={"If-Match": '"awaiting_approval.0"'},
    )
    assert done.status_code == 200, done.text
    assert (done.json()["state"], done.json()["decided_by"]) == ("planned", "ops-alice")
    assert done.headers["etag"] == '"planned.0"'


def test_approve_with_another_hash_is_409(operator: httpx.Client, engine: Engine) -> None:
    """A hash that is not the stored payload's is 409 and changes nothing."""
    op = make_operation(engine, State.AWAITING_APPROVAL)
    wrong = operator.post(f"/v1/operations/{op.id}/approve", json={"payload_hash": "a" * 64})
    assert_problem(wrong, 409, "payload hash mismatch")
    assert reload(engine, op.id).state is State.AWAITING_APPROVAL


def test_reject_cancels_it(operator: httpx.Client, engine: Engine) -> None:
    """reject with a reason cancels it, decided by the token's name."""
    op = make_operation(engine, State.AWAITING_APPROVAL)
    done = operator.post(f"/v1/operations/{op.id}/reject", json={"reason": "wrong project"})
    assert (done.status_code, done.json()["state"]) == (200, "cancelled")
    assert reload(engine, op.id).decided_by == "ops-alice"


def test_a_missing_member_of_a_decision_is_422(operator: httpx.Client, engine: Engine) -> None:
    """reject without a reason is a 422 problem naming `reason`."""
    op = make_operation(engine, State.AWAITING_APPROVAL)
    problem = assert_problem(operator.post(f"/v1/operations/{op.id}/reject", json={}), 422)
    assert problem["field"] == "reason"


def test_resolve_applied_confirms_it_under_if_match(operator: httpx.Client, engine: Engine) -> None:
    """resolve applied with the ETag confirms it; the event names the token as resolver."""
    op = make_operation(engine, State.NEEDS_HUMAN)
    etag = operator.get(f"/v1/operations/{op.id}").headers["etag"]
    assert etag == f'"needs_human.{op.attempts}"'
    done = operator.post(
        f"/v1/operations/{op.id}/resolve",
        json={"applied": True, "remote_ref": "rel-42", "note": "in the remote's console"},
        headers={"If-Match": etag},
    )
    assert done.status_code == 200, done.text
    assert (done.json()["state"], done.json()["remote_ref"]) == ("confirmed", "rel-42")
    last = events_of(engine, op.id)[-1]
    assert last.detail is not None
    assert last.detail["by"] == "ops-alice"


def test_resolving_an_operation_awaiting_approval_is_409_saying_approve_or_reject(
    operator: httpx.Client, engine: Engine
) -> None:
    """resolve on an operation awaiting approval is a 409 problem naming approve and reject,
    and nothing is written."""
    op = make_operation(engine, State.AWAITING_APPROVAL)
    events_before = event_count(engine, op.id)
    verdict = {"applied": True, "remote_ref": "rel-1", "note": "n"}
    refused = operator.post(f"/v1/operations/{op.id}/resolve", json=verdict)
    problem = assert_problem(refused, 409, "awaiting_approval", f"/v1/operations/{op.id}/approve")
    assert f"--payload-hash {op.payload_hash}" in problem["detail"]
    assert "/reject" in problem["detail"]
    assert reload(engine, op.id) == op
    assert event_count(engine, op.id) == events_before


def _refused_until_the_horizon_passes(
    operator: httpx.Client, engine: Engine, op_id: UUID, verdict: dict[str, Any]
) -> None:
    """``verdict`` (not applied) is a 409 horizon-not-passed problem with a Retry-After while
    a request of the last attempt could still land, writing nothing; then the last send is
    moved that far (and a second) into the past, as if the operator had waited."""
    before, events_before = reload(engine, op_id), event_count(engine, op_id)
    etag = {"If-Match": f'"{before.state.value}.{before.attempts}"'}
    early = operator.post(f"/v1/operations/{op_id}/resolve", json=verdict, headers=etag)
    problem = assert_problem(early, 409, "in-flight horizon", "try again in")
    assert problem["type"] == "urn:agent-outbox:problem:horizon-not-passed"
    wait_s = int(early.headers["retry-after"])
    assert wait_s > 0
    assert (reload(engine, op_id), event_count(engine, op_id)) == (before, events_before)
    # Both by the same amount: the schema checks first_sent_at <= sent_at.
    age(engine, op_id, wait_s + 1, "sent_at", "first_sent_at")


def test_resolve_not_applied_fails_it_once_the_horizon_has_passed(
    operator: httpx.Client, engine: Engine
) -> None:
    """resolve not applied is refused inside the in-flight horizon; past it, it fails the
    operation, clears maybe_applied, keeps the note as last error, the token as resolver."""
    op = make_operation(engine, State.NEEDS_HUMAN)
    assert op.maybe_applied
    note = "no release 1.2.3 in the remote's list"
    verdict = {"applied": False, "note": note}
    _refused_until_the_horizon_passes(operator, engine, op.id, verdict)
    done = operator.post(
        f"/v1/operations/{op.id}/resolve",
        json=verdict,
        headers={"If-Match": f'"needs_human.{op.attempts}"'},
    )
    assert done.status_code == 200, done.text
    assert done.headers["etag"] == f'"failed.{op.attempts}"'
    body = done.json()
    assert (body["state"], body["maybe_applied"], body["last_error"], body["remote_ref"]) == (
        "failed",
        False,
        note,
        None,
    )
    now = reload(engine, op.id)
    assert (now.state, now.maybe_applied, now.attempts) == (State.FAILED, False, op.attempts)
    assert now.resolved_at is not None
    last = events_of(engine, op.id)[-1]
    assert (last.from_state, last.to_state, last.actor, last.attempt) == (
        State.NEEDS_HUMAN,
        State.FAILED,
        "operator",
        op.attempts,
    )
    assert last.detail == {
        "by": "ops-alice",
        "note": note,
        "forced": False,
        "applied": False,
        "replay": False,
    }


def test_resolve_replay_plans_the_same_operation_again(
    operator: httpx.Client, engine: Engine
) -> None:
    """resolve not applied with replay, once the horizon has passed, moves it back to planned:
    the same id, key, payload and hash, unpublished and due at once, the token as resolver."""
    op = make_operation(engine, State.UNKNOWN)
    mark_published(engine, op.id)  # stale from its first trip through the relay
    verdict = {"applied": False, "replay": True, "note": "the remote never got it"}
    _refused_until_the_horizon_passes(operator, engine, op.id, verdict)
    done = operator.post(
        f"/v1/operations/{op.id}/resolve",
        json=verdict,
        headers={"If-Match": f'"unknown.{op.attempts}"'},
    )
    assert done.status_code == 200, done.text
    assert done.headers["etag"] == f'"planned.{op.attempts}"'
    body = done.json()
    assert (body["state"], body["published_at"], body["maybe_applied"], body["resolved_at"]) == (
        "planned",
        None,
        False,
        None,
    )
    now = reload(engine, op.id)
    assert (now.id, now.intent_key, now.payload, now.payload_hash, now.attempts) == (
        op.id,
        op.intent_key,
        op.payload,
        op.payload_hash,
        op.attempts,
    )
    assert (now.state, now.published_at, now.replay_deadline) == (State.PLANNED, None, None)
    with engine.connect() as conn:
        due = conn.execute(
            text("SELECT available_at <= clock_timestamp() FROM outbox.operations WHERE id = :id"),
            {"id": op.id},
        ).scalar_one()
    assert due, "a replay authorised by an operator is due at once"
    last = events_of(engine, op.id)[-1]
    assert (last.from_state, last.to_state, last.actor) == (
        State.UNKNOWN,
        State.PLANNED,
        "operator",
    )
    assert last.detail is not None
    assert (last.detail["by"], last.detail["replay"], last.detail["forced"]) == (
        "ops-alice",
        True,
        False,
    )


def test_a_stale_if_match_is_412_with_the_current_etag(
    operator: httpx.Client, engine: Engine
) -> None:
    """If-Match naming another attempt is 412, says the current ETag, changes nothing."""
    op = make_operation(engine, State.NEEDS_HUMAN)
    stale = operator.post(
        f"/v1/operations/{op.id}/resolve",
        json={"applied": True, "remote_ref": "r", "note": "n"},
        headers={"If-Match": f'"needs_human.{op.attempts + 1}"'},
    )
    problem = assert_problem(stale, 412, "nothing was changed")
    assert stale.headers["etag"] == f'"needs_human.{op.attempts}"'
    assert problem["attempts"] == op.attempts
    assert reload(engine, op.id).state is State.NEEDS_HUMAN


def test_two_operators_racing_one_wins_the_other_gets_412(
    server: ApiServer, engine: Engine
) -> None:
    """Two approvals sent at once with the same If-Match: one 200, the other 412."""
    op = make_operation(engine, State.AWAITING_APPROVAL)
    names = ("ops-one", "ops-two")
    clients = [
        httpx.Client(
            base_url=server.url, headers=_bearer(make_token(engine, n, TokenScope.OPERATOR))
        )
        for n in names
    ]
    start = threading.Barrier(2)
    statuses: dict[str, int] = {}

    def approve(name: str, client: httpx.Client) -> None:
        start.wait(timeout=10)
        statuses[name] = client.post(
            f"/v1/operations/{op.id}/approve",
            json={"payload_hash": op.payload_hash},
            headers={"If-Match": '"awaiting_approval.0"'},
        ).status_code

    threads = [
        threading.Thread(target=approve, args=pair) for pair in zip(names, clients, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    for client in clients:
        client.close()
    assert sorted(statuses.values()) == [200, 412]
    winner = next(name for name, status in statuses.items() if status == 200)
    assert reload(engine, op.id).decided_by == winner


def test_cancel_of_a_planned_operation_cancels_it(operator: httpx.Client, engine: Engine) -> None:
    """cancel of a planned operation cancels it, naming the token in the reason."""
    op = make_operation(engine)
    done = operator.post(f"/v1/operations/{op.id}/cancel", json={"reason": "not needed"})
    assert (done.status_code, done.json()["state"]) == (200, "cancelled")
    assert events_of(engine, op.id)[-1].reason == "cancelled by ops-alice: not needed"


def test_cancel_of_a_sent_operation_is_409(operator: httpx.Client, engine: Engine) -> None:
    """cancel of an operation already sent is 409 and changes nothing."""
    op = make_operation(engine, State.SENT)
    assert_problem(operator.post(f"/v1/operations/{op.id}/cancel"), 409, "cancel")
    assert reload(engine, op.id).state is State.SENT


# --- the process ------------------------------------------------------------------------------


def test_health_readiness_metrics_and_docs(server: ApiServer, engine: Engine) -> None:
    """/healthz and /readyz are 200, /metrics counts requests, /openapi.json is 3.1, /docs up."""
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{server.url}/readyz").json()
    assert (ready["status"], ready["schema_revision"]) == ("ok", ready["head"])
    assert "outbox_api_requests_total" in httpx.get(f"{server.url}/metrics").text
    assert httpx.get(f"{server.url}/openapi.json").json()["openapi"].startswith("3.1")
    assert httpx.get(f"{server.url}/docs").status_code == 200


def test_the_access_log_holds_neither_tokens_nor_payloads(
    server: ApiServer, engine: Engine, known_tool: str
) -> None:
    """After requests carrying a token and a payload, neither appears in the server's log."""
    token = make_token(engine, "log-check", TokenScope.AGENT)
    secret = f"secret-{uuid4().hex}"
    with httpx.Client(base_url=server.url, headers=_bearer(token)) as client:
        assert enqueue(client, "logged", payload={"password": secret}).status_code == 201
    wait_until(lambda: "caller=log-check" in server.logs(), timeout=10, what="the access log")
    assert secret not in server.logs()
    assert token not in server.logs()


def test_a_public_address_without_tls_is_refused(database_url: str) -> None:
    """`outbox api --host 0.0.0.0` without TLS or --behind-proxy exits 2 with one line."""
    env = clean_environment(OUTBOX_DATABASE_URL=database_url)
    done = run_outbox("api", "--host", "0.0.0.0", env=env)  # noqa: S104 -- refused, the point
    assert done.code == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "--behind-proxy" in lines[0]


def test_a_nul_character_is_422_naming_the_member(agent: httpx.Client, engine: Engine) -> None:
    """A target holding NUL (which PostgreSQL cannot store) is 422 naming `target`."""
    problem = assert_problem(enqueue(agent, "k", target="a\x00b"), 422, "NUL")
    assert problem["field"] == "target"
    assert operation_count(engine) == 0


def test_a_public_address_behind_a_proxy_is_served(database_url: str, tmp_path: Path) -> None:
    """`--host 0.0.0.0 --behind-proxy` starts, and answers over plain HTTP."""
    env = api_environment(database_url, tmp_path)
    args = ("--host", "0.0.0.0", "--behind-proxy")  # noqa: S104 -- the point of the test
    with running_api(env, tmp_path / "api.log", *args) as running:
        assert running.url.startswith("http://0.0.0.0:")
        assert httpx.get(f"{running.url}/readyz").status_code == 200


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificate")
def test_a_public_address_with_tls_serves_https(database_url: str, tmp_path: Path) -> None:
    """`--host 0.0.0.0 --tls-cert --tls-key` starts and answers over HTTPS."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    env = api_environment(database_url, tmp_path)
    args = ("--host", "0.0.0.0", "--tls-cert", str(cert), "--tls-key", str(key))  # noqa: S104 -- idem
    with running_api(env, tmp_path / "api.log", *args, verify=False) as running:
        assert running.url.startswith("https://")
        assert httpx.get(f"{running.url}/healthz", verify=False).status_code == 200  # noqa: S501


def test_readyz_is_503_when_the_schema_is_not_at_head(databases: Databases, tmp_path: Path) -> None:
    """Once the schema is no longer at head, /readyz answers 503 naming both revisions."""
    url = databases.create()
    own = create_engine(url)
    try:
        migrate.upgrade(own)
        env = api_environment(url, tmp_path)
        with running_api(env, tmp_path / "api.log") as running:
            assert httpx.get(f"{running.url}/readyz").status_code == 200
            with own.begin() as conn:
                conn.execute(text("UPDATE outbox.alembic_version SET version_num = '0012'"))
            problem = assert_problem(httpx.get(f"{running.url}/readyz"), 503, "0012", "upgrade")
            assert (problem["schema_revision"], problem["head"]) == ("0012", migrate.head())
            assert httpx.get(f"{running.url}/healthz").status_code == 200
    finally:
        own.dispose()


def test_readyz_and_v1_are_503_while_the_database_is_unreachable(
    database_url: str, engine: Engine, known_tool: str, tmp_path: Path
) -> None:
    """With the database cut off (a TCP proxy reset), /readyz is 503 `database: unreachable`,
    /healthz still 200, and /v1 reads and enqueues 503 `unavailable` problems (no stack trace,
    nothing written); once it is back, all answer again."""
    proxy, through = database_proxy(database_url)
    token = make_token(engine, "cut-off", TokenScope.AGENT)
    env = api_environment(
        through,
        tmp_path,
        OUTBOX_API_TOKEN_CACHE="0",  # noqa: S106 -- seconds, not a secret
    )
    try:
        with (
            running_api(env, tmp_path / "api.log") as running,
            httpx.Client(base_url=running.url, headers=_bearer(token), timeout=30) as client,
        ):
            assert client.get("/readyz").status_code == 200
            assert enqueue(client, "before").status_code == 201
            proxy.cut()
            problem = assert_problem(client.get("/readyz"), 503, "cannot be reached")
            assert (problem["type"], problem["database"]) == (
                "urn:agent-outbox:problem:not-ready",
                "unreachable",
            )
            assert client.get("/healthz").status_code == 200
            for answer in (client.get("/v1/operations"), enqueue(client, "during")):
                assert_problem(answer, 503, "cannot be reached")
                assert answer.headers["retry-after"] == "1"
            proxy.restore()
            wait_until(
                lambda: client.get("/readyz").status_code == 200, timeout=30, what="/readyz again"
            )
            assert enqueue(client, "after").status_code == 201
        logs = running.logs()
        assert "Traceback" not in logs
        assert "path=/v1/operations status=503" in logs  # the access log has the real status
    finally:
        proxy.stop()
    with engine.connect() as conn:
        assert api.find(conn, "during") is None
    assert operation_count(engine) == 2


# --- sagas ------------------------------------------------------------------------------------


def test_an_operator_reads_a_saga_and_lists_sagas_by_state(
    operator: httpx.Client, engine: Engine
) -> None:
    """GET /v1/sagas/{key} (a key may hold a slash) is the saga with its steps in order and
    its trail; GET /v1/sagas lists newest first, filtered by state."""
    compensated_saga(engine, "s-api")
    open_saga(engine, "team-a/s-api running", THREE[:1], requested_by="agent-a")
    read = operator.get("/v1/sagas/s-api")
    assert read.status_code == 200, read.text
    body = read.json()
    assert (body["key"], body["state"], body["requested_by"]) == ("s-api", "compensated", "agent-7")
    assert [(s["name"], s["state"], s["compensation_state"]) for s in body["steps"]] == [
        ("release", "confirmed", "confirmed"),
        ("point-lb", "confirmed", "confirmed"),
        ("announce", "failed", None),
    ]
    assert body["steps"][0]["compensate"] == {
        "tool": "deploy.delete_release",
        "target": "project-a",
        "payload": {"release": "{remote_ref}", "why": "undo"},
    }
    assert body["events"][0]["to_state"] == "running"
    assert body["events"][-1]["to_state"] == "compensated"
    listed = operator.get("/v1/sagas")
    assert [s["key"] for s in listed.json()["items"]] == ["team-a/s-api running", "s-api"]
    slashed = operator.get("/v1/sagas/team-a%2Fs-api%20running")
    assert (slashed.status_code, slashed.json()["key"]) == (200, "team-a/s-api running")
    only = operator.get("/v1/sagas", params={"state": "compensated"})
    assert [(s["key"], s["steps"]) for s in only.json()["items"]] == [("s-api", 3)]


def test_an_agent_reads_only_the_sagas_it_opened(
    agent: httpx.Client, other_agent: httpx.Client, engine: Engine
) -> None:
    """An agent token reads and lists its own sagas; another's is a 404 like an unknown key."""
    open_saga(engine, "s-mine", THREE[:1], requested_by="agent-a")
    open_saga(engine, "s-theirs", THREE[:1], requested_by="agent-b")
    assert agent.get("/v1/sagas/s-mine").status_code == 200
    problem = assert_problem(agent.get("/v1/sagas/s-theirs"), 404, "no saga 's-theirs'")
    assert problem["type"] == "urn:agent-outbox:problem:saga-not-found"
    assert [s["key"] for s in agent.get("/v1/sagas").json()["items"]] == ["s-mine"]
    assert [s["key"] for s in other_agent.get("/v1/sagas").json()["items"]] == ["s-theirs"]


#: THREE as POST /v1/sagas takes it: an undo is an object.
SAGA_STEPS: list[dict[str, Any]] = [
    {
        key: (
            {"tool": value.tool, "target": value.target, "payload": value.payload}
            if key == "compensate"
            else value
        )
        for key, value in step.items()
    }
    for step in THREE
]


@pytest.fixture
def saga_tools(engine: Engine) -> None:
    """THREE's tools and undo, known to the deployment."""
    names = {s["tool"] for s in SAGA_STEPS} | {"deploy.delete_release"}
    publish_policies_committed(engine, [ToolContract(name=name) for name in sorted(names)])


def _saga_rows(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        sagas_now = conn.execute(text("SELECT count(*) FROM outbox.sagas")).scalar_one()
    return sagas_now, operation_count(engine)


def test_an_agent_declares_a_saga_and_the_same_declaration_again_finds_it(
    agent: httpx.Client, engine: Engine, saga_tools: None
) -> None:
    """POST /v1/sagas: 201 with the saga (its steps in order, the first released, the others
    held, each undo as declared) and its Location, under the token's name; the same body
    again, 200 with the same operations and nothing written."""
    body = {"saga_key": "team-a/release 1.2.3", "steps": SAGA_STEPS}
    created = agent.post("/v1/sagas", json=body)
    assert created.status_code == 201, created.text
    assert created.headers["location"] == "/v1/sagas/team-a%2Frelease%201.2.3"
    saga = created.json()
    assert (saga["key"], saga["state"], saga["requested_by"]) == (
        "team-a/release 1.2.3",
        "running",
        "agent-a",
    )
    assert [(s["name"], s["held"]) for s in saga["steps"]] == [
        ("release", False),
        ("point-lb", True),
        ("announce", True),
    ]
    assert saga["steps"][0]["compensate"] == SAGA_STEPS[0]["compensate"]
    rows = _saga_rows(engine)
    again = agent.post("/v1/sagas", json=body)
    assert again.status_code == 200, again.text
    assert [s["operation_id"] for s in again.json()["steps"]] == [
        s["operation_id"] for s in saga["steps"]
    ]
    assert _saga_rows(engine) == rows
    read = agent.get("/v1/sagas/team-a%2Frelease%201.2.3")
    assert read.json()["steps"] == again.json()["steps"]


def test_a_saga_declared_otherwise_is_refused_naming_what_differs(
    agent: httpx.Client, other_agent: httpx.Client, engine: Engine, saga_tools: None
) -> None:
    """The same key with other steps: 422 naming ``steps`` or the step's field, nothing
    written; another agent's token with the key: a saga of its own (201), nothing of the
    first's in it, and an operator names which with ``?agent=``."""
    assert agent.post("/v1/sagas", json={"saga_key": "s-decl", "steps": SAGA_STEPS}).is_success
    rows = _saga_rows(engine)
    fewer = agent.post("/v1/sagas", json={"saga_key": "s-decl", "steps": SAGA_STEPS[:2]})
    assert assert_problem(fewer, 422, "other steps")["field"] == "steps"
    changed = [SAGA_STEPS[0], {**SAGA_STEPS[1], "payload": {"to": "9.9.9"}}, SAGA_STEPS[2]]
    differs = assert_problem(
        agent.post("/v1/sagas", json={"saga_key": "s-decl", "steps": changed}), 422, "point-lb"
    )
    assert (differs["field"], differs["differences"]) == (
        "steps[1].payload",
        ["steps[1].payload"],
    )
    assert _saga_rows(engine) == rows
    mine = agent.get("/v1/sagas/s-decl").json()
    theirs = other_agent.post("/v1/sagas", json={"saga_key": "s-decl", "steps": SAGA_STEPS[:1]})
    assert theirs.status_code == 201, theirs.text
    body = theirs.json()
    assert (body["agent"], [s["name"] for s in body["steps"]]) == ("agent-b", ["release"])
    for step in mine["steps"]:
        assert step["operation_id"] not in theirs.text
    assert other_agent.get("/v1/sagas/s-decl").json()["steps"] == body["steps"]
    assert agent.get("/v1/sagas/s-decl").json()["steps"] == mine["steps"]


@pytest.mark.parametrize(
    ("steps", "field"),
    [
        ([], "steps"),
        ([{**SAGA_STEPS[0], "tool": "deploy.unknown"}], "steps[0].tool"),
        (
            [{**SAGA_STEPS[0], "compensate": {**SAGA_STEPS[0]["compensate"], "tool": "no.such"}}],
            "steps[0].compensate.tool",
        ),
        ([SAGA_STEPS[0], SAGA_STEPS[0]], "steps[1].name"),
        ([SAGA_STEPS[0], {**SAGA_STEPS[1], "pivot": True}], "steps[1].compensate"),
        ([{**SAGA_STEPS[0], "typo": 1}], "steps[0].typo"),
    ],
)
def test_a_malformed_saga_is_a_422_naming_the_step_and_writes_nothing(
    agent: httpx.Client, engine: Engine, saga_tools: None, steps: list[Any], field: str
) -> None:
    """An empty list, an unknown tool or undo tool, a name given twice, a pivot with an
    undo, an unknown member: 422 naming it; no saga, no operation."""
    problem = assert_problem(
        agent.post("/v1/sagas", json={"saga_key": "s-bad", "steps": steps}), 422
    )
    assert field in json.dumps(problem), problem
    assert _saga_rows(engine) == (0, 0)


def test_a_saga_key_over_its_limit_is_a_422_naming_it(
    agent: httpx.Client, engine: Engine, saga_tools: None
) -> None:
    """A saga key longer than 160 characters (its steps' intent keys must fit): 422
    invalid-request naming saga_key, the limit in the detail; nothing written."""
    body = {"saga_key": "k" * 161, "steps": SAGA_STEPS[:1]}
    problem = assert_problem(agent.post("/v1/sagas", json=body), 422, "at most 160")
    assert (problem["type"], problem["field"]) == (
        "urn:agent-outbox:problem:invalid-request",
        "saga_key",
    )
    assert _saga_rows(engine) == (0, 0)


def test_saga_reads_refuse_bad_input_as_problems(server: ApiServer, operator: httpx.Client) -> None:
    """An unknown key is 404, a bad state or limit 422, a NUL in the key 400 (issue 32), no
    token 401: problem documents."""
    assert_problem(operator.get("/v1/sagas/no-such-saga"), 404, "no saga")
    assert_problem(operator.get("/v1/sagas", params={"state": "done"}), 422)
    assert_problem(operator.get("/v1/sagas", params={"limit": 0}), 422)
    assert_problem(operator.get("/v1/sagas/a%00b"), 400)
    assert_problem(httpx.get(f"{server.url}/v1/sagas", timeout=30), 401)


def test_an_operator_cancels_a_running_saga_once(
    operator: httpx.Client, agent: httpx.Client, engine: Engine
) -> None:
    """POST /v1/sagas/{key}/cancel (operator only): the unsent steps are cancelled and the
    saga compensates under the token's name (here nothing was confirmed: it ends
    cancelled); again, 409 saga-not-running and nothing more."""
    first, second = open_saga(engine, "team-a/s-cancel", THREE[:2], requested_by="agent-a")
    refused = assert_problem(
        agent.post("/v1/sagas/team-a%2Fs-cancel/cancel", json={"reason": "mine"}), 403
    )
    assert "operator" in refused["detail"]
    done = operator.post("/v1/sagas/team-a%2Fs-cancel/cancel", json={"reason": "wrong target"})
    assert done.status_code == 200, done.text
    body = done.json()
    assert body["key"] == "team-a/s-cancel"
    # Nothing was confirmed, so nothing is undone: compensating, then cancelled at once.
    assert body["state"] == "cancelled"
    by_operator = [
        e for e in body["events"] if e["reason"] == "cancelled by ops-alice: wrong target"
    ]
    assert [(e["to_state"], e["actor"]) for e in by_operator] == [("compensating", "operator")]
    assert {reload(engine, op.id).state for op in (first, second)} == {State.CANCELLED}
    again = assert_problem(
        operator.post("/v1/sagas/team-a%2Fs-cancel/cancel", json={"reason": "twice"}),
        409,
        "only a running saga can be cancelled",
    )
    assert again["type"] == "urn:agent-outbox:problem:saga-not-running"
    assert again["saga_key"] == "team-a/s-cancel"
    trail = operator.get("/v1/sagas/team-a%2Fs-cancel").json()["events"]
    assert [e["reason"] for e in trail].count("cancelled by ops-alice: wrong target") == 1


def test_saga_cancel_refuses_bad_input_as_problems(
    server: ApiServer, operator: httpx.Client, engine: Engine
) -> None:
    """No reason or an empty one is 422, an unknown key 404, no token 401; nothing moves."""
    open_saga(engine, "s-cancel-bad", THREE[:1])
    assert_problem(operator.post("/v1/sagas/s-cancel-bad/cancel", json={}), 422)
    assert_problem(operator.post("/v1/sagas/s-cancel-bad/cancel", json={"reason": ""}), 422)
    assert_problem(operator.post("/v1/sagas/s-cancel-bad/cancel", json={"reason": 7}), 422)
    missing = assert_problem(
        operator.post("/v1/sagas/no-such-saga/cancel", json={"reason": "x"}), 404, "no saga"
    )
    assert missing["type"] == "urn:agent-outbox:problem:saga-not-found"
    assert_problem(
        httpx.post(f"{server.url}/v1/sagas/s-cancel-bad/cancel", json={"reason": "x"}, timeout=30),
        401,
    )
    assert operator.get("/v1/sagas/s-cancel-bad").json()["state"] == "running"


def test_sagas_are_listed_in_keyset_pages(operator: httpx.Client, engine: Engine) -> None:
    """GET /v1/sagas pages by next_cursor: every saga once, newest first, even when a saga
    is opened between two pages; a cursor this API did not give is 400 invalid-cursor."""
    for n in range(5):
        open_saga(engine, f"s-page-{n}", THREE[:1], requested_by="agent-a")
    first = operator.get("/v1/sagas", params={"limit": 2}).json()
    assert [s["key"] for s in first["items"]] == ["s-page-4", "s-page-3"]
    open_saga(engine, "s-page-new", THREE[:1])  # newer than every page: never in a later one
    seen = [s["key"] for s in first["items"]]
    cursor = first["next_cursor"]
    while cursor is not None:
        page = operator.get("/v1/sagas", params={"limit": 2, "cursor": cursor}).json()
        seen += [s["key"] for s in page["items"]]
        cursor = page["next_cursor"]
    assert seen == [f"s-page-{n}" for n in (4, 3, 2, 1, 0)]
    assert operator.get("/v1/sagas", params={"limit": 6}).json()["next_cursor"] is not None
    assert operator.get("/v1/sagas", params={"limit": 7}).json()["next_cursor"] is None
    for bad in ("not-a-cursor", "W10", "WyJ4IiwieSJd", "WzEsMl0"):
        problem = assert_problem(
            operator.get("/v1/sagas", params={"cursor": bad}), 400, "cursor is not one"
        )
        assert problem["field"] == "cursor"
