"""Development tooling, apart from the core: what ``outbox demo``, ``outbox dev …`` and
``outbox chaos`` run, and what the tests and benchmarks drive.

Only :mod:`outbox.cli`, the tests and the benchmarks import it; the core never does.

* :mod:`outbox.dev.service`: the reference remote service (ledger, faults, HTTP);
* :mod:`outbox.dev.demo`: the scripted demo;
* :mod:`outbox.dev.scenario`: the scripted end-to-end run of ``outbox dev scenario``;
* :mod:`outbox.dev.chaos`: the chaos run of ``outbox chaos``;
* :mod:`outbox.dev.clusters`: a PostgreSQL cluster of one's own that a run may crash;
* :mod:`outbox.dev.stack`: the outbox's long-running commands as real processes;
* :mod:`outbox.dev.tool_config`: the HTTP tool for the reference service, as TOML.

Whatever here empties or restarts something does so only to what it created itself, unless
the caller names the thing explicitly (``--i-own-this-database URL``).
"""
