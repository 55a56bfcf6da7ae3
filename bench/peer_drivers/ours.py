"""Ours: bench/pipeline.py's own ``Pipeline`` (and so its ``Agents``), one per load.

Nothing is re-implemented here, so the numbers in the peers' table come from the same code as
``bench/pipeline.py``'s: per case, a ``Pipeline`` for (broker, flat | steady) runs one round
(``Pipeline.run_round``): it empties the outbox tables, starts ``outbox relay`` and ``W x outbox
worker -P threads -c C -Q dispatch,lookup,reconcile,human`` as real processes, warms them up
with ``W x C`` intents, has the agents ``api.enqueue`` one intent per transaction, waits until
every operation is ``confirmed``, checks and stops the processes. Configured as pipeline.py's
defaults: 1 relay with ``--batch-size 200``, the workers on every queue; the broker is
RabbitMQ on a throw-away vhost (the database broker only when no RabbitMQ is reachable, and the
section then says so). ``ours-traced`` is the same with tracing on at 100 % (issue 34's cost):
each agent intent in a span of its own (the bench process's SDK tracer provider, batch
export), relay and workers with ``OTEL_EXPORTER_OTLP_ENDPOINT`` on an OTLP receiver in a
process of its own (``otlp_sink``) that decodes every export.

Its rows map onto the peers' names: ``throughput`` -> ``flat: throughput`` (confirmed count /
(last ``confirmed`` - first commit)), ``commit -> arrival pN`` -> ``steady: commit -> arrival
pN``, ``commit -> confirmed pN`` -> ``steady: commit -> result pN``. On top of pipeline.py's own
checks (every operation ``confirmed``, no key with two effects), every operation of the case
must have reached the service exactly once and no other key may have.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from cpu import CpuMeter
from otlp_sink import OtlpSink
from pipeline import Agents, Config, Pipeline
from report import Results
from sqlalchemy import text

from peer_drivers import base

#: bench/pipeline.py's defaults for what peers.py does not ask.
RELAYS = 1
BATCH_SIZE = 200
QUEUES = "dispatch,lookup,reconcile,human"

#: Pipeline's row names -> the peers' (after the load's prefix: ``flat: throughput``).
_ROWS = {
    "flat": {
        "throughput": "throughput",
        "enqueue rate (offered)": "enqueue rate (offered)",
    },
    "steady": {
        "throughput": "throughput",
        "commit -> arrival p50": "commit -> arrival p50",
        "commit -> arrival p95": "commit -> arrival p95",
        "commit -> arrival p99": "commit -> arrival p99",
        "commit -> confirmed p50": "commit -> result p50",
        "commit -> confirmed p99": "commit -> result p99",
    },
}


class Ours(base.System):
    """Our pipeline on ``database_url`` (migrated) and ``broker_url`` (None: the database)."""

    key = "ours"

    def __init__(
        self,
        settings: base.Settings,
        *,
        database_url: str,
        broker_url: str | None,
        sink: OtlpSink | None = None,
        database_broker: bool = False,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.database_url = database_url
        self.broker_url = broker_url
        self.broker = "rabbitmq" if broker_url else "database"
        #: Tracing on at 100 % (``ours-traced``): spans exported to ``sink``.
        self.sink = sink
        if sink is not None:
            self.key = "ours-traced"
        elif broker_url is None and database_broker:
            self.key = "ours-db"
        details = [*([] if broker_url else ["database broker"]), *(["traced"] if sink else [])]
        self.label = f"ours ({', '.join(details)})" if details else "ours"
        self.args = argparse.Namespace(
            intents=settings.intents,
            agents=settings.agents,
            workers=settings.workers,
            concurrency=settings.concurrency,
            relays=RELAYS,
            queues=QUEUES,
            batch_size=BATCH_SIZE,
            log_level=settings.log_level,
        )
        self.pipelines: dict[base.Load, tuple[Pipeline, Results]] = {}
        self.cases = 0

    def _pipeline(self, load: base.Load) -> tuple[Pipeline, Results]:
        if load not in self.pipelines:
            agents = load.agent_threads(self.settings)
            workdir = Path(self.settings.workdir) / f"{self.key}-{load.kind}-{agents}"
            workdir.mkdir(parents=True)
            cpu = Results("pipeline's CPU")
            pipeline = Pipeline(
                Config(self.broker, load.kind, load.rate or 0.0, traced=self.sink is not None),
                db_url=self.database_url,
                broker_url=self.broker_url,
                service=self.settings.service,
                args=argparse.Namespace(**{**vars(self.args), "agents": agents}),
                workdir=workdir,
                cpu=cpu,
                sink=self.sink,
            )
            self.pipelines[load] = (pipeline, cpu)
        return self.pipelines[load]

    def run(self, load: base.Load) -> base.Rows:
        self.cases += 1
        if load.alone:
            return self._enqueue_alone(load)
        pipeline, cpu = self._pipeline(load)
        known = len(pipeline.problems)
        measured = pipeline.run_round()
        where = f"{self.label}, {load.label}, case {self.cases}"
        self.problems += [f"{where}: {p}" for p in pipeline.problems[known:]]
        with pipeline.engine.connect() as conn:
            keys = [
                str(op)
                for (op,) in conn.execute(
                    text("SELECT id FROM outbox.operations WHERE intent_key LIKE 'bench-%'")
                )
            ]
        if len(keys) != self.settings.intents:
            self.problems.append(f"{where}: {len(keys)} operations, not {self.settings.intents}")
        self.problems += base.check_exactly_once(
            where, keys, self.settings.service.effects_by_key()
        )
        for (section, name), row in cpu.rows.items():
            if section == pipeline.config.name and row.values:
                self.settings.cpu.add(
                    name, row.values[-1], unit=row.unit, section=f"{self.label}, {load.label}"
                )
        return {
            f"{load.prefix}: {ours}": measured[theirs]
            for theirs, ours in _ROWS[load.kind].items()
            if theirs in measured
        }

    def _enqueue_alone(self, load: base.Load) -> base.Rows:
        """The agents' ``enqueue`` + COMMIT with no relay or worker running, an idle relay's
        flag up (so each commit rings the bell, as it does for a relay waiting for work)."""
        # The flat pipeline of as many agents: its engine and agents; nothing is started.
        agents = load.agent_threads(self.settings)
        flat = base.Load(None, agents=None if agents == self.settings.agents else agents)
        pipeline, _ = self._pipeline(flat)
        pipeline._reset()
        with pipeline.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO outbox.relays (name, pid, host, idle)"
                    " VALUES ('bench-idle-relay', 0, 'bench', true)"
                )
            )
        meter = CpuMeter(
            {
                "agents (this process)": lambda: [os.getpid()],
                "postgres (this database, background)": pipeline._postgres_pids,
            }
        )
        meter.start()
        try:
            making = Agents(pipeline.engine, agents, None)
            commits = making.run(f"alone-{self.cases}", self.settings.intents)
        finally:
            for name, percent in meter.stop().items():
                self.settings.cpu.add(
                    name, percent, unit=base.CORE, section=f"{self.label}, {load.label}"
                )
            pipeline._reset()
        return base.enqueue_rows(load, commits.values())

    def close(self) -> None:
        for pipeline, _ in self.pipelines.values():
            pipeline.close()
