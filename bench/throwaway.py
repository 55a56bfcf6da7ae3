"""Throw-away PostgreSQL databases and RabbitMQ vhosts (``bench_<hex>``), removed at the end."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from types import FrameType

from sqlalchemy import make_url, text
from sqlalchemy.pool import NullPool

from outbox import migrate
from outbox.db import create_engine, normalize_url

RABBITMQ_HOST = "127.0.0.1"
RABBITMQ_PORT = 5672


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM (``kill``, ``timeout``) unwinds as Ctrl-C does, so every ``finally``
    and context manager runs: the benchmark's processes stopped, its databases and vhosts
    removed (a run killed without it left its relay running on a dropped database)."""
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def database_url_for(url: str, name: str) -> str:
    """``url`` naming database ``name`` instead (host, socket and credentials kept)."""
    return make_url(normalize_url(url)).set(database=name).render_as_string(hide_password=False)


@contextlib.contextmanager
def throwaway_database(url: str, *, migrated: bool = True) -> Iterator[str]:
    """``CREATE DATABASE bench_<hex>`` on the server of ``url``, migrated; dropped at the end.

    Yields the new database's URL.
    """
    name = f"bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    try:
        try:
            # Inside the clean-up: an interrupt while the server creates it (Ctrl-C at once,
            # bench/ab.py passing one on) must not leave it behind.
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
            db_url = database_url_for(url, name)
            if migrated:
                engine = create_engine(db_url, poolclass=NullPool)
                try:
                    migrate.upgrade(engine)
                finally:
                    engine.dispose()
            yield db_url
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


#: The server settings that move every figure (durability, statistics, memory), as
#: ``server_settings`` names them.
SERVER_SETTINGS = ("autovacuum", "fsync", "synchronous_commit", "wal_sync_method", "shared_buffers")


def server_settings(url: str) -> str:
    """One line naming the PostgreSQL server of ``url`` and the settings in
    :data:`SERVER_SETTINGS`, for the note under a benchmark's table (``autovacuum off``
    means no bench database gets statistics, however long the run: docs/performance.md)."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            result = conn.execute(
                text("SELECT name, current_setting(name) FROM unnest(CAST(:names AS text[])) name"),
                {"names": ["server_version", *SERVER_SETTINGS]},
            )
            values: dict[str, str] = dict(result.tuples().all())
    finally:
        engine.dispose()
    version = values["server_version"].split()[0]
    return f"server: PostgreSQL {version}, {', '.join(f'{k} {values[k]}' for k in SERVER_SETTINGS)}"


def port_open(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def rabbitmq_available() -> bool:
    """Whether RabbitMQ answers on 127.0.0.1:5672 and ``rabbitmqctl`` can make vhosts."""
    return shutil.which("rabbitmqctl") is not None and port_open(RABBITMQ_HOST, RABBITMQ_PORT)


def _rabbitmqctl(*args: str, check: bool = True) -> None:
    ctl = shutil.which("rabbitmqctl") or "rabbitmqctl"
    subprocess.run([ctl, *args], check=check, capture_output=True, timeout=120)  # noqa: S603


@contextlib.contextmanager
def throwaway_vhost(configured: str | None = None) -> Iterator[str]:
    """An AMQP URL on a new vhost ``bench_<hex>`` (deleted at the end); or ``configured``
    as it is, if given (then nothing is created or deleted)."""
    if configured:
        yield configured
        return
    vhost = f"bench_{uuid.uuid4().hex[:8]}"
    _rabbitmqctl("add_vhost", vhost)
    try:
        _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@{RABBITMQ_HOST}:{RABBITMQ_PORT}/{vhost}"
    finally:
        _rabbitmqctl("delete_vhost", vhost, check=False)
