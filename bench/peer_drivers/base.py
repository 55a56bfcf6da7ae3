"""The harness every driver shares: worker processes, the agents, one measured case, the checks.

A *case* is one system under one load (flat out, or steady at a rate) in one round:

1. the system's tables are emptied (its workers are stopped, so nothing races the TRUNCATE)
   and the reference service forgets every effect and arrival;
2. its worker processes start as real subprocesses (their own session and process group, so
   a Ctrl-C reaches only this process, which stops them) and are warmed up: one intent per
   worker slot (``workers x concurrency``) goes the whole way and is recorded before the
   clock starts; then the service forgets them;
3. ``agents`` threads, each with its own connection, make ``intents`` intents (flat: as fast
   as they can; steady: intent ``i`` due ``i / rate`` seconds after the start), noting
   ``time.time()`` right after the intent's COMMIT returned;
4. it waits until every result is recorded (a round fails if nothing is recorded for
   ``stall_s``, or a worker exits), then computes the rows (:func:`measured_rows`) and checks
   (:func:`check_exactly_once`) that every intent reached the service exactly once and has
   its result;
5. the workers are stopped (SIGTERM to the group, SIGKILL after a grace period), in a
   ``finally``: also on a failure or a Ctrl-C.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import sqlalchemy
from cpu import CpuMeter, pids_named
from report import Results, say
from rich.markup import escape
from rounds import Case, percentile
from services import ServiceProcess
from sqlalchemy import Engine, text

from outbox.dev.stack import Service
from peer_drivers.job import TABLES, TABLES_DDL, sqlalchemy_url

PER_S, MS, CORE = "ops/s", "ms", "% core"
BENCH_DIR = Path(__file__).resolve().parents[1]

Rows = dict[str, tuple[float, str]]


@dataclass(frozen=True)
class Load:
    """Flat out (``rate`` None) or steady at ``rate`` intents/s in total; by the settings'
    agent threads, or by ``agents`` of them (peers.py's further ``--agents`` counts)."""

    rate: float | None = None
    agents: int | None = None
    #: The agents' act alone: flat out with no worker (nor relay) running, so the enqueue
    #: and its commit do not share the CPU with the system's own work (issue 35).
    alone: bool = False

    @property
    def kind(self) -> str:
        """``flat``, ``steady`` or ``enqueue alone``."""
        if self.alone:
            return "enqueue alone"
        return "flat" if self.rate is None else "steady"

    @property
    def prefix(self) -> str:
        """The prefix of this load's rows: ``flat``, ``steady``, or ``flat, 1 agent``."""
        return self.kind + self._agents_suffix

    @property
    def label(self) -> str:
        """``flat``, ``steady 100/s``, ``flat, 1 agent`` or ``enqueue alone, 1 agent``."""
        if self.alone:
            return self.prefix
        shape = "flat" if self.rate is None else f"steady {self.rate:g}/s"
        return shape + self._agents_suffix

    def agent_threads(self, settings: Settings) -> int:
        """The agent threads this load runs with."""
        return settings.agents if self.agents is None else self.agents

    @property
    def _agents_suffix(self) -> str:
        if self.agents is None:
            return ""
        return f", {self.agents} agent" + ("" if self.agents == 1 else "s")


@dataclass(frozen=True)
class Settings:
    """What every system is given: the same load, the same worker budget, the same remote."""

    intents: int
    agents: int
    workers: int
    concurrency: int
    service: ServiceProcess
    workdir: Path
    cpu: Results
    log_level: str = "WARNING"
    stall_s: float = 60.0

    @property
    def warm(self) -> int:
        """Intents of the warm-up: one per worker slot."""
        return self.workers * self.concurrency


class System(abc.ABC):
    """One system measured by ``peers.py``: a case per load, problems found, cleanup."""

    #: Short name, as ``--systems`` spells it.
    key: str
    #: The section of its rows in the table.
    label: str

    def __init__(self) -> None:
        self.problems: list[str] = []

    def case(self, load: Load) -> Case:
        """This system under ``load``, as a case of ``run_rounds``."""
        return Case(f"{self.label}, {load.label}", lambda: self.run(load), self.label)

    @abc.abstractmethod
    def run(self, load: Load) -> Rows:
        """One measured case."""

    def close(self) -> None:  # noqa: B027 -- optional
        """Release what the system holds (engines, clients)."""


def tell(line: str) -> None:
    """A progress line on stderr, printed as it is (``report.say`` reads rich markup, and
    ``'.[bench]'`` or a worker's ``[WARNING/MainProcess]`` would be taken for a tag)."""
    say(escape(line))


# --- worker processes -----------------------------------------------------------------------

_live: set[WorkerProcess] = set()


class WorkerProcess(Service):
    """A worker of a peer: ``python -m MODULE ARGS`` with the bench directory importable, its
    output in a log file; stopped at exit if a crash left it running."""

    def __init__(
        self,
        name: str,
        module: str,
        args: Sequence[str],
        env: Mapping[str, str],
        log_dir: Path,
    ) -> None:
        python_path = os.pathsep.join(filter(None, [str(BENCH_DIR), env.get("PYTHONPATH")]))
        super().__init__(name, args, {**env, "PYTHONPATH": python_path}, log_dir, module=module)
        _live.add(self)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM its process group, SIGKILL if it lingers; the exit code."""
        _live.discard(self)
        return super().stop(timeout)

    def tail(self, lines: int = 15) -> list[str]:
        """The last ``lines`` lines it printed."""
        try:
            return self.output().strip().splitlines()[-lines:]
        except OSError:
            return []


@atexit.register
def _stop_leftovers() -> None:
    """Whatever a crash left running (a normal run stops its workers in a ``finally``)."""
    for worker in list(_live):
        worker.stop(timeout=2)


def stop_stray_children(grace_s: float = 5.0) -> list[int]:
    """Stop the children of this process that lead a session of their own (every worker, relay
    and peer worker is started so) and are still running; their pids.

    The last safety net of a run: a Ctrl-C landing between a ``Popen`` and the bookkeeping that
    would stop the process (ours or bench/pipeline.py's) must not leave it running.
    """
    me, strays = os.getpid(), []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, ppid, session = fields[0], int(fields[1]), int(fields[3])
        if ppid == me and session == int(entry.name) and state != "Z":
            strays.append(session)
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in strays:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signum)
        deadline = time.monotonic() + grace_s
        while signum == signal.SIGTERM and time.monotonic() < deadline:
            if all(_reaped(pid) for pid in strays):
                break
            time.sleep(0.1)
    for pid in strays:
        _reaped(pid)
    return strays


def _reaped(pid: int) -> bool:
    """Whether child ``pid`` has exited (and is now reaped)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid


# --- the agents -----------------------------------------------------------------------------


class Agent(Protocol):
    """One agent's connection: ``enqueue`` makes one intent in its own transaction and
    returns ``time.time()`` taken right after that transaction's COMMIT returned."""

    def enqueue(self, i: int, key: str) -> float: ...

    def close(self) -> None: ...


def run_agents(
    open_agent: Callable[[], Agent], agents: int, intents: int, rate: float | None
) -> dict[str, float]:
    """``agents`` threads make ``intents`` intents (keys: new UUIDs); {key: commit time}.

    The pacing is bench/pipeline.py's ``Agents``: flat out when ``rate`` is None, else intent
    ``i`` is due ``i / rate`` s after the start and an agent that falls behind goes on at once.
    Every agent's connection is open before the start.
    """
    commits: dict[str, float] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(agents)
    lock = threading.Lock()

    stop = threading.Event()  # the caller was interrupted: the agents stop too

    def agent(k: int) -> None:
        mine: dict[str, float] = {}
        try:
            connection = open_agent()
            try:
                barrier.wait()
                start = time.monotonic()
                for i in range(k, intents, agents):
                    if stop.is_set():
                        return
                    if rate is not None:
                        wait = start + i / rate - time.monotonic()
                        if wait > 0:
                            time.sleep(wait)
                    key = str(uuid.uuid4())
                    mine[key] = connection.enqueue(i, key)
            finally:
                connection.close()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()
            raise
        with lock:
            commits.update(mine)

    threads = [threading.Thread(target=agent, args=(k,), daemon=True) for k in range(agents)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except BaseException:
        stop.set()
        barrier.abort()
        raise
    if errors:
        raise RuntimeError(f"an agent failed: {errors[0]!r}") from errors[0]
    return commits


# --- rows and checks ------------------------------------------------------------------------


def measured_rows(
    load: Load,
    commits: Mapping[str, float],
    arrivals: Mapping[str, float],
    recorded: Mapping[str, float],
) -> Rows:
    """The rows of one case, named ``flat: ...`` or ``steady: ...`` (``load.prefix``).

    * throughput: results recorded / (last result recorded - first intent commit);
    * enqueue rate (offered, flat only): intents / (last commit - first commit);
    * steady only: commit -> arrival (the request reaching the service) p50, p95, p99, and
      commit -> result recorded p50, p99.
    """
    done = [recorded[key] for key in commits if key in recorded]
    first = min(commits.values())
    rows: Rows = {
        f"{load.prefix}: throughput": (
            len(done) / max(max(done, default=first) - first, 1e-9),
            PER_S,
        )
    }
    if load.rate is None:
        last_commit = max(commits.values())
        rows[f"{load.prefix}: enqueue rate (offered)"] = (
            len(commits) / max(last_commit - first, 1e-9),
            PER_S,
        )
        return rows
    to_arrival = [1000 * (arrivals[key] - t) for key, t in commits.items() if key in arrivals]
    to_result = [1000 * (recorded[key] - t) for key, t in commits.items() if key in recorded]
    for q in (50, 95, 99):
        rows[f"{load.prefix}: commit -> arrival p{q}"] = (percentile(to_arrival, q), MS)
    for q in (50, 99):
        rows[f"{load.prefix}: commit -> result p{q}"] = (percentile(to_result, q), MS)
    return rows


def enqueue_rows(load: Load, commits: Iterable[float]) -> Rows:
    """The row of an ``enqueue alone`` case: intents / (last commit - first commit)."""
    times = list(commits)
    return {
        f"{load.prefix}: enqueue rate": (
            len(times) / max(max(times) - min(times), 1e-9),
            PER_S,
        )
    }


def check_exactly_once(
    where: str,
    keys: Iterable[str],
    effects: Mapping[str, int],
    recorded: Mapping[str, float] | None = None,
) -> list[str]:
    """Problems, if any: an intent that did not reach the service exactly once, an effect
    for no intent of this case, an intent without its recorded result."""
    keys = set(keys)
    problems = []
    missing = sorted(key for key in keys if effects.get(key, 0) == 0)
    doubled = sorted(key for key in keys if effects.get(key, 0) > 1)
    stray = sorted(key for key in effects if key not in keys)
    if missing:
        problems.append(f"{where}: {len(missing)} intents never reached the service")
    if doubled:
        problems.append(f"{where}: {len(doubled)} intents reached it more than once")
    if stray:
        problems.append(f"{where}: {len(stray)} effects with a key of no intent of this case")
    if recorded is not None:
        unrecorded = [key for key in keys if key not in recorded]
        if unrecorded:
            problems.append(f"{where}: {len(unrecorded)} intents without a recorded result")
    return problems


# --- a peer ---------------------------------------------------------------------------------


class PeerDriver(System):
    """A peer system: its workers, its agents, its tables; :meth:`run` is one case."""

    def __init__(self, settings: Settings) -> None:
        super().__init__()
        self.settings = settings
        self.cases = 0

    # What each peer provides.

    @abc.abstractmethod
    def reset(self) -> None:
        """Empty the job's tables and the peer's queue (its workers are stopped)."""

    @abc.abstractmethod
    def start_workers(self, log_dir: Path) -> list[WorkerProcess]:
        """Start the worker processes (warm-up follows)."""

    @abc.abstractmethod
    def open_agent(self) -> Agent:
        """One agent's connection (called in the agent's thread)."""

    @abc.abstractmethod
    def recorded(self) -> dict[str, float]:
        """{intent key: epoch seconds its result was recorded}."""

    @abc.abstractmethod
    def count_recorded(self) -> int:
        """Results recorded so far (warm-up included)."""

    @abc.abstractmethod
    def postgres_pids(self) -> list[int]:
        """PostgreSQL server processes of this peer's databases, and the background ones."""

    def cpu_groups(self) -> dict[str, Callable[[], Iterable[int]]]:
        """Extra groups of processes whose CPU is shown (the broker, for instance)."""
        return {}

    # The case.

    def run(self, load: Load) -> Rows:
        s = self.settings
        self.cases += 1
        where = f"{self.label}, {load.label}, case {self.cases}"
        self.reset()
        s.service.clear()
        if load.alone:
            return self._enqueue_alone(load)
        log_dir = s.workdir / f"{self.key}-{load.kind}-{self.cases}"
        log_dir.mkdir(parents=True)
        workers: list[WorkerProcess] = []
        failed = True
        try:
            workers = self.start_workers(log_dir)
            agents = load.agent_threads(s)
            run_agents(self.open_agent, min(agents, s.warm), s.warm, None)
            self._wait_recorded(s.warm, workers, f"{where}, warming up")
            s.service.clear()
            meter = CpuMeter(
                {
                    "agents (this process)": lambda: [os.getpid()],
                    "workers": lambda: [w.pid for w in workers],
                    "service": lambda: [s.service.pid],
                    "postgres (these databases, background)": self.postgres_pids,
                    **self.cpu_groups(),
                }
            )
            meter.start()
            commits = run_agents(self.open_agent, agents, s.intents, load.rate)
            self._wait_recorded(s.warm + s.intents, workers, f"{where}, measuring")
            for name, percent in meter.stop().items():
                s.cpu.add(name, percent, unit=CORE, section=f"{self.label}, {load.label}")
            recorded = self.recorded()
            self.problems += check_exactly_once(
                where, commits, s.service.effects_by_key(), recorded
            )
            rows = measured_rows(load, commits, s.service.arrivals(), recorded)
            failed = False
            return rows
        finally:
            for worker in workers:
                worker.stop()
            if failed or self.problems:
                for worker in workers:
                    lines = worker.tail()
                    if lines:
                        tell(f"--- {where}: {worker.name} ---")
                        for line in lines:
                            tell(line)

    def _enqueue_alone(self, load: Load) -> Rows:
        """The agents' act with no worker running; what they made is emptied afterwards."""
        s = self.settings
        meter = CpuMeter(
            {
                "agents (this process)": lambda: [os.getpid()],
                "postgres (these databases, background)": self.postgres_pids,
                **self.cpu_groups(),
            }
        )
        meter.start()
        try:
            commits = run_agents(self.open_agent, load.agent_threads(s), s.intents, None)
        finally:
            for name, percent in meter.stop().items():
                s.cpu.add(name, percent, unit=CORE, section=f"{self.label}, {load.label}")
            self.reset()
        return enqueue_rows(load, commits.values())

    def _wait_recorded(self, expected: int, workers: Sequence[WorkerProcess], what: str) -> None:
        """Until ``expected`` results are recorded; an error if it stalls or a worker died."""
        last, last_change = -1, time.monotonic()
        while True:
            count = self.count_recorded()
            if count >= expected:
                return
            if count != last:
                last, last_change = count, time.monotonic()
            dead = [w.name for w in workers if not w.alive()]
            stalled = time.monotonic() - last_change > self.settings.stall_s
            if dead or stalled:
                why = (
                    f"{', '.join(dead)} exited"
                    if dead
                    else f"no progress for {self.settings.stall_s:g}s"
                )
                raise RuntimeError(f"{what}: {why} ({count} of {expected} recorded)")
            time.sleep(0.05)


# --- the job's tables -----------------------------------------------------------------------


def agents_engine(url: str, agents: int) -> Engine:
    """The agents' engine, as an application makes one (bench/pipeline.py's sizing)."""
    return sqlalchemy.create_engine(sqlalchemy_url(url), pool_size=agents + 2, max_overflow=4)


def create_tables(engine: Engine) -> None:
    """``bench_intents`` and ``bench_results``."""
    with engine.begin() as conn:
        for ddl in TABLES_DDL:
            conn.execute(text(ddl))


def truncate_tables(engine: Engine, *more: str) -> None:
    """Empty the job's tables and ``more``."""
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join([*TABLES, *more])} CASCADE"))


def recorded_results(engine: Engine) -> dict[str, float]:
    """{intent id: epoch seconds of its result's ``recorded_at``}."""
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT id::text, extract(epoch FROM recorded_at) FROM bench_results")
        )
        return {str(key): float(at) for key, at in rows}


def count_results(engine: Engine) -> int:
    """Results recorded so far."""
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT count(*) FROM bench_results")).scalar_one())


def server_pids(engine: Engine, databases: Sequence[str]) -> list[int]:
    """Server processes of connections to ``databases`` and the background processes (WAL
    writer, checkpointer...), not other databases' backends; meaningful on a local server."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT pid FROM pg_stat_activity WHERE datname = ANY(:names) "
                "OR backend_type <> 'client backend'"
            ),
            {"names": list(databases)},
        )
        return [int(pid) for (pid,) in rows]


def rabbitmq_pids() -> list[int]:
    """The RabbitMQ server (the whole broker, every vhost)."""
    return pids_named("beam.smp")
