"""The tools a deployment has published, as ``enqueue`` sees them in a process that loads none.

Every worker writes its loaded tools' contracts (approval policy and ``input_schema``) to
``outbox.tool_policies`` when it starts, and ``outbox tools publish`` does the same without
starting one. An agent process usually loads no tools; through this table its ``enqueue``
refuses a tool the deployment does not know, and a payload the tool's published schema
refuses, before anything is written, as the HTTP API and the MCP server do. Nothing published
at all (a fresh database, no worker started yet) means no opinion: any tool is accepted.

``enqueue`` is the hot path (one round trip), so the table is read at most once per
:data:`FRESH_S` per database and process, and kept as a snapshot. A refusal is never decided
on a kept snapshot: a tool missing from it is looked up again at once (a tool whose worker
just started is accepted at its first enqueue), so a kept snapshot can only accept what a
fresh read would refuse, for at most :data:`FRESH_S` (a schema made stricter, a tool removed).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from outbox import sql
from outbox.models import Executor
from outbox.sql.approval import ToolPolicy

#: How long a snapshot of the published contracts is used without reading the table again: a
#: schema made stricter reaches every agent within this, and one read per half-minute per
#: process costs the database nothing.
FRESH_S = 30.0
#: How long "nothing is published" is believed: a deployment without workers pays one extra
#: read a second per process, not one per enqueue; a worker's start is seen within it.
NOTHING_FRESH_S = 1.0


@dataclass(frozen=True, slots=True)
class Published:
    """What the deployment has published about one tool."""

    #: Whether any tool is published at all (``False``: nothing known, any tool accepted).
    any: bool
    #: The tool's published contract, or ``None``: not published.
    policy: ToolPolicy | None
    #: Every published tool's contract, by name (what an unknown tool's refusal lists).
    policies: Mapping[str, ToolPolicy]
    #: Whether this answer came from a kept snapshot rather than a read just now.
    cached: bool

    @property
    def input_schema(self) -> Mapping[str, Any] | None:
        """The tool's published payload schema, or ``None``."""
        return self.policy.input_schema if self.policy is not None else None


@dataclass(frozen=True, slots=True)
class _Snapshot:
    read_at: float
    policies: dict[str, ToolPolicy]


class PublishedContracts:
    """A per-process cache of ``outbox.tool_policies``, one snapshot per database (engine)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # Keyed by the engine: a process may talk to several databases (tests do). Weak, so a
        # disposed engine's snapshot goes with it.
        self._snapshots: weakref.WeakKeyDictionary[Engine, _Snapshot] = weakref.WeakKeyDictionary()

    def lookup(self, executor: Executor, tool: str, *, fresh: bool = False) -> Published:
        """What is published about ``tool`` in ``executor``'s database, read in the caller's
        transaction when the snapshot is stale (or ``fresh`` is asked, or the tool is missing
        from a snapshot that holds others)."""
        engine = _engine_of(executor)
        now = self._clock()
        kept = self._snapshots.get(engine)
        if not fresh and kept is not None:
            age = now - kept.read_at
            policy = kept.policies.get(tool)
            if policy is not None and age < FRESH_S:
                return Published(True, policy, kept.policies, cached=True)
            if not kept.policies and age < NOTHING_FRESH_S:
                return Published(False, None, kept.policies, cached=True)
        policies = {p.tool: p for p in sql.approval.published_policies(executor)}
        self._snapshots[engine] = _Snapshot(now, policies)
        return Published(bool(policies), policies.get(tool), policies, cached=False)

    def clear(self) -> None:
        """Forget every snapshot (tests, and a process that just published: read anew)."""
        self._snapshots.clear()


def _engine_of(executor: Executor) -> Engine:
    bind = executor.get_bind() if isinstance(executor, Session) else executor
    return bind.engine


#: The process-wide cache.
PUBLISHED = PublishedContracts()
