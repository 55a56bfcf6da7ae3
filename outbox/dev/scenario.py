"""A scripted end-to-end run: intents through a faulty remote, until every one is decided.

``run_scenario()`` (and ``outbox dev scenario``) starts the reference service with a share of
ambiguous faults (commit-then-timeout, commit-then-reset, 503), a signed-webhook receiver,
and ``outbox worker``, ``outbox relay`` and ``outbox beat`` as real processes; enqueues the
intents; waits until each operation is `confirmed`, `failed` or `needs_human`; and checks
what the outbox promises against the service's own ledger:

* no operation has two effects at the remote;
* `needs_human` appears only where neither a lookup nor a live dedup window exists;
* every escalation reached the webhook receiver with a valid Standard Webhooks signature.

Three configurations: ``lookup`` (the tool can ask the remote), ``dedup`` (the remote
deduplicates a key for a window, no lookup), ``neither``.

A run starts from empty outbox tables. Without a database URL it makes a PostgreSQL cluster of
its own (:class:`~outbox.dev.clusters.LocalCluster`) and throws it away afterwards; a database
it did not create is emptied only when the caller names it (``i_own_this_database``, the
command's ``--i-own-this-database URL``), see :mod:`outbox.dev.ownership`.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import threading
import time
from base64 import b64encode
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import api, migrate, sql
from outbox.db import create_engine
from outbox.dev.clusters import LocalCluster
from outbox.dev.ownership import confirm_owned
from outbox.dev.service import DeployService
from outbox.dev.stack import Services
from outbox.dev.tool_config import TOOL, http_tool_toml

Mode = Literal["lookup", "dedup", "neither"]
MODES: tuple[Mode, ...] = ("lookup", "dedup", "neither")
#: The remote's fault mix: together, the share of calls whose outcome the caller cannot see.
AMBIGUOUS_MIX = {"commit_then_timeout": 0.5, "commit_then_reset": 0.25, "error_503": 0.25}
#: Short enough that replays happen within a run, long enough to cover the faults' delays.
HORIZON_S = 8.0
TIMEOUT_S = 2.0


@dataclass
class WebhookLog:
    """What the receiver saw."""

    valid: list[dict[str, Any]] = field(default_factory=list)
    #: (webhook-id, type, operation id) of every validly signed webhook, in arrival order.
    hooks: list[tuple[str, str, str]] = field(default_factory=list)
    invalid: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> list[tuple[str, str, str]]:
        """A copy of the (webhook-id, type, operation id) that arrived so far."""
        with self.lock:
            return list(self.hooks)

    def operations(self, event: str) -> set[str]:
        """Operation ids of the validly signed messages of type ``operation.<event>``."""
        with self.lock:
            return {
                str(m["data"]["operation_id"])
                for m in self.valid
                if m.get("type") == f"operation.{event}" and "operation_id" in m["data"]
            }


@contextmanager
def webhook_receiver(secret: str) -> Iterator[tuple[str, WebhookLog]]:
    """A local HTTP endpoint verifying Standard Webhooks signatures; yields (url, log)."""
    from standardwebhooks import Webhook  # noqa: PLC0415 -- only scenarios receive webhooks

    verifier = Webhook(secret)
    received = WebhookLog()

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            headers = {k.lower(): v for k, v in self.headers.items()}
            try:
                message = verifier.verify(body, headers)
            except Exception:  # noqa: BLE001 -- any verification failure is an invalid webhook
                with received.lock:
                    received.invalid += 1
                self.send_response(400)
            else:
                # Guard and saga events name no operation: "" in the log.
                operation = str(message["data"].get("operation_id", ""))
                hook = (headers["webhook-id"], message["type"], operation)
                with received.lock:
                    received.valid.append(message)
                    received.hooks.append(hook)
                self.send_response(204)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hooks", received
    finally:
        server.shutdown()
        server.server_close()


def tool_toml(url: str, mode: Mode) -> str:
    """The HTTP tool of ``mode`` on the reference service at ``url``."""
    dedup = {"dedup_window_s": 3600, "dedup_margin_s": 60} if mode == "dedup" else {}
    return http_tool_toml(
        url,
        lookup=mode == "lookup",
        timeout_s=TIMEOUT_S,
        send_deadline_s=1.0,
        inflight_horizon_s=HORIZON_S,
        max_checks=6,
        max_attempts=8,
        **dedup,
    )


@dataclass
class ScenarioReport:
    """The outcome of one scenario run, and whether its checks held."""

    mode: Mode
    intents: int
    states: dict[str, int]
    effects: int
    duplicates: int
    escalations: int
    webhooks_valid: int
    webhooks_invalid: int
    undecided: int
    seconds: float
    problems: list[str]

    @property
    def ok(self) -> bool:
        """Every check held."""
        return not self.problems

    def render(self) -> str:
        """A few lines for people."""
        states = ", ".join(f"{k} {v}" for k, v in sorted(self.states.items()))
        verdict = "OK" if self.ok else "FAILED: " + "; ".join(self.problems)
        return (
            f"[{self.mode}] {self.intents} intents in {self.seconds:.1f}s: {states}\n"
            f"  remote effects {self.effects}, duplicates {self.duplicates}, escalations "
            f"{self.escalations}, webhooks signed {self.webhooks_valid} "
            f"(bad signatures {self.webhooks_invalid})\n  {verdict}"
        )


def _states(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return sql.dev.state_counts(conn)


def _escalated_ids(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return {op.id for op in sql.dev.outcomes(conn) if op.state == "needs_human"}


def run_scenario(
    database_url: str | None = None,
    *,
    mode: Mode,
    i_own_this_database: str | None = None,
    intents: int = 300,
    ambiguous_rate: float = 0.2,
    broker_url: str | None = None,
    timeout_s: float = 240.0,
    seed: int = 7,
    workdir: Path | None = None,
    progress: Callable[[dict[str, int]], None] | None = None,
) -> ScenarioReport:
    """Run one configuration on empty outbox tables; see the module doc.

    ``database_url`` None: on a throw-away PostgreSQL cluster of its own. Otherwise that
    database's outbox tables are emptied first, so ``i_own_this_database`` must name the same
    database, or :class:`~outbox.dev.ownership.NotOwned` is raised before anything is touched.
    """
    if database_url is not None:
        confirm_owned(
            database_url,
            i_own_this_database,
            doing="the scenario empties the outbox tables of",
        )
    workdir = workdir or Path(tempfile.mkdtemp(prefix=f"outbox-scenario-{mode}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    with _database(database_url, workdir) as url:
        engine = create_engine(url)
        try:
            return _run(
                engine,
                url,
                mode=mode,
                intents=intents,
                ambiguous_rate=ambiguous_rate,
                broker_url=broker_url,
                timeout_s=timeout_s,
                seed=seed,
                workdir=workdir,
                progress=progress,
            )
        finally:
            engine.dispose()


@contextmanager
def _database(url: str | None, workdir: Path) -> Iterator[str]:
    """``url``, or a database on a cluster of its own under ``workdir``, removed afterwards."""
    if url is not None:
        yield url
        return
    root = workdir / "postgres"
    cluster = LocalCluster(root)
    try:
        cluster.start()
        yield cluster.create_database("outbox")
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _run(
    engine: Engine,
    database_url: str,
    *,
    mode: Mode,
    intents: int,
    ambiguous_rate: float,
    broker_url: str | None,
    timeout_s: float,
    seed: int,
    workdir: Path,
    progress: Callable[[dict[str, int]], None] | None,
) -> ScenarioReport:
    migrate.upgrade(engine)
    with engine.begin() as conn:
        # Emptied: the checks count every row. run_scenario made sure the database is ours.
        sql.dev.empty_operations(conn)
    secret = "whsec_" + b64encode(secrets.token_bytes(24)).decode()
    rates = {fault: share * ambiguous_rate for fault, share in AMBIGUOUS_MIX.items()}
    with (
        DeployService(
            port=0,
            dedup_window_s=3600 if mode == "dedup" else None,
            fault_rates=rates,
            seed=seed,
            fault_delay_s=TIMEOUT_S + 1,
        ) as service,
        webhook_receiver(secret) as (hook_url, hooks),
    ):
        config = workdir / "tools.toml"
        config.write_text(tool_toml(service.url, mode), encoding="utf-8")
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
            "OUTBOX_DATABASE_URL": database_url,
            "OUTBOX_CONFIG": str(config),
            "OUTBOX_HOME": str(workdir / "home"),
            "OUTBOX_SENT_TIMEOUT": str(TIMEOUT_S + 2),
            "OUTBOX_SENT_MAX_AGE": "120",
            "OUTBOX_SWEEP_INTERVAL": "1",
            "OUTBOX_REPUBLISH_AFTER": "5",
            "OUTBOX_WEBHOOK_URL": hook_url,
            "OUTBOX_WEBHOOK_SECRET": secret,
        }
        if broker_url:
            env["OUTBOX_BROKER_URL"] = broker_url
        stack = Services(env, workdir)
        started = time.monotonic()
        try:
            stack.start("worker", "worker", "-c", "8", "-P", "threads", "--log-level", "WARNING")
            stack.start("relay", "relay", "--log-level", "WARNING")
            stack.start("beat", "beat", "--log-level", "WARNING")
            _enqueue(engine, intents)
            undecided = _wait_decided(engine, intents, started + timeout_s, progress)
            # Escalations are delivered by beat's webhook runs: give them a moment.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not _escalated_ids(engine) <= hooks.operations(
                "needs_human"
            ):
                time.sleep(0.5)
        finally:
            stack.stop_all()
        seconds = time.monotonic() - started
        return _report(engine, service, hooks, mode, intents, undecided, seconds)


def _enqueue(engine: Engine, intents: int) -> None:
    with Session(engine) as session:
        for start in range(0, intents, 50):
            with session.begin():
                for i in range(start, min(start + 50, intents)):
                    api.enqueue(
                        session,
                        tool=TOOL,
                        target=f"project-{i % 10}",
                        payload={"version": f"1.{i // 100}.{i % 100}"},
                        intent_key=f"scenario-{i}",
                    )


def _wait_decided(
    engine: Engine,
    intents: int,
    deadline: float,
    progress: Callable[[dict[str, int]], None] | None,
) -> int:
    decided_states = ("confirmed", "failed", "needs_human")
    while True:
        states = _states(engine)
        if progress is not None:
            progress(states)
        undecided = intents - sum(states.get(s, 0) for s in decided_states)
        if undecided == 0 or time.monotonic() > deadline:
            return undecided
        time.sleep(1.0)


def _report(  # noqa: PLR0917 -- one private call site, every value named there
    engine: Engine,
    service: DeployService,
    hooks: WebhookLog,
    mode: Mode,
    intents: int,
    undecided: int,
    seconds: float,
) -> ScenarioReport:
    states = _states(engine)
    by_key = service.effects_by_key()
    duplicates = sum(1 for count in by_key.values() if count > 1)
    escalated = _escalated_ids(engine)
    problems = []
    if undecided:
        problems.append(f"{undecided} operations undecided when the time ran out")
    if duplicates:
        problems.append(f"{duplicates} operations have more than one effect at the remote")
    if mode != "neither" and escalated:
        problems.append(f"{len(escalated)} escalations although a lookup or dedup window exists")
    missing = escalated - hooks.operations("needs_human")
    if missing:
        problems.append(f"{len(missing)} escalations never reached the webhook receiver")
    if hooks.invalid:
        problems.append(f"{hooks.invalid} webhooks had a bad signature")
    with engine.connect() as conn:
        confirmed = [op for op in sql.dev.outcomes(conn) if op.state == "confirmed"]
    wrong = service.contradicted((op.id, op.state, op.remote_ref) for op in confirmed)
    if wrong:
        problems.append(f"{wrong} confirmed operations whose remote_ref is not in the ledger")
    return ScenarioReport(
        mode=mode,
        intents=intents,
        states=states,
        effects=sum(by_key.values()),
        duplicates=duplicates,
        escalations=len(escalated),
        webhooks_valid=len(hooks.valid),
        webhooks_invalid=hooks.invalid,
        undecided=undecided,
        seconds=seconds,
        problems=problems,
    )


def report_json(report: ScenarioReport) -> str:
    """The report as JSON (for ``--json``)."""
    data = dict(vars(report))
    data["ok"] = report.ok
    return json.dumps(data, indent=2)
