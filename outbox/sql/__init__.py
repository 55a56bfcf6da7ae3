"""Every SQL statement of the outbox, in one style, split by the component that runs it.

The one style:

* **A statement is a module-level constant**: a ``text()`` whose values are bound parameters
  (``:name``), or a SQLAlchemy Core construct over the tables of :mod:`outbox.schema`. A Core
  query whose shape depends on the arguments (an optional filter) is built inside its
  function, from the same tables, its values bound too.
* **The measured hot path is a** :class:`~outbox.driver.DriverStatement` **constant**: the
  statements an enqueue or an attempt runs (``intents.insert_intent``,
  ``relay.claim_and_mark_due``, ``locks.try_lock_and_read``, and the move statements) are compiled
  once and run on psycopg directly, in the caller's transaction (why: :mod:`outbox.driver`).
  That is the only other mechanism.
* **One function per statement** runs it in the caller's transaction (or autocommit
  connection) and never begins, commits or rolls back; it returns a named type (an
  :mod:`outbox.models` row, a frozen dataclass defined beside the statement), a scalar, or
  nothing. Never an anonymous tuple.
* **No SQL is built from strings**: no f-string, no ``%``, ``format`` or ``+`` concatenation
  of SQL (adjacent string literals are one literal). A value always travels as a bound
  parameter. What PostgreSQL cannot bind (a ``LISTEN`` channel, the terminal states a
  partial-index predicate names) is written out in the text, and tests check it against the
  Python constant it spells (tests/unit/test_sql_in_one_place.py, which also fails on SQL
  text anywhere in ``outbox/`` outside this package and the migrations).

Times come from the database: statements use ``statement_timestamp()`` (the start of *this*
statement, not of the transaction like ``now()``) where one instant must be written to
several columns, and ``clock_timestamp()`` where a wait inside the statement must count.

The modules, by consumer: :mod:`~outbox.sql.intents` (the agent: insert and read
operations, pruned intents, waiters), :mod:`~outbox.sql.notify` (LISTEN/NOTIFY),
:mod:`~outbox.sql.relay`, :mod:`~outbox.sql.locks` (advisory and row locks, the dispatcher's
read, ``synchronous_commit``), :mod:`~outbox.sql.reconcile` (the sweep and lookups),
:mod:`~outbox.sql.resolve` (operator verdicts), :mod:`~outbox.sql.webhooks` (delivery rows),
:mod:`~outbox.sql.metrics`, :mod:`~outbox.sql.retention` (prune, forget),
:mod:`~outbox.sql.deployment` (the database's identity, its standbys),
:mod:`~outbox.sql.tokens` (the HTTP API's bearer tokens), :mod:`~outbox.sql.operators` (the
console's operator accounts), :mod:`~outbox.sql.console` (the console's queue and rates),
:mod:`~outbox.sql.signins` (the console's sign-in throttle),
:mod:`~outbox.sql.budgets` (budgets: definitions, key locks, usage),
:mod:`~outbox.sql.sagas` (sagas: their rows, steps, trail; a step's hold and release),
:mod:`~outbox.sql.web` (the HTTP API's pages of operations and conditional requests),
:mod:`~outbox.sql.broker` (the database broker's tables), :mod:`~outbox.sql.moves` (the
state moves' statements, run only by :mod:`outbox.transitions`) and :mod:`~outbox.sql.dev`
(statements only the dev tooling runs: the demo's and chaos's reports, the scenario's reset).
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from outbox.sql import (
        approval,
        broker,
        budgets,
        columns,
        console,
        deployment,
        dev,
        guards,
        intents,
        locks,
        metrics,
        moves,
        notify,
        operators,
        reconcile,
        relay,
        resolve,
        retention,
        sagas,
        signins,
        tokens,
        web,
        webhooks,
    )

__all__ = [
    "approval",
    "broker",
    "budgets",
    "columns",
    "console",
    "deployment",
    "dev",
    "guards",
    "intents",
    "locks",
    "metrics",
    "moves",
    "notify",
    "operators",
    "reconcile",
    "relay",
    "resolve",
    "retention",
    "sagas",
    "signins",
    "tokens",
    "web",
    "webhooks",
]


def __getattr__(name: str) -> object:
    """Import a statement module the first time it is asked for (``sql.tokens``...): a command
    that runs one module's statements loads no other (issue 33: ``outbox tokens --help``)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")


def __dir__() -> list[str]:
    """The statement modules, loaded or not."""
    return sorted({*globals(), *__all__})
