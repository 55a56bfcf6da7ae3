"""The documentation's marked code blocks, collected and run as written.

Two markers, both read here and nowhere else:

- ``<!-- test: NAME -->`` before a fenced block (blank lines between them allowed) in
  README.md or docs/*.md puts it in the scenario NAME of that file, which
  ``tests/acceptance/test_docs_blocks.py`` runs on its own, on a fresh database;
- ``<!-- example: NAME -->`` names a block that needs a stack a test builds for it (an
  ``outbox mcp`` with its workers and a token, say): the test takes it by name with
  :func:`example` and runs it as written; test_docs_blocks checks that every such name is
  taken by a test, so that no marked block is left unrun.

A scenario's blocks run in the order they appear, as one bash script in a temporary
directory:

- ``sh``/``bash``/``shell`` blocks are pasted in verbatim (under ``set -euo pipefail``);
- ``python`` blocks are written to a file and run with this venv's python (its ``bin``
  directory first on PATH, so ``outbox``, ``python`` and ``pip`` are the venv's).

What a block starts in the background (``outbox up &``) runs on while the later blocks run,
as it would in a reader's terminal. When the script ends (or fails, or the test gives up),
it writes its exit status and waits on its jobs, so that the whole tree is still attached to
it; then every process of the tree gets SIGTERM (``outbox up`` stops its own children on it),
is waited for, and whatever is left gets SIGKILL.

The documentation's well-known ports (:data:`DEFAULT_PORTS`) are replaced by free ones in the
blocks' text, so that a run never meets another process on them (the tests run beside CI, a
developer's own ``outbox up``): a block must therefore name each port it uses.

Why not a maintained tool: pytest-examples, phmdoctest and pytest-markdown-docs run Python
blocks only (in-process or one file each), with no shell blocks and nothing kept running
from one block to the next, which is what the README's first action is.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil

#: The ports the documentation's examples use by default: the HTTP API, the MCP server over
#: HTTP, the reference service, the metrics exporter.
DEFAULT_PORTS = (8600, 8700, 8900, 9464)

SHELL = frozenset({"sh", "bash", "shell"})
PYTHON = frozenset({"python", "py"})

_MARKER = re.compile(r"^<!--\s*(test|example):\s*([A-Za-z0-9_.-]+)\s*-->\s*$")
_FENCE = re.compile(r"^(```+|~~~+)\s*([A-Za-z0-9_+-]*)")
#: Where the script writes its exit status before it waits on its background jobs.
STATUS_FILE = "status"
#: Seconds the background processes get to stop on SIGTERM before SIGKILL.
STOP_TIMEOUT_S = 60.0


class DocBlockError(Exception):
    """A marked block that cannot be run: an unknown language, a marker with no block."""


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language, text and the line its fence opens on."""

    language: str
    code: str
    line: int


@dataclass
class Scenario:
    """The blocks of one file marked with the same name, in order."""

    path: Path
    name: str
    blocks: list[Block] = field(default_factory=list)

    @property
    def id(self) -> str:
        """``README.md::first-action``, relative to the repository when it can be."""
        return f"{self.path.name}::{self.name}"


def parse(path: Path) -> list[Scenario]:
    """The scenarios (``test:`` markers) of one Markdown file, in the order their first
    blocks appear."""
    scenarios: dict[str, Scenario] = {}
    for kind, name, block in _marked(path):
        if kind == "test":
            scenarios.setdefault(name, Scenario(path, name)).blocks.append(block)
    return list(scenarios.values())


def examples(path: Path) -> dict[str, Block]:
    """The blocks of one Markdown file marked ``example:``, by name (one block a name)."""
    found: dict[str, Block] = {}
    for kind, name, block in _marked(path):
        if kind != "example":
            continue
        if name in found:
            raise DocBlockError(f"{path}:{block.line}: example {name!r} is marked twice")
        found[name] = block
    return found


def example(path: Path, name: str) -> Block:
    """The block of ``path`` marked ``<!-- example: NAME -->``; an error naming both if none."""
    found = examples(path).get(name)
    if found is None:
        raise DocBlockError(f"{path} has no block marked <!-- example: {name} -->")
    return found


def _marked(path: Path) -> list[tuple[str, str, Block]]:
    """Every marked block of one Markdown file: its marker's kind and name, and the block.
    A ``test:`` block must be one the scenario runner can run (sh or python); an
    ``example:`` block may be anything (its test reads it: the output a script prints)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    marked: list[tuple[str, str, Block]] = []
    index = 0
    while index < len(lines):
        marker = _MARKER.match(lines[index].strip())
        index += 1
        if marker is None:
            continue
        kind, name = marker.group(1), marker.group(2)
        while index < len(lines) and not lines[index].strip():
            index += 1
        fence = _FENCE.match(lines[index]) if index < len(lines) else None
        if fence is None:
            raise DocBlockError(f"{path}:{index}: marker {name!r} is not followed by a code block")
        language = fence.group(2).lower()
        if kind == "test" and language not in SHELL | PYTHON:
            raise DocBlockError(
                f"{path}:{index + 1}: block {name!r} is {language or 'unlabelled'}; "
                f"marked blocks are sh, bash, shell or python"
            )
        opened = index + 1
        body: list[str] = []
        index += 1
        while index < len(lines) and not lines[index].startswith(fence.group(1)):
            body.append(lines[index])
            index += 1
        if index == len(lines):
            raise DocBlockError(f"{path}:{opened}: block {name!r} is never closed")
        index += 1
        marked.append((kind, name, Block(language, "\n".join(body) + "\n", opened)))
    return marked


def collect(paths: Iterable[Path]) -> list[Scenario]:
    """Every scenario of ``paths``."""
    return [scenario for path in paths for scenario in parse(path)]


def free_ports() -> dict[int, int]:
    """A free port for each of :data:`DEFAULT_PORTS` (nothing listens on it now)."""
    chosen: dict[int, int] = {}
    for port in DEFAULT_PORTS:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            chosen[port] = int(probe.getsockname()[1])
    return chosen


def _with_ports(code: str, ports: Mapping[int, int]) -> str:
    pattern = re.compile(r"(?<![0-9])(" + "|".join(str(port) for port in ports) + r")(?![0-9])")
    return pattern.sub(lambda match: str(ports[int(match.group(1))]), code)


def script(scenario: Scenario, workdir: Path, ports: Mapping[int, int]) -> Path:
    """The scenario as one bash script in ``workdir`` (its Python blocks beside it)."""
    blocks_dir = workdir / ".blocks"
    blocks_dir.mkdir(exist_ok=True)
    status = blocks_dir / STATUS_FILE
    parts = [
        "set -euo pipefail",
        # However the script ends, it says how and then waits on its background jobs: the
        # whole tree stays attached to it until run() has stopped every process of it.
        f'trap \'status=$?; echo $status > "{status}.part"; mv "{status}.part" "{status}";'
        " wait' EXIT",
    ]
    for number, block in enumerate(scenario.blocks, 1):
        code = _with_ports(block.code, ports)
        parts.append(f"echo '>>> {scenario.path.name}:{block.line}' >&2")
        if block.language in SHELL:
            parts.append(code)
        else:
            file = blocks_dir / f"block-{number}.py"
            file.write_text(code, encoding="utf-8")
            parts.append(f'python "{file}"')
    path = blocks_dir / "scenario.sh"
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return path


@dataclass(frozen=True)
class Run:
    """How a scenario's script exited and what it printed (stdout and stderr, interleaved)."""

    code: int
    output: str


def run(
    scenario: Scenario,
    workdir: Path,
    env: Mapping[str, str],
    *,
    timeout: float,
    ports: Mapping[int, int] | None = None,
) -> Run:
    """Run ``scenario`` in ``workdir`` with ``env`` (the venv's bin first on PATH); every
    process it started is gone when this returns or raises."""
    path = script(scenario, workdir, free_ports() if ports is None else ports)
    bin_dir = str(Path(sys.executable).parent)
    full_env = {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}"}
    log = workdir / ".blocks" / "output.log"
    status = workdir / ".blocks" / STATUS_FILE
    with log.open("wb") as sink:
        shell = subprocess.Popen(
            ["bash", str(path)],
            cwd=workdir,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + timeout
            while not status.exists() and shell.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            stop_tree(shell.pid)
            shell.wait()
    output = log.read_text(encoding="utf-8", errors="replace")
    if status.exists():
        return Run(int(status.read_text(encoding="utf-8")), output)
    return Run(-1, output + f"\n[no exit status within {timeout:g}s]")


def stop_tree(pid: int) -> None:
    """SIGTERM ``pid`` and every descendant, wait for them, SIGKILL the ones left."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in tree:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(tree, timeout=STOP_TIMEOUT_S)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=10)
