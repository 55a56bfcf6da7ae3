"""examples/saga_release.py against the reference service with real processes: two releases
that complete together; with a refused last step, both rolled back, the second first; run
again with the same key, nothing more at the service."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from outbox.dev.service import DeployService
from tests import saga_stack
from tests.acceptance.conftest import run_outbox
from tests.conftest import REPO
from tests.processes import Services

pytestmark = pytest.mark.slow


@pytest.fixture
def service() -> Iterator[DeployService]:
    """The reference service, with lookups."""
    with DeployService(port=0) as running:
        yield running


@pytest.fixture
def stack_env(database_url: str, service: DeployService, tmp_path: Path) -> dict[str, str]:
    """Both tools on the service, short timeouts, the database broker."""
    return saga_stack.stack_env(database_url, None, tmp_path, service.url)


def _example(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / "saga_release.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )


@pytest.mark.timeout(240)
def test_the_saga_example_completes_or_undoes_both_releases_once(
    engine: Engine, services: Services, stack_env: dict[str, str], service: DeployService
) -> None:
    """Completed: two releases, no rollback. Refused last step: the two releases rolled
    back, the second first; the same key again changes nothing at the service."""
    # Both tools published before anything starts, as docs/tools.md's deploy order says: the
    # example may enqueue before the worker has published them (and an earlier test's
    # published tools, left in the shared database, would make the rollback tool unknown).
    published = run_outbox("tools", "publish", env=stack_env)
    assert published.code == 0, published.stderr
    services.start("worker", "worker", "-c", "4", "-P", "threads")
    services.start("relay", "relay")
    services.start("beat", "beat")
    run = uuid.uuid4().hex[:8]
    a, b, c, d = (f"p-{run}-{n}" for n in "abcd")

    done = _example(stack_env, "--key", f"ok-{run}", "--targets", f"{a},{b}")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith(f"saga ok-{run}: completed"), done.stdout
    assert [(e.kind, e.target) for e in service.ledger()] == [("release", a), ("release", b)]

    undone = _example(stack_env, "--key", f"undo-{run}", "--targets", f"{c},{d}", "--refuse-last")
    assert undone.returncode == 0, undone.stdout + undone.stderr[-3000:]
    assert undone.stdout.startswith(f"saga undo-{run}: compensated"), undone.stdout
    assert "undone: confirmed" in undone.stdout
    later = [(e.kind, e.target) for e in service.ledger()][2:]
    assert later == [("release", c), ("release", d), ("rollback", d), ("rollback", c)]

    again = _example(stack_env, "--key", f"undo-{run}", "--targets", f"{c},{d}", "--refuse-last")
    assert again.returncode == 0, again.stdout + again.stderr[-3000:]
    assert again.stdout == undone.stdout
    assert len(service.ledger()) == 6
