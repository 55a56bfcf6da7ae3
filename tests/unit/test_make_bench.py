"""`make bench` and `make bench-quick` run every benchmark script, so none is forgotten."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


#: Scripts with a ``__main__`` block that are tools, not benchmarks: ``ab.py`` runs another
#: script on two versions of the repository (tests/bench/test_ab.py runs it).
TOOLS = {"ab.py"}


def _scripts() -> set[str]:
    """The bench scripts meant to be run: those with a ``__main__`` block, tools aside."""
    return {
        path.name
        for path in (ROOT / "bench").glob("*.py")
        if 'if __name__ == "__main__"' in path.read_text()
    } - TOOLS


def _recipe(target: str) -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    found = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert found, f"no {target} target in the Makefile"
    return set(re.findall(r"bench/(\w+\.py)", found.group(1)))


@pytest.mark.parametrize("target", ["bench", "bench-quick"])
def test_every_benchmark_script_is_in_the_target(target: str) -> None:
    scripts = _scripts()
    assert len(scripts) >= 8
    assert scripts - _recipe(target) == set()


def test_the_quick_target_runs_each_script_in_its_smoke_form() -> None:
    makefile = (ROOT / "Makefile").read_text()
    quick = re.search(r"^bench-quick:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert quick
    for line in quick.group(1).splitlines():
        if "bench/" in line:
            assert "--smoke" in line, line
