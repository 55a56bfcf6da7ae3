"""The reference remote service: releases keyed by an idempotency key, their rollbacks (the
undo a saga's compensation calls), with injectable faults.

A real HTTP server, standard library only, that tests, the demo and the benchmarks use as the
remote whose behaviour the outbox must survive. It keeps a ledger of every effect it ever
committed, so a test asks the remote itself whether an action happened twice or not at all.
Times (``created_at``, the dedup window) are the service's own clock, as for any remote.

``with DeployService(dedup_window_s=60) as service: httpx.post(service.url + ...)`` runs it in
a background thread; ``outbox dev deploy-service`` runs it in the foreground (its one command
line). One job per module:

* :mod:`~outbox.dev.service.ledger`: the effects committed (releases, rollbacks), in SQLite;
* :mod:`~outbox.dev.service.faults`: which fault each create request (release or rollback)
  gets;
* :mod:`~outbox.dev.service.stats`: request counts by outcome;
* :mod:`~outbox.dev.service.http`: the HTTP interface (routes, answers, resets);
* :mod:`~outbox.dev.service.service`: :class:`DeployService`, which puts them together.
"""

from outbox.dev.service.errors import DeployServiceError
from outbox.dev.service.faults import FAULT_MODES, FaultMode, parse_fault_rates
from outbox.dev.service.ledger import Effect, EffectKind
from outbox.dev.service.service import (
    DEFAULT_FAULT_DELAY_S,
    DEFAULT_PORT,
    DeployService,
    serve,
)

__all__ = [
    "DEFAULT_FAULT_DELAY_S",
    "DEFAULT_PORT",
    "FAULT_MODES",
    "DeployService",
    "DeployServiceError",
    "Effect",
    "EffectKind",
    "FaultMode",
    "parse_fault_rates",
    "serve",
]
