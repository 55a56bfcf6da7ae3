"""Hosts' clocks decide nothing: beat and the workers five minutes apart, either way.

Found by the red team (issue 17, finding 1): the sweep's and the webhook task's messages
carried Celery ``expires``, an absolute time on beat's clock that each worker compared with
its own; a worker ahead of beat threw every sweep away, so lost dispatchers' `sent` rows and
`unknown` rows never moved and no escalation webhook went out. Here every process but
PostgreSQL, the remote and the webhook receiver runs under libfaketime (``tests/clocks.py``).
"""

from __future__ import annotations

import base64
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from uuid import UUID

import httpx
import pytest
from celery import Celery
from sqlalchemy import Engine, text
from standardwebhooks import Webhook

from outbox.config import load_settings
from outbox.deployment import deployment_name
from outbox.dev.service import DeployService
from outbox.locks import operation_lock_key
from outbox.states import State
from outbox.workers.app import BROKER_MESSAGE_TABLE, LOOKUP_TASK, celery_settings
from tests.clocks import libfaketime, measured_offset, movable_clock, moved_clock, step_clock
from tests.factories import age, make_operation
from tests.processes import Services, wait_until
from tests.tool_configs import TOOL, http_tool_toml

pytestmark = pytest.mark.slow

SECRET = "whsec_" + base64.b64encode(bytes(range(7, 39))).decode()
#: A tool with neither a lookup nor a dedup contract: its `unknown` rows go to a human.
NO_LOOKUP = "deploy.no_lookup"
#: How far (seconds) the seeded rows' attempts lie in the past, by the database clock:
#: past the sent timeout and the in-flight horizon below.
AGED_S = 900
#: The hosts' clocks, moved by five minutes each way.
SKEW_S = 300


class VerifyingReceiver:
    """A webhook receiver that accepts only what Standard Webhooks' verifier accepts
    (signature, and a timestamp within its five minutes of this host's clock)."""

    def __init__(self) -> None:
        self.verified: list[dict[str, Any]] = []
        self.refused: list[str] = []
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """Where the outbox POSTs."""
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks"

    def escalated(self) -> set[str]:
        """Operation ids of the verified `needs_human` webhooks received so far."""
        with self._lock:
            return {
                body["data"]["operation_id"]
                for body in self.verified
                if body["type"] == "operation.needs_human"
            }

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                headers = {name.lower(): value for name, value in self.headers.items()}
                try:
                    Webhook(SECRET).verify(body, headers)
                except Exception as exc:  # noqa: BLE001 -- any refusal is recorded and answered
                    with receiver._lock:
                        receiver.refused.append(f"{type(exc).__name__}: {exc}")
                    self.send_response(400)
                else:
                    with receiver._lock:
                        receiver.verified.append(json.loads(body))
                    self.send_response(204)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                """Quiet: the test reads what was received."""

        return Handler

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


@pytest.fixture
def receiver() -> Iterator[VerifyingReceiver]:
    """A verifying webhook receiver on this host's (true) clock."""
    running = VerifyingReceiver()
    yield running
    running.close()


@pytest.fixture
def service() -> Iterator[DeployService]:
    """The reference remote, without dedup, on this host's (true) clock."""
    with DeployService(port=0) as running:
        yield running


@pytest.fixture
def services(
    database_url: str,
    broker: str | None,
    service: DeployService,
    receiver: VerifyingReceiver,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[Services]:
    """The stack's environment (tools, webhook, short intervals); logs printed on failure."""
    tools = tmp_path / "tools.toml"
    horizon: dict[str, Any] = {"timeout_s": 5.0, "send_deadline_s": 2.0, "inflight_horizon_s": 60}
    tools.write_text(
        http_tool_toml(service.url, **horizon)
        + http_tool_toml(service.url, NO_LOOKUP, lookup=False, **horizon),
        encoding="utf-8",
    )
    env = {name: value for name, value in os.environ.items() if not name.startswith("OUTBOX_")}
    env |= {
        "OUTBOX_DATABASE_URL": database_url,
        "OUTBOX_CONFIG": str(tools),
        "OUTBOX_HOME": str(tmp_path / "home"),
        "OUTBOX_SWEEP_INTERVAL": "1",
        "OUTBOX_SENT_TIMEOUT": "10",
        "OUTBOX_REPUBLISH_AFTER": "5",
        "OUTBOX_WEBHOOK_URL": receiver.url,
        "OUTBOX_WEBHOOK_SECRET": SECRET,
    }
    if broker is not None:
        env["OUTBOX_BROKER_URL"] = broker
    group = Services(env, tmp_path)
    yield group
    group.stop_all()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        for name, output in group.logs():
            print(f"----- {name} -----\n{output[-6000:]}")  # noqa: T201


def _seed(engine: Engine, service: DeployService, state: State, tool: str, *, applied: bool) -> str:
    """An operation in ``state`` whose attempt lies ``AGED_S`` in the past (its lock free),
    with its effect already at the remote when ``applied``."""
    op = make_operation(engine, state, tool=tool, target="web")
    age(engine, op.id, AGED_S, "sent_at", "first_sent_at")
    if applied:
        httpx.post(
            f"{service.url}/projects/web/releases",
            json=op.payload,
            headers={"Idempotency-Key": str(op.id)},
            timeout=10,
        ).raise_for_status()
    return str(op.id)


def _states(engine: Engine, ids: list[str]) -> dict[str, str]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id, state FROM outbox.operations WHERE id = ANY(:ids)"),
            {"ids": [UUID(one) for one in ids]},
        )
        return {str(row.id): str(row.state) for row in rows}


@pytest.mark.parametrize(
    ("beat_offset_s", "workers_offset_s"),
    [(SKEW_S, -SKEW_S), (-SKEW_S, SKEW_S)],
    ids=["beat-ahead", "workers-ahead"],
)
def test_every_operation_is_decided_whatever_the_hosts_clocks_say(
    engine: Engine,
    service: DeployService,
    receiver: VerifyingReceiver,
    services: Services,
    beat_offset_s: int,
    workers_offset_s: int,
) -> None:
    """With beat and the workers five minutes apart either way, lost `sent` rows and `unknown`
    rows all reach their decision and each escalation's webhook arrives and verifies."""
    library = libfaketime()
    beat_clock, workers_clock = (
        moved_clock(beat_offset_s, library),
        moved_clock(workers_offset_s, library),
    )
    for clock, offset in ((beat_clock, beat_offset_s), (workers_clock, workers_offset_s)):
        assert abs(measured_offset(clock) - offset) < 5, "libfaketime did not move the clock"
    expected = {
        # lost dispatcher, effect at the remote: sweep → unknown → lookup "applied"
        _seed(engine, service, State.SENT, TOOL, applied=True): "confirmed",
        # lost dispatcher, nothing at the remote: lookup "not applied" → replay → dispatch
        _seed(engine, service, State.SENT, TOOL, applied=False): "confirmed",
        # an attempt in doubt whose effect exists: lookup "applied"
        _seed(engine, service, State.UNKNOWN, TOOL, applied=True): "confirmed",
        # no lookup, no dedup: a human, with a webhook
        _seed(engine, service, State.SENT, NO_LOOKUP, applied=False): "needs_human",
        _seed(engine, service, State.UNKNOWN, NO_LOOKUP, applied=False): "needs_human",
    }
    escalated = {op_id for op_id, state in expected.items() if state == "needs_human"}

    services.start("beat", "beat", env=beat_clock)
    services.start("worker", "worker", "-c", "4", "-P", "threads", env=workers_clock)
    services.start("relay", "relay", env=workers_clock)

    ids = list(expected)
    try:
        wait_until(
            lambda: _states(engine, ids) == expected and receiver.escalated() == escalated,
            timeout=45,
            interval=0.5,
        )
    except AssertionError:
        pytest.fail(
            f"not every operation decided with its webhook: states {_states(engine, ids)}, "
            f"expected {expected}; verified webhooks for {receiver.escalated()}, expected "
            f"{escalated}; refused webhooks {receiver.refused[:3]}"
        )
    effects = service.effects_by_key()
    assert {op_id: effects.get(op_id) for op_id in ids} == {
        op_id: 1 if state == "confirmed" else None for op_id, state in expected.items()
    }
    assert receiver.refused == []


@pytest.mark.parametrize("broker", ["rabbitmq"], indirect=True)
def test_a_lookup_put_back_by_a_worker_ahead_runs_at_once_on_a_worker_behind(
    engine: Engine,
    database_url: str,
    broker: str,
    service: DeployService,
    services: Services,
) -> None:
    """A lookup message put back because its operation's lock was busy carries no time of the
    host that put it back: a worker ten minutes behind that host runs it at once."""
    library = libfaketime()
    op_id = _seed(engine, service, State.UNKNOWN, TOOL, applied=True)
    settings = load_settings(database_url=database_url, broker_url=broker)
    app = Celery("outbox-test")
    app.conf.update(celery_settings(settings, deployment=deployment_name(settings)))
    worker = ("worker", "-Q", "lookup", "-c", "1", "-P", "threads")
    with engine.connect() as holder:
        holder.execute(text("SELECT pg_advisory_lock(:k)"), {"k": operation_lock_key(op_id)})
        holder.commit()
        ahead = services.start(
            "worker-ahead", *worker, "-n", "ahead@%h", env=moved_clock(SKEW_S, library)
        )
        app.send_task(LOOKUP_TASK, kwargs={"operation_id": op_id}, queue="lookup")
        # Received a second time: put back once (lock busy), and the first message acked
        # (with a prefetch of one, the broker delivers the next only after that ack).
        wait_until(
            lambda: ahead.output().count("] received") >= 2,
            timeout=60,
            what="the worker ahead to put the lookup back and take it again",
        )
        # The message it took back (or put back again since) goes to the next worker.
        ahead.kill()
        holder.execute(text("SELECT pg_advisory_unlock_all()"))
        holder.commit()
    app.close()
    services.start("worker-behind", *worker, "-n", "behind@%h", env=moved_clock(-SKEW_S, library))
    wait_until(
        lambda: _states(engine, [op_id]) == {op_id: "confirmed"},
        timeout=30,
        interval=0.5,
        what="the worker behind to run the lookup and confirm the operation",
    )


def _published(engine: Engine) -> int:
    """Messages beat has published on the database broker so far."""
    with engine.connect() as conn:
        if conn.execute(text("SELECT to_regclass(:t)"), {"t": BROKER_MESSAGE_TABLE}).scalar():
            return int(
                conn.execute(text(f"SELECT count(*) FROM {BROKER_MESSAGE_TABLE}")).scalar_one()
            )
    return 0


@pytest.mark.parametrize("broker", ["database"], indirect=True)
def test_beat_keeps_its_schedule_when_its_clock_is_set_back(
    engine: Engine, services: Services, tmp_path: Path
) -> None:
    """Beat's clock set back ten minutes, while it runs and then across a restart (its stored
    schedule says it last ran ten minutes ahead), delays none of its runs."""
    library = libfaketime()
    offset = tmp_path / "faketime"
    clock = movable_clock(offset, SKEW_S, library)
    assert abs(measured_offset(clock) - SKEW_S) < 5, "libfaketime did not move the clock"
    beat = services.start("beat", "beat", env=clock)
    wait_until(lambda: _published(engine) >= 3, timeout=60, what="beat's first runs")
    step_clock(offset, -SKEW_S)  # the host's clock steps back ten minutes
    before = _published(engine)
    wait_until(
        lambda: _published(engine) >= before + 3,
        timeout=20,
        what="beat to run on after its clock stepped back",
    )
    beat.stop()
    before = _published(engine)
    services.start("beat-again", "beat", env=clock)
    wait_until(
        lambda: _published(engine) >= before + 3,
        timeout=60,
        what="beat, restarted with its clock behind its stored schedule, to run",
    )
