"""A library call with no database configured raises naming OUTBOX_DATABASE_URL and starts no
embedded PostgreSQL (only the command line does), in a process with a clean environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.acceptance.conftest import clean_environment

#: What the agent runs: each call must raise DatabaseUnavailable, start nothing.
AGENT = """
import asyncio, outbox
from outbox import aio
from outbox.db import get_engine

def sync_wait():
    outbox.wait("01900000-0000-7000-8000-000000000001", timeout=1)

async def async_wait():
    await aio.wait("01900000-0000-7000-8000-000000000001", timeout=1)

for name, call in [("wait", sync_wait), ("aio.wait", lambda: asyncio.run(async_wait())),
                   ("get_engine", get_engine)]:
    try:
        call()
    except outbox.DatabaseUnavailable as exc:
        print(name, "refused:", exc)
    else:
        print(name, "did not raise")
"""


def _servers_under(path: Path) -> list[psutil.Process]:
    """PostgreSQL servers whose command line names a directory under ``path``."""
    found = []
    for process in psutil.process_iter(["name", "cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if "postgres" in (process.info["name"] or "") and str(path) in cmdline:
            found.append(process)
    return found


@pytest.mark.timeout(120)
def test_wait_with_nothing_configured_raises_and_starts_no_server(tmp_path: Path) -> None:
    """outbox.wait, outbox.aio.wait and get_engine with no OUTBOX_DATABASE_URL raise
    DatabaseUnavailable naming it, create no ./.outbox and leave no postgres process."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = clean_environment(HOME=str(home))
    done = subprocess.run(
        [sys.executable, "-c", AGENT],
        env=env,
        cwd=work,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["wait", "refused:"],
        ["aio.wait", "refused:"],
        ["get_engine", "refused:"],
    ], done.stdout
    assert all("OUTBOX_DATABASE_URL is not set" in line for line in lines)
    assert not (work / ".outbox").exists()
    assert not (home / ".outbox").exists()
    assert _servers_under(tmp_path) == []
