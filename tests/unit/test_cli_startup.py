"""The ``outbox`` command answers at once: what its start imports, its static tables (issue 33)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
from typer.core import TyperGroup
from typer.main import get_group

from outbox.cli import COMMANDS, app
from outbox.cli import epilog_text as stored
from outbox.cli.epilog import config_digest, render, root_epilog
from outbox.cli.lazy import MARKUP_MODE
from outbox.cli.output import environment_help

#: What `outbox --version` must not load: the broker, the database's dialects, the HTTP
#: API, the MCP SDK, the server, the tracing SDK.
FORBIDDEN = (
    "celery",
    "kombu",
    "sqlalchemy.dialects",
    "fastapi",
    "starlette",
    "mcp",
    "uvicorn",
    "opentelemetry.sdk",
)

#: The top-level commands before the table replaced the eager registrations, in their order.
EXPECTED = [
    "enqueue",
    "demo",
    "relay",
    "worker",
    "beat",
    "chaos",
    "flower",
    "metrics",
    "up",
    "api",
    "mcp",
    "db",
    "ops",
    "dev",
    "webhooks",
    "tokens",
    "operators",
    "guards",
    "sagas",
    "tools",
]


def _modules_after(*args: str) -> list[str]:
    """The modules loaded once ``outbox ARGS`` has answered, in a fresh interpreter."""
    code = (
        "import atexit, json, sys\n"
        "atexit.register(lambda: print(json.dumps(sorted(sys.modules)), file=sys.stderr))\n"
        "from outbox.cli import main\n"
        "sys.argv = ['outbox', *sys.argv[1:]]\n"
        "main()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "160"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    loaded: list[str] = json.loads(done.stderr.strip().splitlines()[-1])
    return loaded


def _heavy(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]


@pytest.mark.parametrize("args", [("--version",), ("--help",)])
def test_version_and_help_import_no_broker_database_dialect_web_or_mcp(args: tuple[str]) -> None:
    """`outbox --version` and `outbox --help` import no Celery, kombu, SQLAlchemy dialect,
    FastAPI, Starlette, MCP SDK, uvicorn or OpenTelemetry SDK, and no command module."""
    loaded = _modules_after(*args)
    assert _heavy(loaded) == []
    commands = {c.module for c in COMMANDS.values()}
    assert sorted(commands & set(loaded)) == []
    assert "sqlalchemy" not in loaded
    assert "pydantic_settings" not in loaded


def test_the_table_lists_the_same_commands_as_before() -> None:
    """The root group lists exactly the commands it registered eagerly before, in order."""
    group = get_group(app)
    ctx = group.make_context("outbox", [], resilient_parsing=True)
    assert group.list_commands(ctx) == EXPECTED
    assert list(COMMANDS) == EXPECTED


@pytest.mark.parametrize("name", EXPECTED)
def test_a_summary_in_the_table_is_the_commands_own(name: str) -> None:
    """Each command's one-line help in the table is the first paragraph of its real help,
    as Typer shows it in the root help, so the table cannot drift from the commands."""
    group = get_group(app)
    ctx = group.make_context("outbox", [], resilient_parsing=True)
    command = group.get_command(ctx, name)
    assert command is not None
    assert command.name == name
    text = command.short_help or command.help or ""
    first = inspect.cleandoc(text).split("\n\n")[0].replace("\n", " ").strip()
    assert COMMANDS[name].summary == first
    assert isinstance(command, TyperGroup) == (COMMANDS[name].attribute == "app")
    if isinstance(command, TyperGroup):
        # Typer hands the root's markup mode down to a sub-group, as when it was eager.
        assert command.rich_markup_mode == MARKUP_MODE


def test_the_stored_epilog_is_the_settings_own() -> None:
    """The root help's stored epilog equals the one built from the settings class, and was
    made from this outbox/config.py (`python -m outbox.cli.epilog` writes it again)."""
    assert environment_help() == stored.TEXT, "run `python -m outbox.cli.epilog`"
    assert config_digest() == stored.CONFIG_SHA256, "run `python -m outbox.cli.epilog`"
    with open(stored.__file__, encoding="utf-8") as source:
        assert source.read() == render()
    assert root_epilog() == environment_help()


def test_a_changed_settings_module_makes_the_epilog_built_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stored epilog whose digest no longer matches outbox/config.py is not shown: the
    epilog is built from the settings class instead."""
    monkeypatch.setattr(stored, "TEXT", "stale")
    assert root_epilog() == "stale"
    monkeypatch.setattr(stored, "CONFIG_SHA256", "0" * 64)
    assert root_epilog() == environment_help()


def _all_paths() -> list[list[str]]:
    group = get_group(app)
    paths: list[list[str]] = []

    def walk(parent: TyperGroup, prefix: list[str]) -> None:
        ctx = parent.make_context("outbox", [], resilient_parsing=True)
        for name in parent.list_commands(ctx):
            command = parent.get_command(ctx, name)
            paths.append([*prefix, name])
            if isinstance(command, TyperGroup):
                walk(command, [*prefix, name])

    walk(group, [])
    return paths


def test_every_commands_help_answers() -> None:
    """`outbox ... --help` of every command and sub-command exits 0 with its usage line."""
    for path in _all_paths():
        done = subprocess.run(
            [sys.executable, "-m", "outbox", *path, "--help"],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "160"},
            check=False,
        )
        assert done.returncode == 0, (path, done.stderr)
        assert f"Usage: outbox {' '.join(path)}" in done.stdout, path
