"""The chaos run (``outbox chaos``): the whole stack under random crashes, judged by the remote.

It makes a PostgreSQL cluster of its own and a RabbitMQ node of its own (so crashing or
restarting them disturbs nothing else; or it uses the database broker), and runs two relays,
two workers and beat as real processes beside the reference service with ambiguous faults.
An agent enqueues the intents (and re-enqueues some, as a restarted agent would) while the run

* SIGKILLs a worker or a relay at random, and starts it again;
* crashes PostgreSQL (``pg_ctl stop -m immediate``: recovery from the WAL) and restarts it;
* restarts its RabbitMQ node (``rabbitmqctl -n <node> stop_app`` / ``start_app``: every
  connection drops). It never restarts a node it did not start, unless the caller names that
  node (:attr:`ChaosConfig.rabbitmq_node`, ``--i-own-this-rabbitmq-node``);
* cuts a worker's database connection (``pg_terminate_backend``) while its call is in flight.

Then it waits for quiescence and judges: every intent the agent saw committed ends
`confirmed`, `failed` or `needs_human` (else it is *lost*); no key has two effects at the
remote (a *duplicate*); a `confirmed` row names an effect the remote holds and a `failed` one
has none (else a *wrong verdict*). :attr:`ChaosReport.ok` is false on any of them.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from outbox import api, migrate, sql
from outbox.db import create_engine
from outbox.dev.clusters import LocalCluster
from outbox.dev.rabbitmq import RabbitNode, rabbitmq_installed
from outbox.dev.service import DeployService
from outbox.dev.stack import Service, Services
from outbox.dev.tool_config import TOOL, http_tool_toml
from outbox.errors import DatabaseUnavailable
from outbox.locks import operation_lock_key

BrokerKind = Literal["rabbitmq", "database"]
DECIDED = ("confirmed", "failed", "needs_human")
TIMEOUT_S = 2.0
HORIZON_S = 8.0
#: The remote's faults, as shares of ``ambiguous_rate``; a few plain refusals besides.
FAULT_MIX = {"commit_then_timeout": 0.4, "commit_then_reset": 0.2, "error_503": 0.2, "slow": 0.2}
REJECT_RATE = 0.02
RABBITMQ_PORT = 5672
#: The long-running processes; kills pick among the relays and workers.
PROCESSES: dict[str, tuple[str, ...]] = {
    "relay-1": ("relay", "--log-level", "WARNING", "--poll-interval", "0.2"),
    "relay-2": ("relay", "--log-level", "WARNING", "--poll-interval", "0.2"),
    "worker-1": ("worker", "-P", "threads", "-c", "4", "-n", "w1@%h", "--log-level", "WARNING"),
    "worker-2": ("worker", "-P", "threads", "-c", "4", "-n", "w2@%h", "--log-level", "WARNING"),
    "beat": ("beat", "--log-level", "WARNING"),
}
KILLABLE = ("relay-1", "relay-2", "worker-1", "worker-2")


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    """What the run does; the defaults are the bounded run CI makes."""

    intents: int = 500
    kills: int = 20
    pg_restarts: int = 1
    rabbitmq_restarts: int = 1
    cuts: int = 3
    #: Seconds over which the agent enqueues and the faults are spread.
    chaos_s: float = 60.0
    #: Seconds allowed after the chaos for every operation to be decided.
    settle_s: float = 240.0
    ambiguous_rate: float = 0.2
    seed: int | None = None
    #: None: RabbitMQ when a node of its own can be started (or one is named), else the
    #: database broker.
    broker: BrokerKind | None = None
    #: An existing node the caller owns, to use (a throw-away vhost on 127.0.0.1:5672) and
    #: restart with ``rabbitmqctl -n``. None: a node of its own, started and halted by the run.
    rabbitmq_node: str | None = None
    workdir: Path | None = None
    keep: bool = False


@dataclass
class ChaosReport:
    """The verdict of one run."""

    seed: int
    broker: str
    intents: int
    operations: int
    reenqueued: int
    kills: int
    exits: int
    pg_restarts: int
    rabbitmq_restarts: int
    cuts: int
    states: dict[str, int]
    effects: int
    duplicates: int
    lost: int
    wrong: int
    seconds: float
    workdir: str
    #: The RabbitMQ node it used and restarted (None on the database broker).
    rabbitmq_node: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No duplicate, nothing lost, no wrong verdict."""
        return not self.problems

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs of the verdict table, in order."""
        return [
            ("intents committed by the agent", str(self.intents)),
            ("  re-enqueued (same key, same payload)", str(self.reenqueued)),
            ("operations in the table", str(self.operations)),
            ("SIGKILLs (workers, relays)", str(self.kills)),
            ("unplanned exits (restarted)", str(self.exits)),
            ("PostgreSQL crash-restarts", str(self.pg_restarts)),
            ("RabbitMQ restarts", _or_na(self.rabbitmq_restarts, self.broker)),
            ("connections cut mid-call", str(self.cuts)),
            ("confirmed", str(self.states.get("confirmed", 0))),
            ("failed", str(self.states.get("failed", 0))),
            ("needs_human", str(self.states.get("needs_human", 0))),
            ("effects at the remote", str(self.effects)),
            ("duplicates", str(self.duplicates)),
            ("lost", str(self.lost)),
            ("wrong verdicts", str(self.wrong)),
        ]


def _or_na(count: int, broker: str) -> str:
    return str(count) if broker == "rabbitmq" else "n/a (database broker)"


Progress = Callable[[str], None]


class ChaosRefused(ValueError):
    """The run cannot keep to what it may touch with this configuration."""


def rabbitmq_reachable() -> bool:
    """Whether a broker answers on 127.0.0.1:5672 and ``rabbitmqctl`` is installed."""
    if shutil.which("rabbitmqctl") is None:
        return False
    try:
        with socket.create_connection(("127.0.0.1", RABBITMQ_PORT), timeout=1):
            return True
    except OSError:
        return False


def run_chaos(config: ChaosConfig, progress: Progress | None = None) -> ChaosReport:
    """Run the chaos described by ``config``; see the module doc."""
    say = progress or (lambda _line: None)
    seed = config.seed if config.seed is not None else random.SystemRandom().randrange(2**31)
    broker = _choose_broker(config)
    workdir = config.workdir or Path(tempfile.mkdtemp(prefix="outbox-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"chaos run: seed {seed}, {broker} broker, working in {workdir}")
    cluster = LocalCluster(workdir / "postgres")
    try:
        cluster.start()
        url = cluster.create_database("outbox")
        with _rabbitmq(broker, config.rabbitmq_node, workdir, say) as rabbit:
            run = _Run(config, seed, broker, cluster, url, rabbit, workdir, say)
            return run.execute()
    finally:
        cluster.stop()
        if not config.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def _choose_broker(config: ChaosConfig) -> BrokerKind:
    """The broker to run on; :class:`ChaosRefused` when RabbitMQ is asked for but the run
    could only restart a node nobody named."""
    if config.broker == "database":
        if config.rabbitmq_node is not None:
            raise ChaosRefused("--i-own-this-rabbitmq-node names a node, but --broker is database")
        return "database"
    if config.rabbitmq_node is not None:
        if not rabbitmq_reachable():
            raise DatabaseUnavailable(
                f"--i-own-this-rabbitmq-node {config.rabbitmq_node}: no RabbitMQ on "
                f"127.0.0.1:{RABBITMQ_PORT}, or rabbitmqctl is not installed"
            )
        return "rabbitmq"
    if rabbitmq_installed():
        return "rabbitmq"
    if config.broker == "rabbitmq":
        raise ChaosRefused(
            "--broker rabbitmq restarts only a RabbitMQ node it starts itself, and there is no "
            "rabbitmq-server on PATH to start one: install RabbitMQ, name a node of yours with "
            "--i-own-this-rabbitmq-node NODE, or use --broker database"
        )
    return "database"


@dataclass(frozen=True)
class _Rabbit:
    """The broker the stack uses, and how to restart it (None: the database broker)."""

    url: str | None
    node: str | None
    stop_app: Callable[[], None]
    start_app: Callable[[], None]


@contextmanager
def _rabbitmq(
    broker: BrokerKind, named: str | None, workdir: Path, say: Progress
) -> Iterator[_Rabbit]:
    """A RabbitMQ node of its own, the named node's throw-away vhost, or the database broker."""
    if broker == "database":
        yield _Rabbit(None, None, lambda: None, lambda: None)
    elif named is None:
        node = RabbitNode(workdir / "rabbitmq")
        say(f"RabbitMQ: starting a node of its own, {node.name} on 127.0.0.1:{node.port}")
        try:
            node.start()
            yield _Rabbit(node.url, node.name, node.stop_app, node.start_app)
        finally:
            node.stop()
    else:
        with _named_vhost(named, say) as url:
            yield _Rabbit(
                url,
                named,
                lambda: _rabbitmqctl(named, "stop_app"),
                lambda: _rabbitmqctl(named, "start_app"),
            )


@contextmanager
def _named_vhost(node: str, say: Progress) -> Iterator[str]:
    """A throw-away vhost on the node the caller named (it listens on 127.0.0.1:5672)."""
    vhost = f"outbox_chaos_{uuid.uuid4().hex[:8]}"
    _rabbitmqctl(node, "add_vhost", vhost)
    _rabbitmqctl(node, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    say(f"RabbitMQ: vhost {vhost} on {node}, the node you named (it will be restarted)")
    try:
        yield f"amqp://guest:guest@127.0.0.1:{RABBITMQ_PORT}/{vhost}"
    finally:
        _rabbitmqctl(node, "delete_vhost", vhost, check=False)


def _rabbitmqctl(node: str, *args: str, check: bool = True) -> None:
    # The named node is an installed one: rabbitmqctl as found on PATH (Debian's wrapper runs
    # it as the rabbitmq user, whose Erlang cookie that node accepts).
    ctl = shutil.which("rabbitmqctl") or "rabbitmqctl"
    subprocess.run(  # noqa: S603 -- the installed rabbitmqctl, our own arguments
        [str(ctl), "-n", node, *args], check=check, capture_output=True, timeout=120
    )


class _Agent(threading.Thread):
    """Enqueues the intents one transaction each, spread over the chaos; retries through outages.

    An enqueue whose commit failed, or may have failed, is simply made again with the same key
    and payload: that is the idempotent retry the API promises. Now and then it re-enqueues an
    intent it already committed, as an agent restarted with its conversation would.
    """

    def __init__(self, engine: Engine, intents: int, spread_s: float, rng: random.Random) -> None:
        super().__init__(name="chaos-agent", daemon=True)
        self.engine = engine
        self.intents = intents
        self.spread_s = spread_s
        self.rng = rng
        self.committed: set[str] = set()
        self.reenqueued = 0
        self.errors = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        for i in range(self.intents):
            wait = started + self.spread_s * i / self.intents - time.monotonic()
            if wait > 0 and self.stopping.wait(wait):
                return
            self._enqueue(i)
            if self.committed and self.rng.random() < 0.05:
                self._enqueue(int(self.rng.choice(sorted(self.committed)).split("-")[1]))
                self.reenqueued += 1

    def _enqueue(self, i: int) -> None:
        key = f"chaos-{i}"
        while not self.stopping.is_set():
            try:
                with Session(self.engine) as session, session.begin():
                    api.enqueue(
                        session,
                        tool=TOOL,
                        target=f"project-{i % 10}",
                        payload={"version": f"1.{i // 100}.{i % 100}"},
                        intent_key=key,
                    )
            # enqueue raises DatabaseUnavailable while PostgreSQL is down; the COMMIT, the
            # driver's own error: either way nothing may be known, and the same key is safe.
            except (DBAPIError, DatabaseUnavailable):
                self.errors += 1
                self.stopping.wait(0.5)
                continue
            self.committed.add(key)
            return


class _Stack:
    """The processes, restarted when they die; kills are counted apart from exits."""

    def __init__(self, services: Services, say: Progress) -> None:
        self.services = services
        self.say = say
        self.running: dict[str, Service] = {}
        self.exits = 0
        self.lock = threading.Lock()

    def start_all(self) -> None:
        for name in PROCESSES:
            self._start(name)

    def _start(self, name: str) -> None:
        self.running[name] = self.services.start(name, *PROCESSES[name])

    def kill(self, name: str) -> None:
        with self.lock:
            self.running[name].kill()
            self._start(name)

    def revive(self) -> None:
        """Start again every process that exited on its own (an outage may end one)."""
        with self.lock:
            for name, service in list(self.running.items()):
                if not service.alive():
                    self.exits += 1
                    self.say(f"{name} exited ({service.process.returncode}); starting it again")
                    self._start(name)

    def pids(self) -> set[int]:
        with self.lock:
            return {service.pid for service in self.running.values()}


class _Run:
    def __init__(  # noqa: PLR0917 -- one private call site, every value named there
        self,
        config: ChaosConfig,
        seed: int,
        broker: BrokerKind,
        cluster: LocalCluster,
        url: str,
        rabbit: _Rabbit,
        workdir: Path,
        say: Progress,
    ) -> None:
        self.config = config
        self.seed = seed
        self.broker = broker
        self.cluster = cluster
        self.url = url
        self.rabbit = rabbit
        self.workdir = workdir
        self.say = say
        self.rng = random.Random(seed)  # noqa: S311 -- reproducible chaos, not cryptography
        self.kills = 0
        self.pg_restarts = 0
        self.rabbitmq_restarts = 0
        self.cuts = 0

    def execute(self) -> ChaosReport:
        engine = create_engine(self.url, pool_size=2)
        try:
            migrate.upgrade(engine)
            rates = {mode: share * self.config.ambiguous_rate for mode, share in FAULT_MIX.items()}
            rates["reject_422"] = REJECT_RATE
            with DeployService(
                port=0, fault_rates=rates, seed=self.seed, fault_delay_s=TIMEOUT_S + 1
            ) as service:
                services = Services(self._env(service.url), self.workdir)
                stack = _Stack(services, self.say)
                started = time.monotonic()
                try:
                    stack.start_all()
                    agent = _Agent(engine, self.config.intents, self.config.chaos_s, self.rng)
                    agent.start()
                    self._chaos(stack, service, engine, agent)
                    agent.join()
                    undecided = self._settle(stack, engine, agent)
                finally:
                    agent.stopping.set()
                    services.stop_all()
                return self._judge(engine, service, stack, agent, undecided, started)
        finally:
            engine.dispose()

    def _env(self, service_url: str) -> dict[str, str]:
        config = self.workdir / "tools.toml"
        config.write_text(
            http_tool_toml(
                service_url,
                timeout_s=TIMEOUT_S,
                send_deadline_s=1.0,
                inflight_horizon_s=HORIZON_S,
                max_checks=8,
                max_attempts=10,
            ),
            encoding="utf-8",
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env |= {
            "OUTBOX_DATABASE_URL": self.url,
            "OUTBOX_CONFIG": str(config),
            "OUTBOX_HOME": str(self.workdir / "home"),
            "OUTBOX_SENT_TIMEOUT": str(TIMEOUT_S + 2),
            "OUTBOX_SENT_MAX_AGE": "300",
            "OUTBOX_SWEEP_INTERVAL": "1",
            "OUTBOX_REPUBLISH_AFTER": "3",
            "OUTBOX_LOOKUP_LEASE": "10",
        }
        if self.rabbit.url:
            env["OUTBOX_BROKER_URL"] = self.rabbit.url
        return env

    # --- the faults -------------------------------------------------------------------------

    def _schedule(self) -> list[tuple[float, str]]:
        """(seconds after the start, fault) for every planned fault, in time order."""
        span = self.config.chaos_s
        kills = self.config.kills
        plan = [(span * (i + self.rng.uniform(0.2, 0.8)) / kills, "kill") for i in range(kills)]
        restarts = self.config.pg_restarts
        plan += [(span * (i + 1) / (restarts + 1) - 3, "postgres") for i in range(restarts)]
        if self.broker == "rabbitmq":
            restarts = self.config.rabbitmq_restarts
            plan += [
                (min(span * (i + 0.5) / restarts + 5, span - 1), "rabbitmq")
                for i in range(restarts)
            ]
        cuts = self.config.cuts
        plan += [(span * (i + 0.5) / cuts, "cut") for i in range(cuts)]
        return sorted(plan)

    def _chaos(self, stack: _Stack, service: DeployService, engine: Engine, agent: _Agent) -> None:
        started = time.monotonic()
        last_report = started
        for at, fault in self._schedule():
            while time.monotonic() - started < at:
                stack.revive()
                if time.monotonic() - last_report > 5:
                    last_report = time.monotonic()
                    self._progress(engine, agent, started)
                time.sleep(0.1)
            self._inflict(fault, stack, service)

    def _inflict(self, fault: str, stack: _Stack, service: DeployService) -> None:
        if fault == "kill":
            name = self.rng.choice(KILLABLE)
            self.say(f"SIGKILL {name}")
            stack.kill(name)
            self.kills += 1
        elif fault == "postgres":
            self.say("PostgreSQL: crash (immediate stop), restart in 2s")
            self.cluster.crash()
            time.sleep(2)
            self.cluster.start()
            self.pg_restarts += 1
        elif fault == "rabbitmq":
            self.say(f"RabbitMQ: stop_app on {self.rabbit.node}, start_app in 2s")
            self.rabbit.stop_app()
            time.sleep(2)
            self.rabbit.start_app()
            self.rabbitmq_restarts += 1
        elif fault == "cut":
            self.cuts += self._cut_in_flight(service, stack)

    def _cut_in_flight(self, service: DeployService, stack: _Stack, wait_s: float = 10.0) -> int:
        """Terminate the lock connection of a dispatcher whose request the service is holding."""
        deadline = time.monotonic() + wait_s
        engine = create_engine(self.url)
        try:
            while time.monotonic() < deadline:
                for key in service.in_flight():
                    with suppress(ValueError), engine.begin() as conn:
                        pid = sql.locks.lock_holder_pid(conn, operation_lock_key(uuid.UUID(key)))
                        if pid is None:
                            continue
                        sql.dev.terminate_backend(conn, pid)
                        self.say(f"cut the database connection of the dispatcher of {key}")
                        return 1
                stack.revive()
                time.sleep(0.05)
        except DBAPIError:
            return 0
        finally:
            engine.dispose()
        self.say("no call in flight to cut this time")
        return 0

    # --- quiescence and the verdict ------------------------------------------------------------

    def _progress(self, engine: Engine, agent: _Agent, started: float) -> None:
        states = _states(engine)
        counts = ", ".join(f"{k} {v}" for k, v in sorted(states.items())) or "none yet"
        self.say(
            f"{time.monotonic() - started:5.0f}s  enqueued {len(agent.committed)}/"
            f"{self.config.intents}  {counts}  kills {self.kills}"
        )

    def _settle(self, stack: _Stack, engine: Engine, agent: _Agent) -> int:
        self.say("chaos over; waiting for every operation to be decided")
        deadline = time.monotonic() + self.config.settle_s
        last_report = 0.0
        while True:
            stack.revive()
            states = _states(engine)
            undecided = len(agent.committed) - sum(states.get(s, 0) for s in DECIDED)
            if undecided <= 0 or time.monotonic() > deadline:
                return max(undecided, 0)
            if time.monotonic() - last_report > 5:
                last_report = time.monotonic()
                self.say(f"  {undecided} undecided: {dict(sorted(states.items()))}")
            time.sleep(1)

    def _judge(  # noqa: PLR0917
        self,
        engine: Engine,
        service: DeployService,
        stack: _Stack,
        agent: _Agent,
        undecided: int,
        started: float,
    ) -> ChaosReport:
        with engine.connect() as conn:
            rows = sql.dev.outcomes(conn)
        by_key = service.effects_by_key()
        keys = {str(row.intent_key) for row in rows}
        decided = {str(row.intent_key) for row in rows if row.state in DECIDED}
        lost = len(agent.committed - keys) + len(agent.committed & keys - decided)
        wrong = service.contradicted((row.id, row.state, row.remote_ref) for row in rows)
        duplicates = sum(1 for count in by_key.values() if count > 1)
        problems = []
        if duplicates:
            problems.append(f"{duplicates} operations have more than one effect at the remote")
        if lost:
            problems.append(f"{lost} committed intents were not decided ({undecided} undecided)")
        if wrong:
            problems.append(f"{wrong} verdicts contradict the remote's ledger")
        return ChaosReport(
            seed=self.seed,
            broker=self.broker,
            intents=len(agent.committed),
            operations=len(rows),
            reenqueued=agent.reenqueued,
            kills=self.kills,
            exits=stack.exits,
            pg_restarts=self.pg_restarts,
            rabbitmq_restarts=self.rabbitmq_restarts,
            cuts=self.cuts,
            states=dict(Counter(str(row.state) for row in rows)),
            effects=sum(by_key.values()),
            duplicates=duplicates,
            lost=lost,
            wrong=wrong,
            seconds=time.monotonic() - started,
            workdir=str(self.workdir),
            rabbitmq_node=self.rabbit.node,
            problems=problems,
        )


def _states(engine: Engine) -> dict[str, int]:
    try:
        with engine.connect() as conn:
            return sql.dev.state_counts(conn)
    except DBAPIError:
        return {}
