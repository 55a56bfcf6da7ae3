"""The scale benchmark still runs: ``bench/scale.py --smoke``.

A real run against the test server (throw-away ``bench_*`` databases with 10^3 and 10^4
terminal rows, dropped at the end) and a 20-second soak on a private PostgreSQL the script
starts and removes, as a subprocess: exit 0, and the ratio rows and the soak table printed.
The script itself fails when a claim, a relay pass or a sweep did not do the work it was
given (every due row claimed, every lost dispatcher found, every `unknown` row routed).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

#: Seconds before the run is stopped; SIGTERM first, so it stops its PostgreSQL and drops its
#: databases on the way out.
LIMIT_S = 120


@pytest.mark.timeout(LIMIT_S + 60)
def test_scale_smoke(admin_url: str) -> None:
    env = {name: value for name, value in os.environ.items() if not name.startswith("OUTBOX_")}
    env["COLUMNS"] = "160"
    argv = [sys.executable, str(REPO / "bench" / "scale.py"), "--smoke", "--url", admin_url]
    with subprocess.Popen(
        argv, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as run:
        try:
            stdout, stderr = run.communicate(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:
            run.terminate()
            stdout, stderr = run.communicate(timeout=50)
            pytest.fail(f"bench/scale.py --smoke took over {LIMIT_S} s\n{stderr[-4000:]}")
    assert run.returncode == 0, stdout + stderr[-4000:]
    for row in (
        "claim 10^4 / 10^3",
        "sweep 10^4 / 10^3",
        "relay pass 10^4 / 10^3",
        "idle sweep 10^4 / 10^3",
        "ix_operations_planned_due",
        "soak claim p50: last window / first window",
        "soak claim p99: last window / first window",
        "Table storage options",
    ):
        assert row in stdout, stdout
    for short in ("claim", "sweep"):  # the target, judged under the table
        assert re.search(rf"target {short} 10\^4 / 10\^3 <= 2x: .* (met|NOT met)", stdout), stdout
