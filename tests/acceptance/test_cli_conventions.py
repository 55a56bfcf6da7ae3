"""CLI conventions every command keeps: --version, choices, usage errors on one line (exit 2),
``ops show`` by intent key, ``enqueue`` checking the configured tools. Real subprocesses."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import get_args

import pytest

import outbox
from outbox.cli.chaos import Broker
from outbox.cli.dev import ScenarioMode
from outbox.cli.options import QUEUE_NAMES
from tests.acceptance.conftest import CLI, clean_environment, run_outbox
from tests.tool_configs import TOOL, http_tool_toml

#: Nothing listens there: a command that got past its options fails to connect (exit 1).
UNREACHABLE = "postgresql://nobody@127.0.0.1:9/none"


def _unreachable_env(tmp_path: Path) -> dict[str, str]:
    return clean_environment(OUTBOX_DATABASE_URL=UNREACHABLE, OUTBOX_HOME=str(tmp_path))


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def test_version_is_the_installed_distributions(tmp_path: Path) -> None:
    """``outbox --version`` and ``outbox.__version__`` say the installed version."""
    assert outbox.__version__ == metadata.version("agent-outbox")
    result = run_outbox("--version", env=_unreachable_env(tmp_path))
    assert (result.code, result.stdout.strip()) == (0, f"outbox {outbox.__version__}")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["worker", "--pool", "fibers"], "--pool"),
        (["worker", "--log-level", "LOUD"], "--log-level"),
        (["worker", "-Q", "dispatch,bogus"], "bogus"),
        (["worker", "-c", "0"], "--concurrency"),
        (["relay", "--log-level", "verbose"], "--log-level"),
        (["relay", "--batch-size", "0"], "--batch-size"),
        (["beat", "--log-level", "x"], "--log-level"),
        (["metrics", "--log-level", "x"], "--log-level"),
        (["metrics", "--port", "70000"], "--port"),
        (["up", "--log-level", "x"], "--log-level"),
        (["flower", "--port", "0", "--no-auth"], "--port"),
        (["ops", "list", "--state", "bogus"], "--state"),
        (["ops", "list", "--limit", "0"], "--limit"),
        (["ops", "list", "--no-such-option"], "--no-such-option"),
        (["ops", "show"], "ID_OR_KEY"),
        (["webhooks", "list", "--status", "lost-in-space"], "--status"),
        (["db", "prune", "--older-than", "3 weeks"], "--older-than"),
        (["dev", "scenario", "--mode", "BAD"], "--mode"),
        (["dev", "scenario", "--mode", "lookup", "--mode", "sideways"], "--mode"),
        (["chaos", "--broker", "BAD"], "--broker"),
        (["enqueue", "--tool", TOOL, "--target", "t", "--payload", "{x"], "--payload"),
        (
            ["enqueue", "--tool", TOOL, "--target", "t", "--payload", "{}", "--metadata", "["],
            "--metadata",
        ),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_a_bad_option_value_is_one_line_and_exit_2(
    tmp_path: Path, args: list[str], named: str
) -> None:
    """Whatever the command, a bad option value is a usage error: exit 2, one line naming the
    option, no traceback, before anything connects (the database here is unreachable)."""
    result = run_outbox(*args, env=_unreachable_env(tmp_path))
    assert result.code == 2, result.stderr
    assert named in _one_error_line(result.stderr)


@pytest.mark.parametrize("level", ["debug", "Warning", "ERROR"])
def test_log_levels_are_accepted_in_any_case(tmp_path: Path, level: str) -> None:
    """A known level in any case passes the options: the command goes on to connect."""
    result = run_outbox("metrics", "--log-level", level, env=_unreachable_env(tmp_path))
    assert result.code == 1
    assert "cannot reach the database" in _one_error_line(result.stderr)


def test_the_queue_choices_are_the_workers_queues() -> None:
    """``-Q`` accepts exactly the queues the Celery app declares."""
    from outbox.workers.app import QUEUES  # noqa: PLC0415 -- the [worker] extra

    assert set(QUEUE_NAMES) == set(QUEUES)


def test_the_dev_choices_are_what_the_dev_tooling_runs() -> None:
    """``dev scenario --mode`` and ``chaos --broker`` accept exactly the tooling's values."""
    from outbox.dev.chaos import BrokerKind  # noqa: PLC0415 -- the chaos machinery
    from outbox.dev.scenario import MODES  # noqa: PLC0415 -- the [worker] extra

    assert [mode.value for mode in ScenarioMode] == list(MODES)
    assert {broker.value for broker in Broker} == set(get_args(BrokerKind))


def test_ops_show_takes_an_id_or_an_intent_key(outbox_cli: CLI) -> None:
    """The same operation by id and by key; a name of neither is one line, exit 1."""
    created = outbox_cli(
        "enqueue", "--tool", TOOL, "--target", "t", "--payload", "{}", "--key", "release 7"
    ).stdout.split()[0]
    by_id = outbox_cli("ops", "show", created, "--json")
    by_key = outbox_cli("ops", "show", "release 7", "--json")
    assert by_id.code == by_key.code == 0, (by_id.stderr, by_key.stderr)
    assert by_id.json()["id"] == by_key.json()["id"] == created
    assert by_key.json()["events"] == by_id.json()["events"]
    missing = outbox_cli("ops", "show", "release 8")
    assert missing.code == 1
    assert "'release 8'" in _one_error_line(missing.stderr)


def test_enqueue_refuses_a_tool_the_configured_tools_do_not_register(
    cli_env: dict[str, str], engine: object, tmp_path: Path
) -> None:
    """With OUTBOX_CONFIG set, enqueue loads the tools: an unknown tool is refused (exit 1,
    one line naming it and the registered ones) and nothing is written; a known one goes."""
    config = tmp_path / "tools.toml"
    config.write_text(http_tool_toml("http://127.0.0.1:9"), encoding="utf-8")
    env = {**cli_env, "OUTBOX_CONFIG": str(config)}
    base = ["enqueue", "--target", "t", "--payload", "{}", "--json"]
    refused = run_outbox(*base, "--tool", "deploy.create_relaese", env=env)
    assert refused.code == 1
    line = _one_error_line(refused.stderr)
    assert "deploy.create_relaese" in line
    assert TOOL in line
    assert run_outbox("ops", "list", "--json", env=env).json() == []
    accepted = run_outbox(*base, "--tool", TOOL, env=env)
    assert accepted.code == 0, accepted.stderr
    assert accepted.json()["tool"] == TOOL


def test_enqueue_without_configured_tools_accepts_any_tool_name(outbox_cli: CLI) -> None:
    """No OUTBOX_TOOLS nor OUTBOX_CONFIG: nothing to check against, a well-formed name goes
    (the agent's own process may register tools the CLI does not know)."""
    result = outbox_cli("enqueue", "--tool", "mail.send", "--target", "t", "--payload", "{}")
    assert result.code == 0, result.stderr
