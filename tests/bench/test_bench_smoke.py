"""The benchmarks still run: ``bench/pipeline.py``, ``bench/limits.py``, ``bench/aio.py`` and
``bench/api.py``, ``bench/guards.py``, ``bench/dispatch_step.py``, ``bench/server_cost.py``,
``bench/write_cost.py`` and ``bench/claim_backlog.py`` with ``--smoke``.

Each is a real run of a few seconds against the test server (a throw-away ``bench_*``
database, dropped at the end; RabbitMQ on a throw-away vhost when one is up, else the
database broker), as a subprocess: exit 0 and its table printed. The pipeline's smoke exits
non-zero when an operation did not reach `confirmed` or a key has two effects at the service.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _smoke(script: str, admin_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("OUTBOX_")}
    env["COLUMNS"] = "160"
    argv = [sys.executable, str(REPO / "bench" / script), "--smoke", "--url", admin_url, *args]
    broker_url = os.environ.get("OUTBOX_TEST_BROKER_URL")
    if broker_url:
        argv += ["--broker-url", broker_url]
    return subprocess.run(
        argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=100, check=False
    )


@pytest.mark.timeout(110)
def test_pipeline_smoke(admin_url: str) -> None:
    result = _smoke("pipeline.py", admin_url)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    for row in ("throughput", "commit -> arrival p50", "commit -> confirmed p99", "workers"):
        assert row in result.stdout, result.stdout
    # The server and the settings that move every figure, under the table.
    assert re.search(r"server: PostgreSQL \S+, autovacuum (on|off), fsync", result.stdout), (
        result.stdout
    )


@pytest.mark.timeout(110)
def test_limits_smoke(admin_url: str) -> None:
    result = _smoke("limits.py", admin_url)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    for row in (
        "INSERT+COMMIT, 1 connection",
        "enqueue()+COMMIT, 1 connection",
        "a Session's transaction per intent",
        "sent CAS+COMMIT",
        "try_lock+unlock",
        "service",
    ):
        assert row in result.stdout, result.stdout
    for connections in ("1 connection", "8 connections"):
        assert re.search(
            rf"target enqueue\(\) >= 0\.8x a raw INSERT\+COMMIT \({connections}\): "
            r".* (met|NOT met)",
            result.stdout,
        ), result.stdout


@pytest.mark.timeout(110)
def test_aio_smoke(admin_url: str) -> None:
    result = _smoke("aio.py", admin_url)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    for row in (
        "loop lag p99",
        "enqueue+commit+wait",
        "async / sync, Session",
        "raw psycopg",
        "SQLAlchemy async / sync",
    ):
        assert row in result.stdout, result.stdout
    assert re.search(r"target event-loop lag p99 < 20 ms: .* (met|NOT met)", result.stdout), (
        result.stdout
    )


@pytest.mark.timeout(110)
def test_api_smoke(admin_url: str) -> None:
    """`bench/api.py --smoke` runs both ways to enqueue and judges the 0.5x target."""
    result = _smoke("api.py", admin_url)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    for row in ("direct rate, 1", "API rate, 8", "API p50, 1", "API p99, 8", "API / direct, 8"):
        assert row in result.stdout, result.stdout
    assert re.search(
        r"target API >= 0\.5x direct enqueue \(8\): .* (met|NOT met)", result.stdout
    ), result.stdout


@pytest.mark.timeout(110)
def test_api_signin_smoke(admin_url: str) -> None:
    """`bench/api.py --mode signin --smoke` measures the agent's enqueue quiet and during a
    sign-in burst and judges the 2x target."""
    result = _smoke("api.py", admin_url, "--mode", "signin")
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    for row in ("enqueue p99, quiet", "enqueue p99, burst", "passwords checked (401)/s"):
        assert row in result.stdout, result.stdout
    assert re.search(
        r"target enqueue p99 during 4 sign-ins <= 2x quiet: .* (met|NOT met)", result.stdout
    ), result.stdout


@pytest.mark.timeout(110)
def test_guards_smoke(admin_url: str) -> None:
    result = _smoke("guards.py", admin_url)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    for row in ("http.plain", "http.guarded", "python.guarded", "guarded / plain, no remote"):
        assert row in result.stdout, result.stdout
    assert re.search(
        r"target guards declared >= 0\.9x none \(reference service\): .* (met|NOT met)",
        result.stdout,
    ), result.stdout


@pytest.mark.timeout(110)
def test_dispatch_step_smoke(admin_url: str) -> None:
    result = _smoke("dispatch_step.py", admin_url)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    for row in (
        "python.plain, one statement",
        "http.plain, two statements: CPU",
        "one statement / two, reference service",
        "server: PostgreSQL",
    ):
        assert row in result.stdout, result.stdout


@pytest.mark.timeout(110)
def test_server_cost_smoke(admin_url: str) -> None:
    """`bench/server_cost.py --smoke` reads the server's CPU per stage for each case: every
    stage of every case used some (a reader that found no backend would say 0)."""
    result = _smoke("server_cost.py", admin_url)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    for row in ("ours / naive celery", "no invariants CHECK / ours", "no events FK / ours"):
        assert row in result.stdout, result.stdout
    stages = re.findall(r"(\S.*?: (?:enqueue|take|attempt))\s*│ µs/op │\s*([\d,.]+)", result.stdout)
    assert len(stages) == 11, result.stdout  # naive celery's two stages, ours' three x 3
    for stage, value in stages:
        assert float(value.replace(",", "")) > 0, f"{stage}: no server CPU read\n{result.stdout}"


#: What bench/write_cost.py measures, each a row of its table.
WRITE_CASES = (
    "a plain row's UPDATE",
    "the UPDATE alone",
    "+ the row returned",
    "+ its event",
    "the dispatcher's move",
    "no invariants CHECK",
    "no partial indexes",
    "two moves per commit",
    "HOT move + a queue row",
)


@pytest.mark.timeout(110)
def test_write_cost_smoke(admin_url: str) -> None:
    """`bench/write_cost.py --smoke` moves every case's operations (it exits 1 on a write that
    moved nothing) and reads its backend's CPU: a value above zero for every case, a ratio
    to the dispatcher's move for every other."""
    result = _smoke("write_cost.py", admin_url)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    values = dict(
        re.findall(r"^│\s{3}(\S.*?)\s*│ µs/write │\s*([\d,.]+)", result.stdout, re.MULTILINE)
    )
    assert set(values) == set(WRITE_CASES), result.stdout
    for case, value in values.items():
        assert float(value.replace(",", "")) > 0, f"{case}: no server CPU read\n{result.stdout}"
        if case != "the dispatcher's move":
            assert f"{case} / the dispatcher's move" in result.stdout, result.stdout
    assert "server: PostgreSQL" in result.stdout, result.stdout


@pytest.mark.timeout(110)
def test_claim_backlog_smoke(admin_url: str) -> None:
    """`bench/claim_backlog.py --smoke`: every claim returned the new and the lost rows (the
    script exits 1 otherwise), a row per backlog size, the claim's indexes named."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OUTBOX_")}
    argv = [sys.executable, str(REPO / "bench" / "claim_backlog.py"), "--smoke", "--url", admin_url]
    result = subprocess.run(
        argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=100, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert re.search(
        r"^\s+500\s+\d+\s+[\d.]+\s+[\d.]+\s+.*ix_operations_planned_unpublished",
        result.stdout,
        re.MULTILINE,
    ), result.stdout


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= frontier
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _started(pid: int) -> str | None:
    """``pid``'s start time (``/proc/<pid>/stat``, field 22): with the pid, one process's
    identity (a pid may be reused); None if it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]


@pytest.mark.timeout(110)
def test_pipeline_stopped_by_sigterm_stops_its_processes(admin_url: str) -> None:
    """``kill`` (SIGTERM) on a running pipeline.py unwinds like Ctrl-C: its relay, workers
    and service stop with it (a run killed so once left its relay running)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OUTBOX_")}
    argv = [sys.executable, "-u", str(REPO / "bench" / "pipeline.py"), "--url", admin_url]
    argv += ["--broker", "database", "--mode", "flat", "--rounds", "1", "--intents", "100000"]
    with subprocess.Popen(
        argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        assert process.stdout is not None
        # Until its relay runs (the round's case starts the relay, the workers, the agents).
        deadline = time.monotonic() + 60
        while not any("outbox relay" in _cmdline(pid) for pid in _children(process.pid)):
            assert process.poll() is None, process.stdout.read()
            assert time.monotonic() < deadline, "the relay never started"
            time.sleep(0.1)
        time.sleep(1.0)  # the workers too
        children = {pid: (_started(pid), _cmdline(pid)) for pid in _children(process.pid)}
        process.terminate()
        rest = process.stdout.read()
        assert process.wait(timeout=60) == 130, rest
    assert len(children) >= 4, rest  # the relay, two workers, the service...
    assert "interrupted: processes stopped" in rest, rest
    # Each must be gone within a few seconds (multiprocessing's resource tracker notices its
    # parent's exit on its own, a moment later).
    deadline = time.monotonic() + 15
    while True:
        left = {
            pid: cmdline
            for pid, (started, cmdline) in children.items()
            if started is not None and _started(pid) == started
        }
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in left:  # leave nothing behind for the next test
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"still running after the benchmark stopped: {left}"
