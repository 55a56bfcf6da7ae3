"""compose.yaml: every service of our image runs a real ``outbox`` command, and Compose accepts it.

The image's entrypoint is ``outbox`` (Dockerfile), so a service's ``command`` is the argument
list of the console script. Each is checked against the Typer app itself: the command path
exists (``outbox <path> --help`` succeeds), every option given is one the command declares, and
the arguments parse. Compose's own check, ``docker-compose config -q``, runs when Compose is
installed (v1, Debian's ``docker-compose``; v2, ``docker compose``), and must be under CI.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from outbox.cli import app

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
ENV_EXAMPLE = ROOT / ".env.example"

#: The processes a deployment cannot do without, all from our image.
CORE = {"migrate", "relay", "worker", "beat", "flower", "metrics", "api"}
#: Long-running processes that need the schema and the broker before they start.
AFTER_MIGRATE = ("relay", "worker", "beat", "flower", "metrics", "api")
#: ``${NAME:?message}``: a variable Compose refuses to run without.
REQUIRED_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):\?")


def _in_ci() -> bool:
    return os.environ.get("CI") == "true"


def _yaml() -> ModuleType:
    # PyYAML is a dev dependency; a missing one skips this module locally and fails it in CI.
    try:
        return importlib.import_module("yaml")
    except ModuleNotFoundError:
        if _in_ci():
            raise
        pytest.skip("PyYAML is not installed", allow_module_level=True)


def _load_compose() -> dict[str, Any]:
    # safe_load resolves the `<<: *anchor` merge keys, as Compose does.
    data = _yaml().safe_load(COMPOSE_FILE.read_text("utf-8"))
    assert isinstance(data, dict)
    return data


COMPOSE = _load_compose()
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
#: Services built from our Dockerfile, so running `outbox <command>`.
OURS = sorted(name for name, service in SERVICES.items() if "build" in service)


def _argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command")
    if command is None:
        return []
    if isinstance(command, str):
        return shlex.split(command)
    return [str(part) for part in command]


def _is_group(command: Any) -> bool:
    # Duck-typed: recent Typer releases ship their own click, whose classes are not click's.
    return hasattr(command, "list_commands")


def _resolve(argv: list[str]) -> tuple[list[str], Any, list[str]]:
    """The sub-command path at the head of ``argv``, its (click) command, and the rest."""
    root: Any = typer.main.get_command(app)
    context = root.context_class(root, info_name="outbox")
    command = root
    path: list[str] = []
    rest = list(argv)
    while _is_group(command) and rest and not rest[0].startswith("-"):
        sub = command.get_command(context, rest[0])
        if sub is None:
            pytest.fail(f"`outbox {' '.join([*path, rest[0]])}` is not an outbox command")
        path.append(rest.pop(0))
        command = sub
    return path, command, rest


def _declared_options(command: Any) -> set[str]:
    return {
        str(name)
        for param in command.params
        if param.param_type_name == "option"
        for name in (*param.opts, *param.secondary_opts)
    }


def _required_variables() -> set[str]:
    return set(REQUIRED_VARIABLE.findall(COMPOSE_FILE.read_text("utf-8")))


def _env_example() -> dict[str, str]:
    """The uncommented ``NAME=value`` lines of .env.example."""
    pairs = {}
    for line in ENV_EXAMPLE.read_text("utf-8").splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            name, _, value = stripped.partition("=")
            pairs[name.strip()] = value.strip()
    return pairs


def test_our_image_runs_every_outbox_process() -> None:
    """Each core process is a service built from our Dockerfile, with its entrypoint."""
    assert set(OURS) >= CORE
    for name in OURS:
        assert "entrypoint" not in SERVICES[name], f"{name}: the command must stay outbox's"
        assert _argv(SERVICES[name]), f"{name}: no command (the image's default is --help)"


@pytest.mark.parametrize("name", OURS)
def test_service_command_is_a_real_outbox_command(name: str) -> None:
    """The command path exists, each option is declared by it, and the arguments parse."""
    argv = _argv(SERVICES[name])
    path, command, rest = _resolve(argv)
    assert not _is_group(command), f"{name}: `outbox {' '.join(path)}` is a group of commands"

    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, f"{name}: `outbox {' '.join(path)} --help`:\n{result.output}"

    declared = _declared_options(command)
    used = {arg.split("=", 1)[0] for arg in rest if arg.startswith("-") and arg != "-"}
    unknown = sorted(used - declared)
    assert not unknown, f"{name}: `outbox {' '.join(path)}` has no option {', '.join(unknown)}"

    # Types, ranges and required options, as the real command line would check them.
    command.make_context(" ".join(["outbox", *path]), rest)


def test_worker_healthcheck_names_the_celery_app() -> None:
    """The worker's `celery -A module:attr inspect ping` names our Celery app."""
    test = SERVICES["worker"]["healthcheck"]["test"]
    match = re.search(r"celery -A ([\w.]+):(\w+) ", " ".join(test))
    assert match, test
    module, attribute = match.groups()
    assert hasattr(importlib.import_module(module), attribute)


def test_processes_wait_for_the_schema_and_the_broker() -> None:
    """Long-running processes start after `db upgrade` succeeded and RabbitMQ is healthy."""
    assert _argv(SERVICES["migrate"]) == ["db", "upgrade"]
    assert SERVICES["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert SERVICES["migrate"]["restart"] == "no"
    for name in AFTER_MIGRATE:
        service = SERVICES[name]
        depends = service["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully", name
        assert depends["rabbitmq"]["condition"] == "service_healthy", name
        assert service["restart"] == "unless-stopped", name
    for name in ("postgres", "rabbitmq"):
        assert "healthcheck" in SERVICES[name], name


def test_the_api_is_checked_by_its_readiness() -> None:
    """The API's health check probes /readyz on the port its command binds."""
    argv = _argv(SERVICES["api"])
    port = argv[argv.index("--port") + 1]
    assert f"http://127.0.0.1:{port}/readyz" in " ".join(SERVICES["api"]["healthcheck"]["test"])


def test_the_mcp_server_is_checked_on_its_port() -> None:
    """The MCP service serves HTTP and its health check probes /healthz on the port it binds."""
    argv = _argv(SERVICES["mcp"])
    assert argv[:2] == ["mcp", "--http"]
    port = argv[argv.index("--port") + 1]
    assert f"http://127.0.0.1:{port}/healthz" in " ".join(SERVICES["mcp"]["healthcheck"]["test"])


def test_published_ports_are_on_loopback_only() -> None:
    """Nothing is published beyond the host itself (Flower, metrics, the demo service)."""
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port} is not on 127.0.0.1"


def test_secrets_come_only_from_the_environment() -> None:
    """Every required variable is listed, empty, in .env.example; no secret is written in."""
    example = _env_example()
    required = _required_variables()
    assert {"POSTGRES_PASSWORD", "RABBITMQ_PASSWORD", "OUTBOX_FLOWER_BASIC_AUTH"} <= required
    assert required <= set(example), f"missing from .env.example: {required - set(example)}"
    filled = sorted(name for name, value in example.items() if value)
    assert not filled, f".env.example must not carry values for {filled}"
    for name, service in SERVICES.items():
        environment = service.get("environment") or {}
        assert isinstance(environment, dict), f"{name}: environment as a mapping"
        for key, value in environment.items():
            text = "" if value is None else str(value)
            if re.search(r"PASS|SECRET|AUTH", key) and text:
                assert "${" in text, f"{name}: {key} must come from the environment"
            if "://" in text and "@" in text:  # a URL with credentials
                credentials = text.split("://", 1)[1].rsplit("@", 1)[0]
                assert "${" in credentials, f"{name}: {key}'s password must be a variable"


def _compose_commands() -> list[list[str]]:
    commands = []
    legacy = shutil.which("docker-compose")
    if legacy:
        commands.append([legacy])
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            commands.append([docker, "compose"])
    return commands


@pytest.fixture(scope="module")
def compose_commands() -> list[list[str]]:
    commands = _compose_commands()
    if not commands:
        if _in_ci():
            pytest.fail("neither docker-compose nor docker compose is installed, and CI needs one")
        pytest.skip("neither docker-compose nor docker compose is installed")
    return commands


def _run_config(
    compose: list[str], env_file: Path, home: Path, profile: str | None
) -> subprocess.CompletedProcess[str]:
    argv = [
        *compose,
        "--project-directory",
        str(ROOT),
        "-f",
        str(COMPOSE_FILE),
        "--env-file",
        str(env_file),
        *(["--profile", profile] if profile else []),
        "config",
        "-q",
    ]
    # Only PATH and a scratch HOME: the caller's variables must not fill in what .env lacks.
    environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
    return subprocess.run(
        argv, capture_output=True, text=True, env=environment, check=False, timeout=60
    )


@pytest.mark.parametrize("profile", [None, "demo"])
def test_compose_accepts_the_file(
    compose_commands: list[list[str]], tmp_path: Path, profile: str | None
) -> None:
    """`config -q` succeeds with every variable of .env.example given a dummy value."""
    env_file = tmp_path / "env"
    env_file.write_text("".join(f"{name}=ci-dummy\n" for name in _env_example()), "utf-8")
    for compose in compose_commands:
        result = _run_config(compose, env_file, tmp_path, profile)
        assert result.returncode == 0, f"{' '.join(compose)}: {result.stderr}"


def test_compose_refuses_to_run_without_the_secrets(
    compose_commands: list[list[str]], tmp_path: Path
) -> None:
    """With .env.example copied as is, Compose stops and names a missing secret."""
    for compose in compose_commands:
        result = _run_config(compose, ENV_EXAMPLE, tmp_path, None)
        assert result.returncode != 0, f"{' '.join(compose)} accepted empty secrets"
        assert any(name in result.stderr for name in _required_variables()), result.stderr
