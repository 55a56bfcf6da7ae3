"""Guards with real processes: relays, workers (SIGKILLed), beat, and the reference service."""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api
from outbox.dev.service import DeployService
from tests.acceptance.conftest import clean_environment
from tests.integration.test_webhooks import Receiver
from tests.processes import Services, wait_until
from tests.tool_configs import TOOL, http_tool_toml

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)]

SECRET = "whsec_" + base64.b64encode(bytes(range(64, 96))).decode()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _env(
    database_url: str, broker: str | None, tmp_path: Path, url: str, guards: str, **more: str
) -> dict[str, str]:
    config = tmp_path / "tools.toml"
    tool = http_tool_toml(
        url, timeout_s=2.0, send_deadline_s=1.0, inflight_horizon_s=30, max_attempts=50
    )
    config.write_text(tool + guards, encoding="utf-8")
    env = clean_environment(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_CONFIG=str(config),
        OUTBOX_HOME=str(tmp_path / "home"),
        OUTBOX_REPUBLISH_AFTER="5",
        **more,
    )
    if broker is not None:
        env["OUTBOX_BROKER_URL"] = broker
    return env


@pytest.fixture
def group(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Services]:
    """The processes a test starts (each with its own environment), stopped at teardown."""
    started = Services({}, tmp_path)
    yield started
    started.stop_all()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for name, output in started.logs():
            print(f"----- {name} -----\n{output[-4000:]}")  # noqa: T201


def _enqueue(engine: Engine, target: str, count: int) -> list[str]:
    with Session(engine) as session, session.begin():
        return [
            str(api.enqueue(session, tool=TOOL, target=target, payload={"n": n}).id)
            for n in range(count)
        ]


def _scalar(engine: Engine, sql: str, **params: object) -> object:
    with engine.connect() as conn:
        return conn.execute(text(sql), params).scalar()


def _received(receiver: Receiver, kind: str) -> bool:
    return any(json.loads(r.body).get("type") == kind for r in receiver.requests)


def _states(engine: Engine, ids: list[str]) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT state, count(*) FROM outbox.operations WHERE id = ANY(CAST(:ids AS uuid[]))"
                " GROUP BY state"
            ),
            {"ids": ids},
        )
        return {row[0]: row[1] for row in rows}


def test_breaker_holds_an_outage_survives_sigkill_and_one_probe_reopens_the_flow(
    engine: Engine, database_url: str, broker: str | None, tmp_path: Path, group: Services
) -> None:
    """With the service down the breaker opens (circuit_opened arrives) and holds the backlog
    planned without escalation, stays open across a SIGKILL of every worker, and once the
    service is back every operation is confirmed exactly once."""
    port = _free_port()
    receiver = Receiver()
    guards = '[tools."deploy.create_release".breaker]\nfailures = 3\nopen_s = 6\n'
    env = _env(
        database_url,
        broker,
        tmp_path,
        f"http://127.0.0.1:{port}",
        guards,
        OUTBOX_WEBHOOK_URL=receiver.url,
        OUTBOX_WEBHOOK_SECRET=SECRET,
        OUTBOX_SWEEP_INTERVAL="1",
    )
    try:
        worker = group.start("worker", "worker", "-c", "4", "-P", "threads", env=env)
        group.start("relay", "relay", env=env)
        group.start("beat", "beat", env=env)
        first = _enqueue(engine, "web", 3)
        wait_until(
            lambda: _scalar(engine, "SELECT state FROM outbox.guard_breakers") == "open",
            timeout=60,
            what="the breaker to open",
        )
        backlog = _enqueue(engine, "web", 5)
        wait_until(
            lambda: (
                _scalar(
                    engine,
                    "SELECT count(*) FROM outbox.operations WHERE id = ANY(CAST(:ids AS uuid[])) "
                    "AND last_error LIKE 'held: circuit%'",
                    ids=backlog,
                )
                == len(backlog)
            ),
            timeout=30,
            what="the backlog to be held",
        )
        assert _states(engine, backlog) == {"planned": 5}
        assert (
            _scalar(
                engine,
                "SELECT sum(attempts) FROM outbox.operations WHERE id = ANY(CAST(:ids AS uuid[]))",
                ids=backlog,
            )
            == 0
        )
        wait_until(
            lambda: _received(receiver, "guard.circuit_opened"),
            timeout=30,
            what="the circuit_opened webhook",
        )
        worker.kill()
        group.start("worker-2", "worker", "-c", "4", "-P", "threads", env=env)
        assert _scalar(engine, "SELECT state FROM outbox.guard_breakers") == "open"
        with DeployService(port=port, record_requests=True) as service:
            every = first + backlog
            wait_until(
                lambda: _states(engine, every) == {"confirmed": len(every)},
                timeout=60,
                what="every operation confirmed",
            )
            assert service.effects_by_key() == dict.fromkeys(every, 1)
            spans = sorted(service.requests(), key=lambda span: span.started)
            assert spans[1].started >= spans[0].ended  # one probe first, alone
            assert _states(engine, every) == {"confirmed": 8}
            wait_until(
                lambda: _received(receiver, "guard.circuit_closed"),
                timeout=30,
                what="the circuit_closed webhook",
            )
    finally:
        receiver.close()


def test_rate_and_cap_hold_across_two_relays_and_two_workers(
    engine: Engine, database_url: str, broker: str | None, tmp_path: Path, group: Services
) -> None:
    """With rate 10/s (burst 2) and max_in_flight 2 per target, two relays and two workers of
    eight threads (separate processes and settings) never exceed either at the service, and
    another target flows beside it."""
    guards = (
        '[tools."deploy.create_release".rate]\nper_second = 10\nburst = 2\n'
        '[tools."deploy.create_release".concurrency]\nmax_in_flight = 2\n'
    )
    # Each request takes 0.3 s: at 10/s that would be 3 at once, so the cap of 2 binds too.
    with DeployService(
        record_requests=True, fault_rates={"slow": 1.0}, fault_delay_s=0.3
    ) as service:
        for host in ("a", "b"):
            (tmp_path / host).mkdir()
            env = _env(
                database_url,
                broker,
                tmp_path / host,
                service.url,
                guards,
            )
            group.start(f"worker-{host}", "worker", "-c", "8", "-P", "threads", env=env)
            group.start(f"relay-{host}", "relay", env=env)
        web = _enqueue(engine, "web", 24)
        api_ops = _enqueue(engine, "api", 6)
        wait_until(
            lambda: _states(engine, web + api_ops) == {"confirmed": 30},
            timeout=90,
            what="every operation confirmed",
        )
        spans = service.requests()
    for target in ("web", "api"):
        mine = sorted((s.started, s.ended) for s in spans if s.target == target)
        peak = max(sum(1 for a, b in mine if a <= start < b) for start, _ in mine)
        assert peak <= 2, (target, peak)
        starts = [start for start, _ in mine]
        for i, start in enumerate(starts):
            in_a_second = sum(1 for later in starts[i:] if later < start + 1.0)
            assert in_a_second <= 10 + 2, (target, in_a_second)
    assert len([s for s in spans if s.target == "web"]) == 24
    first_api_done = min(s.ended for s in spans if s.target == "api")
    last_web_done = max(s.ended for s in spans if s.target == "web")
    assert first_api_done < last_web_done  # api did not queue behind web
