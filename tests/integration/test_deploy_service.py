"""The reference remote service over real HTTP: releases, rollbacks, dedup, lookups, faults,
its CLI."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from outbox.dev.service import DeployService
from outbox.dev.tool_config import ROLLBACK_TOOL, rollback_tool_toml
from outbox.tools import Applied, NotApplied, Rejected, ToolCall
from outbox.tools.http import load_http_tools
from outbox.tools.invoke import run_dispatch, run_lookup

REPO = Path(__file__).resolve().parents[2]
PAYLOAD: dict[str, Any] = {"version": "1.2.3", "notes": ["fix"]}

Start = Callable[..., DeployService]


@pytest.fixture
def start() -> Iterator[Start]:
    """Start deploy services with the given options; all are stopped after the test."""
    started: list[DeployService] = []

    def _start(**options: Any) -> DeployService:
        service = DeployService(**options).start()
        started.append(service)
        return service

    yield _start
    for service in started:
        service.stop()


@pytest.fixture
def service(start: Start) -> DeployService:
    """A service with the defaults: no dedup, lookups on, no faults."""
    return start()


@pytest.fixture
def client(service: DeployService) -> Iterator[httpx.Client]:
    """A keep-alive client of ``service``."""
    with httpx.Client(base_url=service.url, timeout=5) as http:
        yield http


def post_release(
    http: httpx.Client, key: str | None, payload: Any = PAYLOAD, target: str = "web", **headers: str
) -> httpx.Response:
    """POST a release with ``key`` as its idempotency key (None: no key header)."""
    if key is not None:
        headers["Idempotency-Key"] = key
    return http.post(f"/projects/{target}/releases", json=payload, headers=headers)


def test_create_answers_201_and_commits_one_effect(
    service: DeployService, client: httpx.Client
) -> None:
    """A POST with a key creates one release, answered with 201, and the ledger holds it."""
    response = post_release(client, "op-1")

    assert response.status_code == 201
    release = response.json()
    assert release["id"].startswith("rel-")
    assert (release["target"], release["key"], release["payload"]) == ("web", "op-1", PAYLOAD)
    assert release["created_at"]
    assert [effect.to_dict() for effect in service.ledger()] == [release]
    ledger = client.get("/ledger").json()
    assert ledger == {"effects": [release], "count": 1}


def test_the_ledger_judges_the_outbox_verdicts(
    service: DeployService, client: httpx.Client
) -> None:
    """A confirmed ref the ledger lacks, or a failure for a key it holds, is contradicted."""
    ref = post_release(client, "op-1").json()["id"]
    assert service.contradicted([("op-1", "confirmed", ref), ("op-2", "failed", None)]) == 0
    assert service.contradicted([("op-1", "confirmed", "rel-other")]) == 1
    assert service.contradicted([("op-2", "confirmed", ref)]) == 1
    assert service.contradicted([("op-1", "failed", None), ("op-1", "needs_human", None)]) == 1


def test_missing_key_or_bad_json_is_refused_with_400(
    service: DeployService, client: httpx.Client
) -> None:
    """Without an idempotency key, or with a body that is not JSON: 400 and no effect."""
    missing = post_release(client, None)
    not_json = client.post(
        "/projects/web/releases", content=b"{nope", headers={"Idempotency-Key": "k"}
    )

    assert missing.status_code == 400
    assert "Idempotency-Key" in missing.json()["error"]
    assert not_json.status_code == 400
    assert service.ledger() == []


def test_without_dedup_the_same_key_twice_creates_two_effects(
    service: DeployService, client: httpx.Client
) -> None:
    """Without a dedup window every POST is a new effect, so a retried key shows as a duplicate."""
    first = post_release(client, "op-1")
    second = post_release(client, "op-1")
    post_release(client, "op-2")

    assert (first.status_code, second.status_code) == (201, 201)
    assert first.json()["id"] != second.json()["id"]
    assert service.effects_by_key() == {"op-1": 2, "op-2": 1}
    ids = [first.json()["id"], second.json()["id"]]
    duplicates = client.get("/ledger/duplicates").json()
    assert duplicates == {"duplicates": [{"key": "op-1", "count": 2, "ids": ids}], "count": 1}


def test_with_dedup_the_same_key_and_payload_returns_the_same_release(start: Start) -> None:
    """With dedup, the same key and payload (any key order) answers 200 with the same release."""
    service = start(dedup_window_s=60)
    with httpx.Client(base_url=service.url) as http:
        first = post_release(http, "op-1", {"a": 1, "b": [1, 2]})
        again = post_release(http, "op-1", {"b": [1, 2], "a": 1})

    assert first.status_code == 201
    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert service.effects_by_key() == {"op-1": 1}


def test_dedup_compares_payloads_as_the_outbox_canonicalises_them(start: Start) -> None:
    """ "The same payload" is the outbox's canonical JSON (RFC 8785): ``1`` and ``1.0`` alike;
    a payload the outbox could not canonicalise (an integer beyond 2**53) is refused with 400."""
    service = start(dedup_window_s=60)
    with httpx.Client(base_url=service.url) as http:
        first = post_release(http, "op-1", {"replicas": 1})
        again = post_release(http, "op-1", {"replicas": 1.0})
        unsafe = post_release(http, "op-2", {"id": 2**60})

    assert (first.status_code, again.status_code) == (201, 200)
    assert unsafe.status_code == 400
    assert "canonical JSON" in unsafe.json()["error"]
    assert service.effects_by_key() == {"op-1": 1}


def test_with_dedup_another_payload_is_refused_with_422(start: Start) -> None:
    """With dedup, the same key with another payload or target answers 422 and commits nothing."""
    service = start(dedup_window_s=60)
    with httpx.Client(base_url=service.url) as http:
        post_release(http, "op-1")
        other_payload = post_release(http, "op-1", {"version": "9.9.9"})
        other_target = post_release(http, "op-1", target="api")

    for response in (other_payload, other_target):
        assert response.status_code == 422
        assert response.json() == {"error": "key reused with another payload"}
    assert len(service.ledger()) == 1


def test_after_the_dedup_window_the_key_creates_a_new_effect(start: Start) -> None:
    """Once the window has passed the key is forgotten: the same request creates a new effect."""
    service = start(dedup_window_s=0.3)
    with httpx.Client(base_url=service.url) as http:
        first = post_release(http, "op-1")
        time.sleep(0.4)
        later = post_release(http, "op-1", {"version": "2.0.0"})

    assert (first.status_code, later.status_code) == (201, 201)
    assert later.json()["id"] != first.json()["id"]
    assert service.effects_by_key() == {"op-1": 2}


def test_lookup_finds_the_first_release_for_a_key_or_answers_404(
    service: DeployService, client: httpx.Client
) -> None:
    """The lookup answers the first release with that key for that target, else 404."""
    first = post_release(client, "op-1").json()
    post_release(client, "op-1", {"version": "2"})

    found = client.get("/projects/web/releases/by-key/op-1")
    missing = client.get("/projects/web/releases/by-key/op-404")
    other_target = client.get("/projects/api/releases/by-key/op-1")

    assert found.status_code == 200
    assert found.json() == first
    assert missing.status_code == 404
    assert missing.json() == {"error": "no release for key"}
    assert other_target.status_code == 404


def post_rollback(
    http: httpx.Client, key: str, release: Any, target: str = "web", **headers: str
) -> httpx.Response:
    """POST the rollback of ``release`` with ``key`` as its idempotency key."""
    body = {"release": release, "why": "undo"}
    return http.post(
        f"/projects/{target}/rollbacks", json=body, headers={"Idempotency-Key": key, **headers}
    )


def test_a_rollback_of_a_release_is_a_rollback_effect_after_it_in_the_ledger(
    service: DeployService, client: httpx.Client
) -> None:
    """A rollback naming a release of its target answers 201 and is recorded as a ``rollback``
    effect (``rb-N``), after the release in the ledger's one order."""
    release = post_release(client, "op-1").json()
    response = post_rollback(client, "undo-1", release["id"])

    assert response.status_code == 201
    rollback = response.json()
    assert rollback["id"].startswith("rb-")
    assert (rollback["kind"], rollback["target"], rollback["key"]) == ("rollback", "web", "undo-1")
    assert rollback["payload"] == {"release": release["id"], "why": "undo"}
    assert release["kind"] == "release"
    assert [e.to_dict() for e in service.ledger()] == [release, rollback]
    assert [e.kind for e in service.ledger()] == ["release", "rollback"]
    assert client.get("/_stats").json()["rolled_back"] == 1


def test_a_rollback_twice_without_dedup_is_two_effects_with_dedup_one(start: Start) -> None:
    """Without a dedup window a rollback sent twice with one key is two effects (a duplicate
    shows); with one, the second answers the first, replayed."""
    for window, expected in ((None, 2), (60.0, 1)):
        service = start(dedup_window_s=window)
        with httpx.Client(base_url=service.url) as http:
            ref = post_release(http, "op-1").json()["id"]
            first, second = (post_rollback(http, "undo-1", ref) for _ in range(2))
        assert first.status_code == 201
        assert second.status_code == (201 if window is None else 200)
        assert service.effects_by_key() == {"op-1": 1, "undo-1": expected}


@pytest.mark.parametrize(
    ("release", "status"),
    [
        ("rel-999", 422),  # no such release
        (None, 422),  # the release of another target (its id, filled in below)
        ("rb-1", 422),  # a rollback is not a release
        ("", 400),
        (7, 400),
    ],
    ids=["unknown", "other-target", "not-a-release", "empty", "not-a-string"],
)
def test_a_rollback_of_no_release_of_its_target_is_refused_and_commits_nothing(
    service: DeployService, client: httpx.Client, release: Any, status: int
) -> None:
    """A rollback naming no release of its target answers 422, a malformed one 400; neither
    commits an effect."""
    ref = post_release(client, "op-1", target="api").json()["id"]
    response = post_rollback(client, "undo-1", ref if release is None else release)

    assert response.status_code == status
    assert service.effects_by_key() == {"op-1": 1}


def test_a_rollback_takes_the_faults_of_a_create(
    service: DeployService, client: httpx.Client
) -> None:
    """A rollback's payload ``_fault``, header or armed key faults it as it faults a create:
    a refusal commits nothing, commit_then_timeout commits."""
    ref = post_release(client, "op-1").json()["id"]
    refused = client.post(
        "/projects/web/rollbacks",
        json={"release": ref, "_fault": "reject_422"},
        headers={"Idempotency-Key": "undo-1"},
    )
    service.faults.arm_key("undo-2", "commit_then_timeout", 1)
    with (
        httpx.Client(base_url=service.url, timeout=0.5) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        post_rollback(http, "undo-2", ref)

    assert (refused.status_code, refused.json()) == (422, {"error": "rejected"})
    assert service.effects_by_key() == {"op-1": 1, "undo-2": 1}


def test_a_rollback_lookup_finds_rollbacks_only(
    service: DeployService, client: httpx.Client
) -> None:
    """The rollbacks' lookup by key answers the first rollback with that key, 404 for a key
    only a release has (and the releases' lookup does not see rollbacks)."""
    ref = post_release(client, "op-1").json()["id"]
    rollback = post_rollback(client, "undo-1", ref).json()

    found = client.get("/projects/web/rollbacks/by-key/undo-1")
    release_key = client.get("/projects/web/rollbacks/by-key/op-1")
    as_release = client.get("/projects/web/releases/by-key/undo-1")

    assert (found.status_code, found.json()) == (200, rollback)
    assert (release_key.status_code, release_key.json()) == (404, {"error": "no rollback for key"})
    assert as_release.status_code == 404


def test_the_declared_rollback_tool_rolls_back_and_finds_its_rollback_by_key(
    service: DeployService, client: httpx.Client, tmp_path: Path
) -> None:
    """``deploy.rollback_release`` as the outbox calls it: applied with the rollback's id,
    found again by its lookup, refused for a release the target lacks."""
    config = tmp_path / "tools.toml"
    config.write_text(rollback_tool_toml(service.url, timeout_s=2.0), encoding="utf-8")
    (rollback,) = load_http_tools(config)
    ref = post_release(client, "op-1").json()["id"]

    def call(key: str, release: str) -> ToolCall:
        return ToolCall(key, key, ROLLBACK_TOOL, "web", {"release": release}, 1, 2.0)

    applied = run_dispatch(rollback, call("undo-1", ref))
    found = run_lookup(rollback, call("undo-1", ref))
    missing = run_lookup(rollback, call("undo-2", ref))
    refused = run_dispatch(rollback, call("undo-3", "rel-999"))

    assert rollback.name == ROLLBACK_TOOL
    assert isinstance(applied, Applied)
    assert applied.remote_ref.startswith("rb-")
    assert isinstance(found, Applied)
    assert found.remote_ref == applied.remote_ref
    assert isinstance(missing, NotApplied)
    assert isinstance(refused, Rejected)
    assert service.effects_by_key() == {"op-1": 1, "undo-1": 1}


def test_lookup_answers_501_when_disabled(start: Start) -> None:
    """A service started without lookups answers 501 to every lookup."""
    service = start(lookup_enabled=False)
    with httpx.Client(base_url=service.url) as http:
        post_release(http, "op-1")
        response = http.get("/projects/web/releases/by-key/op-1")

    assert response.status_code == 501


def test_commit_then_timeout_commits_while_the_client_times_out(
    service: DeployService,
) -> None:
    """commit_then_timeout: the caller's 0.5 s timeout fires, yet the effect is in the ledger."""
    with (
        httpx.Client(base_url=service.url, timeout=0.5) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        post_release(http, "op-1", **{"X-Fault": "commit_then_timeout"})

    assert service.effects_by_key() == {"op-1": 1}


def test_commit_then_reset_commits_and_resets_the_connection(
    service: DeployService, client: httpx.Client
) -> None:
    """commit_then_reset: the caller gets no answer, only a broken connection, yet it applied."""
    with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
        post_release(client, "op-1", **{"X-Fault": "commit_then_reset"})

    assert service.effects_by_key() == {"op-1": 1}
    assert post_release(client, "op-2").status_code == 201


@pytest.mark.parametrize(
    ("mode", "status", "error"), [("error_503", 503, None), ("reject_422", 422, "rejected")]
)
def test_refusing_faults_commit_nothing(
    service: DeployService, client: httpx.Client, mode: str, status: int, error: str | None
) -> None:
    """error_503 and reject_422 answer their status and commit no effect."""
    response = post_release(client, "op-1", **{"X-Fault": mode})

    assert response.status_code == status
    if error is not None:
        assert response.json() == {"error": error}
    assert service.ledger() == []


def test_slow_waits_the_delay_then_creates(service: DeployService, client: httpx.Client) -> None:
    """slow: the answer comes after the configured delay and the release is created normally."""
    assert client.post("/_faults", json={"delay_s": 0.3}).status_code == 200

    began = time.monotonic()
    response = post_release(client, "op-1", **{"X-Fault": "slow"})

    assert time.monotonic() - began >= 0.3
    assert response.status_code == 201
    assert service.effects_by_key() == {"op-1": 1}


def test_a_payload_fault_field_faults_every_request_with_that_payload(
    service: DeployService, client: httpx.Client
) -> None:
    """A payload's ``_fault`` field applies to that request and to every replay of it."""
    payload = {"version": "1", "_fault": "error_503"}

    statuses = [post_release(client, "op-1", payload).status_code for _ in range(2)]

    assert statuses == [503, 503]
    assert service.ledger() == []


def test_an_unknown_fault_mode_is_refused_with_400(client: httpx.Client) -> None:
    """A header naming no fault mode is a bad request, not a silent no-op."""
    response = post_release(client, "op-1", **{"X-Fault": "explode"})

    assert response.status_code == 400
    assert "explode" in response.json()["error"]


def test_a_key_fault_applies_n_times_then_stops(
    service: DeployService, client: httpx.Client
) -> None:
    """A fault armed for a key hits that key's next N requests only, not other keys."""
    armed = client.post("/_faults/keys/op-1", json={"mode": "error_503", "times": 2})
    assert armed.json() == {"key": "op-1", "mode": "error_503", "times": 2}

    other = post_release(client, "op-2")
    statuses = [post_release(client, "op-1").status_code for _ in range(3)]

    assert other.status_code == 201
    assert statuses == [503, 503, 201]
    assert service.effects_by_key() == {"op-2": 1, "op-1": 1}
    assert client.get("/_faults").json()["keys"] == {}


def _statuses(service: DeployService, count: int = 40) -> list[int]:
    with httpx.Client(base_url=service.url) as http:
        return [post_release(http, f"op-{i}").status_code for i in range(count)]


def test_rate_faults_with_a_seed_are_reproducible(start: Start) -> None:
    """One seed gives one sequence of faults, set at start-up or over HTTP; another seed differs."""
    rates = {"error_503": 0.3, "reject_422": 0.2}
    at_startup = start(fault_rates=rates, seed=42)
    over_http = start()
    other_seed = start(fault_rates=rates, seed=7)
    httpx.post(f"{over_http.url}/_faults", json={"rates": rates, "seed": 42}).raise_for_status()

    first = _statuses(at_startup)

    assert {201, 422, 503} <= set(first)
    assert _statuses(over_http) == first
    assert _statuses(other_seed) != first
    stats = httpx.get(f"{at_startup.url}/_stats").json()
    assert stats["faulted"]["error_503"] == first.count(503)
    assert stats["created"] == first.count(201) == len(at_startup.ledger())


def test_deleting_faults_stops_them(start: Start) -> None:
    """After DELETE /_faults no request is faulted any more."""
    service = start(fault_rates={"error_503": 1.0}, seed=1)
    with httpx.Client(base_url=service.url) as http:
        assert post_release(http, "op-1").status_code == 503
        assert http.delete("/_faults").json()["rates"] == {}
        assert post_release(http, "op-1").status_code == 201


def test_bad_fault_settings_are_refused_with_400(client: httpx.Client) -> None:
    """Fault settings with an unknown mode or a rate outside 0..1 are refused and change nothing."""
    unknown = client.post("/_faults", json={"rates": {"explode": 0.1}})
    too_high = client.post("/_faults", json={"rates": {"error_503": 1.5}})
    bad_key = client.post("/_faults/keys/k", json={"mode": "slow", "times": 0})

    assert [r.status_code for r in (unknown, too_high, bad_key)] == [400, 400, 400]
    assert client.get("/_faults").json()["rates"] == {}


def test_concurrent_requests_with_one_key_create_one_effect_with_dedup(start: Start) -> None:
    """With dedup, 20 simultaneous requests with one key create one effect and all get its id."""
    service = start(dedup_window_s=60)
    barrier = threading.Barrier(20)

    def send(_: int) -> httpx.Response:
        with httpx.Client(base_url=service.url, timeout=10) as http:
            http.get("/health")  # connect first, so the barrier releases 20 ready requests
            barrier.wait()
            return post_release(http, "op-1")

    with ThreadPoolExecutor(max_workers=20) as pool:
        responses = list(pool.map(send, range(20)))

    assert sorted(r.status_code for r in responses) == [200] * 19 + [201]
    assert len({r.json()["id"] for r in responses}) == 1
    assert service.effects_by_key() == {"op-1": 1}


def test_the_ledger_survives_a_restart_when_kept_in_a_file(start: Start, tmp_path: Path) -> None:
    """A service restarted on the same ledger file keeps its effects, ids and dedup memory."""
    ledger = tmp_path / "ledger.sqlite"
    before = start(ledger_path=ledger, dedup_window_s=60)
    with httpx.Client(base_url=before.url) as http:
        ids = [post_release(http, key).json()["id"] for key in ("op-1", "op-2")]
    before.stop()

    after = start(ledger_path=ledger, dedup_window_s=60)
    with httpx.Client(base_url=after.url) as http:
        replay = post_release(http, "op-1")
        new = post_release(http, "op-3")
        lookup = http.get("/projects/web/releases/by-key/op-2")

    assert [effect.id for effect in after.ledger()] == [*ids, new.json()["id"]]
    assert (replay.status_code, replay.json()["id"]) == (200, ids[0])
    assert new.json()["id"] not in ids
    assert lookup.json()["id"] == ids[1]


def test_a_ledger_file_from_before_rollbacks_opens_with_its_effects_as_releases(
    start: Start, tmp_path: Path
) -> None:
    """A ledger file written without the ``kind`` column opens: its effects are releases, and
    rollbacks are recorded after them."""
    ledger = tmp_path / "ledger.sqlite"
    with sqlite3.connect(ledger) as db:
        db.execute(
            "CREATE TABLE effects (seq INTEGER PRIMARY KEY AUTOINCREMENT, target TEXT NOT NULL,"
            " key TEXT NOT NULL, payload TEXT NOT NULL, created_at REAL NOT NULL)"
        )
        db.execute(
            "INSERT INTO effects (target, key, payload, created_at) VALUES ('web', 'op-1', '{}', 1)"
        )
    db.close()
    service = start(ledger_path=ledger)
    with httpx.Client(base_url=service.url) as http:
        rollback = post_rollback(http, "undo-1", "rel-1")

    assert rollback.status_code == 201
    assert [(e.id, e.kind) for e in service.ledger()] == [
        ("rel-1", "release"),
        ("rb-2", "rollback"),
    ]


def test_the_idempotency_header_name_is_configurable(start: Start) -> None:
    """A service configured with another header reads the key from it and requires it."""
    service = start(idempotency_header="X-Request-Id")
    with httpx.Client(base_url=service.url) as http:
        without = post_release(http, "op-1")
        with_it = post_release(http, None, **{"X-Request-Id": "op-1"})

    assert without.status_code == 400
    assert with_it.status_code == 201
    assert with_it.json()["key"] == "op-1"


def test_clearing_the_ledger_forgets_effects_and_stats(
    service: DeployService, client: httpx.Client
) -> None:
    """DELETE /ledger empties the ledger and the stats; ids keep counting up."""
    first = post_release(client, "op-1").json()["id"]
    assert client.delete("/ledger").status_code == 200

    assert client.get("/ledger").json() == {"effects": [], "count": 0}
    assert client.get("/_stats").json()["created"] == 0
    assert post_release(client, "op-1").json()["id"] != first


DEV_COMMAND = [sys.executable, "-m", "outbox", "dev"]
#: The installed console script: the service's one command line is ``outbox dev deploy-service``.
SCRIPT_COMMAND = [str(Path(sys.executable).with_name("outbox")), "dev"]


@pytest.mark.parametrize(
    ("command", "stop_with"),
    [
        ([*DEV_COMMAND, "deploy-service"], signal.SIGTERM),
        ([*DEV_COMMAND, "deploy-service"], signal.SIGINT),
        ([*SCRIPT_COMMAND, "deploy-service"], signal.SIGTERM),
    ],
    ids=["dev-sigterm", "dev-ctrl-c", "script-sigterm"],
)
def test_the_command_serves_until_signalled_and_exits_0(
    command: list[str], stop_with: signal.Signals
) -> None:
    """Run as a process, the service prints its URL, answers /health and exits 0 on a signal."""
    with subprocess.Popen(
        [*command, "--port", "0", "--dedup-window", "60"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stdout is not None
        assert process.stderr is not None
        line = process.stdout.readline()
        url = line.split(" listening on ", 1)[1].split()[0]
        health = httpx.get(f"{url}/health", timeout=5)
        created = httpx.post(
            f"{url}/projects/web/releases", json=PAYLOAD, headers={"Idempotency-Key": "k"}
        )
        process.send_signal(stop_with)
        code = process.wait(timeout=15)
        rest, errors = process.stdout.read(), process.stderr.read()

    assert "dedup window: 60s" in line
    assert health.status_code == 200
    assert created.status_code == 201
    assert (code, rest, errors) == (0, "", "")


def test_ctrl_c_stops_the_command_even_when_started_with_sigint_ignored() -> None:
    """A service started with SIGINT ignored (a shell's background job; a parent that ignored
    it when it forked) still stops on SIGINT, and exits 0."""

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    process = subprocess.Popen(
        [*DEV_COMMAND, "deploy-service", "--port", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ignore_sigint,  # noqa: PLW1509 -- a signal disposition, no threads involved
    )
    try:
        assert process.stdout is not None
        assert " listening on " in process.stdout.readline()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--fault-rate", "explode=0.1"], "unknown fault mode 'explode'"),
        (["--fault-rate", "error_503=1.5"], "must be a number in 0..1"),
        (["--port", "{busy}"], "cannot listen on"),
    ],
    ids=["unknown-mode", "rate-above-1", "port-in-use"],
)
def test_bad_command_line_input_exits_1_with_one_line(
    service: DeployService, arguments: list[str], message: str
) -> None:
    """An unknown fault mode, a rate outside 0..1 or a busy port: one ``error:`` line, exit 1."""
    argv = [argument.format(busy=service.port) for argument in arguments]
    done = subprocess.run(
        [*DEV_COMMAND, "deploy-service", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ")
    assert message in lines[0]
    assert done.stdout == ""
