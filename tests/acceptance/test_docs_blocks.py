"""The README's and docs/'s marked code blocks, run as written (tests/docs_blocks.py):
on a fresh database, with real processes, each stopped afterwards even on failure."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from tests import docs_blocks
from tests.acceptance.conftest import REPO, clean_environment
from tests.conftest import Databases

pytestmark = pytest.mark.slow

DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCENARIOS = docs_blocks.collect(DOCUMENTS)
#: Seconds a scenario may take on a loaded 2-core machine (it waits on conditions inside).
SCENARIO_TIMEOUT_S = 420


def test_the_readme_marks_its_first_action_for_the_tests() -> None:
    """The README's "Your first durable action" blocks are collected, shell and Python both."""
    found = [s for s in SCENARIOS if s.id == "README.md::first-action"]
    assert len(found) == 1, "README.md has no blocks marked <!-- test: first-action -->"
    [first] = found
    assert {block.language for block in first.blocks} == {"sh", "python"}
    assert any("outbox up" in block.code for block in first.blocks)


@pytest.mark.timeout(SCENARIO_TIMEOUT_S + 120)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.id for s in SCENARIOS])
def test_a_marked_scenario_runs_as_written(
    scenario: docs_blocks.Scenario, databases: Databases, tmp_path: Path
) -> None:
    """A documented scenario exits 0 on a fresh, empty database, and leaves no process."""
    env = clean_environment(
        OUTBOX_DATABASE_URL=databases.create(), OUTBOX_HOME=str(tmp_path / "home")
    )
    before = _children()
    done = docs_blocks.run(scenario, tmp_path, env, timeout=SCENARIO_TIMEOUT_S)
    logs = "".join(
        f"\n----- {log.name} -----\n{log.read_text(errors='replace')[-4000:]}"
        for log in sorted((tmp_path / "home" / "logs").glob("*.log"))
    )
    assert done.code == 0, done.output[-8000:] + logs
    assert _children() - before == set()


def test_a_failing_scenario_stops_what_it_started_in_the_background(tmp_path: Path) -> None:
    """A block that fails after starting a background process fails the run, and the process
    (and its own child) is gone when the run returns."""
    document = tmp_path / "doc.md"
    document.write_text(
        "<!-- test: failing -->\n"
        "```sh\n"
        "bash -c 'sleep 600 & echo $! > grandchild.pid; wait' &\n"
        "echo $! > child.pid\n"
        "until [ -s grandchild.pid ]; do sleep 0.1; done\n"
        "```\n\n"
        "<!-- test: failing -->\n"
        "```python\n"
        "raise SystemExit('the documented step failed')\n"
        "```\n",
        encoding="utf-8",
    )
    [scenario] = docs_blocks.parse(document)
    done = docs_blocks.run(scenario, tmp_path, clean_environment(), timeout=60)
    assert done.code == 1, done.output
    assert "the documented step failed" in done.output
    for name in ("child.pid", "grandchild.pid"):
        assert not psutil.pid_exists(int((tmp_path / name).read_text())), name


def test_a_marker_on_an_unknown_language_is_refused(tmp_path: Path) -> None:
    """A marked block in a language the collector cannot run is an error naming the line,
    not a block silently skipped."""
    document = tmp_path / "doc.md"
    document.write_text("<!-- test: x -->\n```json\n{}\n```\n", encoding="utf-8")
    with pytest.raises(docs_blocks.DocBlockError, match=r"doc\.md:2: block 'x' is json"):
        docs_blocks.parse(document)


def test_every_example_block_is_run_by_a_test() -> None:
    """A block marked ``<!-- example: NAME -->`` is run by the test that builds its stack;
    one whose name no test takes would be a documented example nothing runs."""
    tests = "".join(path.read_text(encoding="utf-8") for path in (REPO / "tests").rglob("*.py"))
    named = {
        f"{path.name}::{name}"
        for path in DOCUMENTS
        for name in docs_blocks.examples(path)
        if f'"{name}"' not in tests
    }
    assert named == set(), f"marked <!-- example: --> but run by no test: {sorted(named)}"
    assert "mcp-stdio" in docs_blocks.examples(REPO / "docs" / "mcp.md")


def test_an_example_marker_names_one_block_of_any_language(tmp_path: Path) -> None:
    """``example:`` blocks are taken by name whatever their language (a script's printed
    output is one); they are not scenarios; a name marked twice or missing is an error."""
    document = tmp_path / "doc.md"
    document.write_text(
        "<!-- example: out -->\n```text\nhello\n```\n\n"
        "<!-- test: run -->\n```sh\necho hello\n```\n",
        encoding="utf-8",
    )
    assert docs_blocks.example(document, "out").code == "hello\n"
    assert [scenario.name for scenario in docs_blocks.parse(document)] == ["run"]
    with pytest.raises(docs_blocks.DocBlockError, match="no block marked <!-- example: gone"):
        docs_blocks.example(document, "gone")
    document.write_text(
        "<!-- example: twice -->\n```text\na\n```\n<!-- example: twice -->\n```text\nb\n```\n",
        encoding="utf-8",
    )
    with pytest.raises(docs_blocks.DocBlockError, match="example 'twice' is marked twice"):
        docs_blocks.examples(document)


def test_the_documented_ports_are_replaced_by_free_ones(tmp_path: Path) -> None:
    """8600 in a block becomes the free port chosen for it; 18600 and 86000 stay as they are."""
    document = tmp_path / "doc.md"
    document.write_text(
        "<!-- test: ports -->\n```sh\necho 8600 18600 86000 :8900/\n```\n", encoding="utf-8"
    )
    [scenario] = docs_blocks.parse(document)
    ports = {8600: 40001, 8700: 40002, 8900: 40003, 9464: 40004}
    done = docs_blocks.run(scenario, tmp_path, clean_environment(), timeout=60, ports=ports)
    assert done.code == 0, done.output
    assert "40001 18600 86000 :40003/" in done.output


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}
