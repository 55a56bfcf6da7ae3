"""``bench/ab.py``: two versions of the repository measured alternately in one run.

Real runs of a benchmark's smoke form on two versions (this commit in a worktree of its own,
and the working tree), as a subprocess: the table of B / A per row on stdout, the sides
alternating pair by pair, the worktree gone afterwards; and the clear errors of a bad
command line or a failing run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _env(tmp_path: Path) -> dict[str, str]:
    """The tool's environment: its scratch directory (and so its worktrees) under ``tmp_path``,
    so that what a test sees in ``git worktree list`` is its own (tests run side by side)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("OUTBOX_")}
    env["COLUMNS"] = "160"
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    env["TMPDIR"] = str(scratch)
    return env


def _ab(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = _env(cwd)
    return subprocess.run(
        [sys.executable, str(REPO / "bench" / "ab.py"), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )


def _worktrees(tmp_path: Path) -> list[str]:
    """This test's worktrees (those under its ``tmp_path``) that git still lists."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "worktree", "list", "--porcelain"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    trees = [line.removeprefix("worktree ") for line in listed.splitlines()]
    return [tree for tree in trees if tree.startswith(str(tmp_path))]


@pytest.mark.timeout(170)
def test_two_versions_alternate_and_each_row_gets_its_ratio(admin_url: str, tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    result = _ab(
        "HEAD", ".", "--pairs", "2", "--json", str(out), "--",
        "dispatch_step.py", "--smoke", "--url", admin_url,
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    # The sides alternate: A then B, then B then A.
    order = [line.split(": ", 1)[1][:1] for line in result.stderr.splitlines() if "pair " in line]
    assert order == ["A", "B", "B", "A"], result.stderr[-4000:]
    for text in (
        "A = HEAD (",
        "B = . (the working tree)",
        "B / A",
        "python.plain, one statement",
        "A while measuring (",
        "B while measuring (",
    ):
        assert text in result.stdout, result.stdout
    written = json.loads(out.read_text(encoding="utf-8"))
    rows = {row["name"]: row for row in written["rows"]}
    plain = rows["python.plain, one statement"]
    assert len(plain["a"]) == len(plain["b"]) == len(plain["b_over_a"]) == 2
    assert plain["b_over_a"][0] == pytest.approx(plain["b"][0] / plain["a"][0])
    assert all(value > 0 for value in plain["a"] + plain["b"])
    assert _worktrees(tmp_path) == []  # the worktree was removed


@pytest.mark.timeout(30)
def test_an_unknown_revision_or_script_is_refused_before_anything_runs(tmp_path: Path) -> None:
    result = _ab("no-such-revision", ".", "--", "dispatch_step.py", "--smoke", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == "ab.py: 'no-such-revision' is not a revision of this repository"
    result = _ab("HEAD", ".", "--", "no_such_script.py", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "has no bench/no_such_script.py" in result.stderr
    assert _worktrees(tmp_path) == []


@pytest.mark.timeout(60)
def test_a_failing_run_stops_with_its_exit_status(tmp_path: Path) -> None:
    result = _ab("HEAD", ".", "--", "dispatch_step.py", "--rounds", "many", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "bench/dispatch_step.py exited 2" in result.stderr  # argparse's usage error
    assert "invalid int value: 'many'" in result.stderr  # the script's own message, shown
    assert _worktrees(tmp_path) == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_removes_its_worktree(
    admin_url: str, tmp_path: Path, signum: signal.Signals
) -> None:
    env = _env(tmp_path)
    argv = [
        sys.executable, str(REPO / "bench" / "ab.py"), "HEAD", ".", "--",
        "server_cost.py", "--rounds", "5", "--ops", "5000", "--url", admin_url,
    ]  # fmt: skip
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr
        )
        try:
            deadline = time.monotonic() + 60
            while "round 1/5" not in log.read_text() and time.monotonic() < deadline:
                assert process.poll() is None, log.read_text()
                time.sleep(0.2)
            assert len(_worktrees(tmp_path)) == 1  # A's worktree, while its run goes on
            process.send_signal(signum)
            # Longer than ab.py's grace for the script's clean-up (INTERRUPT_GRACE_S, 60 s; its
            # DROP DATABASE waits for a checkpoint: tens of seconds on a loaded machine).
            assert process.wait(timeout=90) == 130, log.read_text()[-4000:]
        finally:
            process.kill()
    assert log.read_text().rstrip().endswith("ab.py: interrupted")
    assert _worktrees(tmp_path) == []
