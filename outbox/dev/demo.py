"""The demo (``outbox demo``): a scripted agent's releases through crashes, and the evidence.

It starts the whole stack (relay, two workers, beat, the metrics endpoint) under the same
supervisor as ``outbox up``, beside the reference deployment service with faults, and runs an
agent that enqueues about 200 releases:

* most through ``deploy.create_release``, whose remote can be asked (a lookup by key), with
  15 % of calls ambiguous (the release is created, then the answer times out or the
  connection resets) and a few refused for good;
* a worker SIGKILLed mid-run (the supervisor starts it again) and the agent "restarted": it
  replays its conversation and enqueues intents it already made, getting the same
  operations back;
* some through ``deploy.create_release_legacy``: an API with neither lookup nor dedup, where
  an ambiguous call can only be decided by a person.

Then it waits until every operation is decided and reports: intents, effects at the service,
duplicates, states, and for each operation waiting for a person the command that resolves
it, with what the service's ledger says (in real life, what you would check by hand).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import api, sql
from outbox.dev.service import DeployService
from outbox.dev.tool_config import TOOL, http_tool_toml
from outbox.errors import IntentConflict, OutboxError
from outbox.metrics import MetricsServer, serve_metrics
from outbox.supervise import ChildSpec, Supervisor

LEGACY_TOOL = "deploy.create_release_legacy"
DECIDED = ("confirmed", "failed", "needs_human", "cancelled")
TIMEOUT_S = 2.0
HORIZON_S = 8.0
#: The remote's ambiguous faults on ``deploy.create_release``, as shares of all its calls.
FAULT_RATES = {"commit_then_timeout": 0.10, "commit_then_reset": 0.05}
PROJECTS = ("web", "api", "billing", "search", "mobile", "docs", "auth", "ledger")

Say = Callable[[str], None]
Progress = Callable[[dict[str, int], int], None]


@dataclass
class DemoReport:
    """What the demo did and found; ``ok`` only if every check held."""

    run: str
    intents: int
    reenqueued_same: int
    conflict_refused: bool
    worker_killed: bool
    states: dict[str, int]
    effects: int
    duplicates: int
    undecided: int
    wrong: int
    seconds: float
    metrics_url: str | None
    #: (operation id, tool, the ledger's remote ref or None) for each needs_human.
    waiting: list[tuple[str, str, str | None]] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        """Every check that did not hold."""
        found = []
        if self.duplicates:
            found.append(f"{self.duplicates} releases were created twice")
        if self.undecided:
            found.append(f"{self.undecided} operations were not decided in time")
        if self.wrong:
            found.append(f"{self.wrong} verdicts contradict the service's ledger")
        if self.reenqueued_same == 0:
            found.append("the restarted agent did not get its operations back")
        if not self.conflict_refused:
            found.append("a reused intent key with another payload was accepted")
        return found

    @property
    def ok(self) -> bool:
        """Every check held."""
        return not self.problems


@dataclass
class _Intent:
    key: str
    tool: str
    target: str
    payload: dict[str, object]


def _script(run: str, count: int) -> list[_Intent]:
    """The agent's releases: most on the main tool, a tenth on the legacy one, a few refused."""
    intents = []
    for i in range(count):
        tool = LEGACY_TOOL if i % 10 == 9 else TOOL
        payload: dict[str, object] = {"version": f"2.{i // 50}.{i % 50}", "notes": f"release {i}"}
        if i % 50 == 17:
            payload["_fault"] = "reject_422"  # the service refuses this one for good
        elif tool == LEGACY_TOOL and i % 20 == 9:
            # The legacy API creates the release, then its answer times out: only a person
            # (or its own records) can tell.
            payload["_fault"] = "commit_then_timeout"
        intents.append(_Intent(f"demo-{run}-{i}", tool, PROJECTS[i % len(PROJECTS)], payload))
    return intents


def _enqueue(engine: Engine, intent: _Intent) -> str:
    with Session(engine) as session, session.begin():
        op = api.enqueue(
            session,
            tool=intent.tool,
            target=intent.target,
            payload=intent.payload,
            intent_key=intent.key,
            requested_by="demo-agent",
        )
        return str(op.id)


def _conflict_refused(engine: Engine, intent: _Intent) -> bool:
    try:
        _enqueue(engine, _Intent(intent.key, intent.tool, intent.target, {"version": "9.9.9"}))
    except IntentConflict:
        return True
    return False


class DemoError(OutboxError):
    """The demo's stack could not run (a process kept exiting)."""


def _check_not_crash_looping(supervisor: Supervisor) -> None:
    """Stop the demo early when a process keeps exiting: waiting would only hide why."""
    for status in supervisor.statuses():
        if status.restarts >= 3 and not status.running:
            log = supervisor.log_dir / f"{status.name}.log"
            lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
            raise DemoError(
                f"{status.name} keeps exiting (last: {lines[-1] if lines else 'no output'}); "
                f"its log: {log}"
            )


def _states(engine: Engine, run: str) -> dict[str, int]:
    with engine.connect() as conn:
        return sql.dev.state_counts(conn, prefix=f"demo-{run}-")


class Demo:
    """One run of the demo against ``engine``'s database (which must be migrated)."""

    def __init__(
        self,
        engine: Engine,
        url: str,
        *,
        intents: int = 200,
        timeout_s: float = 100.0,
        workdir: Path | None = None,
        say: Say = lambda _line: None,
        progress: Progress | None = None,
    ) -> None:
        self.engine = engine
        self.url = url
        self.count = intents
        self.timeout_s = timeout_s
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="outbox-demo-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.say = say
        self.progress = progress
        self.run_id = uuid.uuid4().hex[:6]

    def run(self) -> DemoReport:
        """Start everything, play the script, wait for the decisions, judge."""
        started = time.monotonic()
        with DeployService(port=0, fault_rates=FAULT_RATES, fault_delay_s=TIMEOUT_S + 1) as svc:
            supervisor = Supervisor(self._specs(), env=self._env(svc), log_dir=self.workdir)
            metrics: MetricsServer | None = None
            try:
                metrics = serve_metrics(self.engine, "127.0.0.1", 0)
                supervisor.start()
                self.say(
                    f"stack started: relay, 2 workers, beat; reference service at {svc.url}; "
                    f"metrics at {metrics.url}; logs in {self.workdir}"
                )
                report = self._play(svc, supervisor, metrics, started)
            finally:
                supervisor.stop()
                if metrics is not None:
                    metrics.shutdown()
        return report

    def _env(self, service: DeployService) -> dict[str, str]:
        tools = self.workdir / "tools.toml"
        contract: dict[str, Any] = {
            "timeout_s": TIMEOUT_S,
            "send_deadline_s": 1.0,
            "inflight_horizon_s": HORIZON_S,
            "max_checks": 6,
            "max_attempts": 8,
        }
        tools.write_text(
            http_tool_toml(service.url, **contract)
            + "\n"
            + http_tool_toml(service.url, LEGACY_TOOL, lookup=False, **contract),
            encoding="utf-8",
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        kept = ("OUTBOX_BROKER_URL", "OUTBOX_HOME")
        env |= {k: v for k, v in os.environ.items() if k in kept}
        env |= {
            "OUTBOX_DATABASE_URL": self.url,
            "OUTBOX_CONFIG": str(tools),
            "OUTBOX_SENT_TIMEOUT": str(TIMEOUT_S + 2),
            "OUTBOX_SWEEP_INTERVAL": "1",
            "OUTBOX_REPUBLISH_AFTER": "3",
            "OUTBOX_LOOKUP_LEASE": "5",
        }
        return env

    @staticmethod
    def _specs() -> list[ChildSpec]:
        quiet = ("--log-level", "WARNING")
        return [
            ChildSpec("relay", ("relay", "--poll-interval", "0.2", *quiet)),
            ChildSpec("worker-1", ("worker", "-P", "threads", "-c", "4", "-n", "w1@%h", *quiet)),
            ChildSpec("worker-2", ("worker", "-P", "threads", "-c", "4", "-n", "w2@%h", *quiet)),
            ChildSpec("beat", ("beat", *quiet)),
        ]

    def _play(
        self,
        service: DeployService,
        supervisor: Supervisor,
        metrics: MetricsServer,
        started: float,
    ) -> DemoReport:
        script = _script(self.run_id, self.count)
        half = len(script) // 2
        self.say(f"the agent enqueues {half} releases, one transaction each")
        ids = {intent.key: _enqueue(self.engine, intent) for intent in script[:half]}
        time.sleep(2)
        killed = self._kill_a_worker(supervisor)
        self.say("the agent restarts and replays its conversation: the same intents again")
        replayed = script[half - 30 : half]
        same = sum(1 for intent in replayed if _enqueue(self.engine, intent) == ids[intent.key])
        self.say(f"  {same} of {len(replayed)} intents returned their existing operation")
        refused = _conflict_refused(self.engine, script[0])
        self.say("  a reused intent key with another payload: refused (IntentConflict)")
        self.say(f"the agent enqueues the other {len(script) - half}")
        for intent in script[half:]:
            ids[intent.key] = _enqueue(self.engine, intent)
        undecided = self._wait(len(script), supervisor)
        return self._judge(service, ids, same, refused, killed, undecided, metrics, started)

    def _kill_a_worker(self, supervisor: Supervisor) -> bool:
        for status in supervisor.statuses():
            if status.name == "worker-1" and status.pid is not None:
                self.say(f"crash: SIGKILL worker-1 (pid {status.pid}) mid-run")
                os.killpg(status.pid, signal.SIGKILL)
                return True
        return False

    def _wait(self, total: int, supervisor: Supervisor) -> int:
        deadline = time.monotonic() + self.timeout_s
        while True:
            for line in supervisor.poll():
                self.say(line)
            _check_not_crash_looping(supervisor)
            states = _states(self.engine, self.run_id)
            decided = sum(states.get(s, 0) for s in DECIDED)
            if self.progress is not None:
                self.progress(states, total)
            if decided >= total or time.monotonic() > deadline:
                return total - decided
            time.sleep(0.5)

    def _judge(  # noqa: PLR0917 -- one private call site, every value named there
        self,
        service: DeployService,
        ids: dict[str, str],
        same: int,
        refused: bool,
        killed: bool,
        undecided: int,
        metrics: MetricsServer,
        started: float,
    ) -> DemoReport:
        by_key = service.effects_by_key()
        ledger = {effect.key: effect.id for effect in service.ledger()}
        ours = set(ids.values())
        with self.engine.connect() as conn:
            rows = sql.dev.outcomes(conn, prefix=f"demo-{self.run_id}-")
        wrong = service.contradicted((row.id, row.state, row.remote_ref) for row in rows)
        waiting = [
            (row.id, row.tool, ledger.get(row.id)) for row in rows if row.state == "needs_human"
        ]
        return DemoReport(
            run=self.run_id,
            intents=len(ids),
            reenqueued_same=same,
            conflict_refused=refused,
            worker_killed=killed,
            states=dict(Counter(str(row.state) for row in rows)),
            effects=sum(n for key, n in by_key.items() if key in ours),
            duplicates=sum(1 for key, n in by_key.items() if key in ours and n > 1),
            undecided=undecided,
            wrong=wrong,
            seconds=time.monotonic() - started,
            metrics_url=metrics.url,
            waiting=waiting,
        )
