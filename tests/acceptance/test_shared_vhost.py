"""Two deployments on one RabbitMQ vhost: `outbox relay` and `outbox worker` of each, as real
processes on databases of their own; each deployment's messages reach only its own workers."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api, migrate
from outbox.config import load_settings
from outbox.db import create_engine
from outbox.deployment import deployment_name
from outbox.dev.service import DeployService
from outbox.logs import Action
from outbox.workers.app import DISPATCH_TASK, LOOKUP_TASK, celery_settings
from tests.acceptance.conftest import clean_environment
from tests.conftest import Databases
from tests.processes import Services, wait_until
from tests.tool_configs import TOOL, http_tool_toml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: Operations each deployment enqueues.
COUNT = 40
#: Far beyond the test's wait: an operation whose message was lost is never published again
#: while the test runs, so every confirmation below came from its first message.
NO_REPUBLISH = "3600"


@dataclass
class Deployment:
    """One deployment: its database, its processes' environment and its processes."""

    name: str
    engine: Engine
    services: Services


@pytest.fixture
def deployments(
    databases: Databases,
    rabbitmq_url: str,
    service: DeployService,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> Iterator[list[Deployment]]:
    """Two deployments on two databases of their own and one RabbitMQ vhost."""
    made: list[Deployment] = []
    for name in ("east", "west"):
        url = databases.create()
        engine = create_engine(url)
        migrate.upgrade(engine)
        home = tmp_path / name
        home.mkdir()
        config = home / "tools.toml"
        config.write_text(
            http_tool_toml(service.url, timeout_s=5.0, send_deadline_s=2.0, inflight_horizon_s=60),
            encoding="utf-8",
        )
        env = clean_environment(
            OUTBOX_DATABASE_URL=url,
            OUTBOX_BROKER_URL=rabbitmq_url,
            OUTBOX_CONFIG=str(config),
            OUTBOX_HOME=str(home / "home"),
            OUTBOX_REPUBLISH_AFTER=NO_REPUBLISH,
        )
        made.append(Deployment(name, engine, Services(env, home)))
    yield made
    report = getattr(request.node, "rep_call", None)
    for deployment in made:
        deployment.services.stop_all()
        if report is not None and report.failed:
            for name, output in deployment.services.logs():
                print(f"----- {deployment.name} {name} -----\n{output[-6000:]}")  # noqa: T201
        deployment.engine.dispose()


def _enqueue(engine: Engine, count: int, prefix: str) -> list[str]:
    with Session(engine) as session, session.begin():
        return [
            str(
                api.enqueue(
                    session,
                    tool=TOOL,
                    target=f"{prefix}-project",
                    payload={"version": f"1.0.{i}"},
                    intent_key=f"{prefix}-{i}",
                ).id
            )
            for i in range(count)
        ]


def _confirmed(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM outbox.operations WHERE state = 'confirmed'")
            ).scalar_one()
        )


def test_two_deployments_on_one_vhost_each_get_only_their_own_messages(
    deployments: list[Deployment], service: DeployService
) -> None:
    """Every operation of two deployments sharing a vhost is confirmed from its first message,
    and no worker receives a message for an operation it does not have."""
    ids = {d.name: _enqueue(d.engine, COUNT, d.name) for d in deployments}
    for deployment in deployments:
        deployment.services.start(
            "worker", "worker", "-c", "4", "-P", "threads", "-n", f"{deployment.name}@%h"
        )
    for deployment in deployments:
        deployment.services.start("relay", "relay")
    wait_until(
        lambda: all(_confirmed(d.engine) == COUNT for d in deployments),
        timeout=90,
        interval=0.5,
        what=f"{COUNT} confirmed operations in each deployment",
    )
    effects = service.effects_by_key()
    assert all(effects.get(op_id) == 1 for op_ids in ids.values() for op_id in op_ids)
    for deployment in deployments:
        for name, output in deployment.services.logs():
            assert "unknown_operation" not in output, f"{deployment.name} {name}"


def test_workers_of_two_deployments_with_the_same_name_both_run(
    deployments: list[Deployment],
) -> None:
    """Two deployments' workers with the default node name (celery@host) on one vhost both
    stay up: each has its own remote-control mailbox."""
    workers = [
        d.services.start("worker", "worker", "-c", "1", "-P", "threads") for d in deployments
    ]
    for worker in workers:
        wait_until(
            lambda w=worker: " ready." in w.output() or not w.alive(),  # type: ignore[misc]
            timeout=60,
            what="the worker to be ready",
        )
    time.sleep(2)  # a worker that lost its mailbox stops right after it said ready
    for worker in workers:
        assert worker.alive(), worker.output()[-3000:]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _unknown_operation_counts(url: str) -> dict[str, float]:
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
        for sample in family.samples:
            if sample.name == "outbox_unknown_operation_messages_total":
                counts[sample.labels["task"]] = sample.value
    return counts


def test_a_foreign_message_is_logged_and_counted(deployments: list[Deployment]) -> None:
    """A dispatch or lookup message naming an operation the worker's database does not have
    is dropped with a warning naming the operation, and counted by `outbox metrics`."""
    east = deployments[0]
    port = _free_port()
    exporter = east.services.start("metrics", "metrics", "--port", str(port))
    worker = east.services.start("worker", "worker", "-c", "2", "-P", "threads")
    wait_until(
        lambda: Action.METRICS_LISTENING in exporter.output() and " ready." in worker.output(),
        timeout=60,
        what="the exporter to listen and the worker to be ready",
    )
    settings = load_settings(
        database_url=east.services.env["OUTBOX_DATABASE_URL"],
        broker_url=east.services.env["OUTBOX_BROKER_URL"],
    )
    sender = Celery("foreign-sender")
    sender.conf.update(celery_settings(settings, deployment=deployment_name(settings)))
    foreign = {"dispatch": str(uuid.uuid4()), "lookup": str(uuid.uuid4())}
    sender.send_task(DISPATCH_TASK, kwargs={"operation_id": foreign["dispatch"]}, queue="dispatch")
    sender.send_task(LOOKUP_TASK, kwargs={"operation_id": foreign["lookup"]}, queue="lookup")
    metrics = f"http://127.0.0.1:{port}/metrics"
    wait_until(
        lambda: _unknown_operation_counts(metrics) == {"dispatch": 1.0, "lookup": 1.0},
        timeout=60,
        interval=0.5,
        what="one unknown dispatch and one unknown lookup counted",
    )
    lines = worker.output().splitlines()
    actions = {
        "dispatch": Action.DISPATCH_UNKNOWN_OPERATION,
        "lookup": Action.LOOKUP_UNKNOWN_OPERATION,
    }
    for task, op_id in foreign.items():
        [line] = [line for line in lines if f"action={actions[task]} " in line]
        assert "level=warning" in line
        assert f"operation_id={op_id}" in line
