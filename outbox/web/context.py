"""What every handler of one app shares: its engine, its settings, what it learnt."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.config import Settings


@dataclass
class ApiContext:
    """One app's database engine and settings (``app.state.outbox``)."""

    engine: AsyncEngine
    #: The same database for the enqueue, run in worker threads: psycopg's sync connection
    #: costs about half the CPU of its async one per transaction (docs/performance.md).
    sync_engine: Engine
    settings: Settings
    #: The schema revision this package ships: /readyz compares the database's with it.
    head: str
    #: Tools found known (:func:`outbox.api.known_tool`): a tool stays known, so each is
    #: looked up once per process, not on every enqueue.
    known_tools: set[str] = field(default_factory=set)


def context(request: Request) -> ApiContext:
    """The :class:`ApiContext` of the app serving ``request``."""
    found: ApiContext = request.app.state.outbox
    return found
