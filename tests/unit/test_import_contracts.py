"""The import contracts of ``outbox/`` ([tool.importlinter] in pyproject.toml), and no import
cycle beyond the one listed here, checked by ``make test`` as well as ``make lint``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[2]

#: Import cycles allowed in outbox/, each named by its modules: none. (The states/statements/
#: webhooks/models/schema/driver cycle went with outbox.transitions, issue 18.) An entry here
#: must name why the cycle cannot be broken; this test fails once a listed cycle is gone.
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()


def _lint_imports() -> str:
    beside = Path(sys.executable).with_name("lint-imports")
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    assert found, "lint-imports is not installed (pip install -e '.[dev]')"
    return found


def test_lint_imports_keeps_every_contract() -> None:
    """`lint-imports` (as `make lint` runs it) finds every contract kept."""
    done = subprocess.run(
        [_lint_imports(), "--no-cache"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def import_cycles(graph: grimp.ImportGraph) -> list[frozenset[str]]:
    """Each set of modules that import one another in a circle: a strongly connected
    component of two or more modules, or one module importing itself."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[frozenset[str]] = []

    def imported_by(module: str) -> list[str]:
        return sorted(graph.find_modules_directly_imported_by(module))

    # Tarjan's algorithm, iterative: a deep chain of imports must not hit the recursion limit.
    for root in sorted(graph.modules):
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = []
        index[root] = lowlink[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work.append((root, iter(imported_by(root))))
        while work:
            module, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = lowlink[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(imported_by(successor))))
                    advanced = True
                    break
                if successor in on_stack:
                    lowlink[module] = min(lowlink[module], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                lowlink[parent] = min(lowlink[parent], lowlink[module])
            if lowlink[module] == index[module]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == module:
                        break
                if len(component) > 1 or module in graph.find_modules_directly_imported_by(module):
                    components.append(frozenset(component))
    return components


def a_cycle_through(graph: grimp.ImportGraph, component: frozenset[str]) -> list[str]:
    """A readable cycle inside ``component``: from its first module, the shortest chain to
    a module that imports it back, then back to the start (the modules, sorted, if none)."""
    start = min(component)
    for importer in sorted(graph.find_modules_that_directly_import(start) & component):
        chain = graph.find_shortest_chain(importer=start, imported=importer)
        if chain is not None and set(chain) <= component:
            return [*chain, start]
    return sorted(component)


def _render(graph: grimp.ImportGraph, components: Iterable[frozenset[str]]) -> str:
    return "\n".join(
        f"{' -> '.join(a_cycle_through(graph, members))}  (modules: {', '.join(sorted(members))})"
        for members in components
    )


def test_import_cycles_finds_a_cycle_and_ignores_a_chain() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.c")
    graph.add_import(importer="pkg.c", imported="pkg.a")
    graph.add_import(importer="pkg.c", imported="pkg.d")
    cycles = import_cycles(graph)
    assert cycles == [frozenset({"pkg.a", "pkg.b", "pkg.c"})]
    assert a_cycle_through(graph, cycles[0]) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    graph.remove_import(importer="pkg.c", imported="pkg.a")
    assert import_cycles(graph) == []


def test_no_import_cycle_in_outbox_beyond_the_known_one() -> None:
    """No module of `outbox/` takes part in an import cycle (deferred imports count: they
    hide a cycle, they do not break it), except the cycles listed in KNOWN_CYCLES."""
    graph = grimp.build_graph("outbox")
    found = set(import_cycles(graph))
    new = sorted(found - KNOWN_CYCLES, key=sorted)
    assert not new, f"import cycles in outbox/:\n{_render(graph, new)}"
    gone = sorted(KNOWN_CYCLES - found, key=sorted)
    if gone:
        pytest.fail(
            "a known import cycle is gone: remove it from KNOWN_CYCLES and the acyclic "
            "contract's ignore_imports in pyproject.toml: "
            + "; ".join(", ".join(sorted(members)) for members in gone)
        )
