"""The environment as the CLI reads it: defaults in --help, unknown OUTBOX_* variables named."""

from __future__ import annotations

import json
from pathlib import Path

from outbox.config import Settings, variable
from outbox.logs import Action
from tests.acceptance.conftest import clean_environment, run_outbox

#: Nothing listens there: the command fails to connect after reading its settings.
UNREACHABLE = "postgresql://nobody@127.0.0.1:9/none"


def test_help_shows_every_variable_with_its_default(tmp_path: Path) -> None:
    """`outbox --help` lists each setting, OUTBOX_FLOWER_BASIC_AUTH too, with its default."""
    # Wide enough that rich wraps no line of the epilog.
    env = clean_environment(OUTBOX_HOME=str(tmp_path), COLUMNS="1000")
    top = run_outbox("--help", env=env)
    assert top.code == 0, top.stderr
    for name in Settings.model_fields:
        assert f"{variable(name)} (default: " in top.stdout, name
    assert "OUTBOX_SENT_TIMEOUT (default: 60)" in top.stdout
    assert "OUTBOX_FLOWER_BASIC_AUTH (default: unset)" in top.stdout


def test_a_misspelt_variable_is_warned_about_by_name(
    cli_env: dict[str, str], engine: object
) -> None:
    """The command runs, and says once on stderr which variable it ignored and the likely
    intended one (the misspelling the issue saw start an embedded PostgreSQL instead)."""
    result = run_outbox(
        "ops", "list", "--json", env={**cli_env, "OUTBOX_DATABSE_URL": "postgresql://elsewhere"}
    )
    assert result.code == 0, result.stderr
    assert result.json() == []
    assert result.stderr.splitlines() == [
        "warning: unknown variable OUTBOX_DATABSE_URL is ignored; did you mean OUTBOX_DATABASE_URL?"
    ]


def test_a_service_logs_the_warning_in_its_log_format(tmp_path: Path) -> None:
    """A long-running command logs it as a line of its log (JSON here), with its action."""
    env = clean_environment(
        OUTBOX_DATABASE_URL=UNREACHABLE,
        OUTBOX_HOME=str(tmp_path),
        OUTBOX_LOG_FORMAT="json",
        OUTBOX_SWEEP_INTERVALL="5",
    )
    result = run_outbox("metrics", "--port", "0", env=env)
    assert result.code == 1
    warning, error = result.stderr.splitlines()
    record = json.loads(warning)
    assert record["action"] == Action.CONFIG_UNKNOWN_VARIABLE
    assert record["level"] == "warning"
    assert "OUTBOX_SWEEP_INTERVALL" in record["msg"]
    assert "OUTBOX_SWEEP_INTERVAL?" in record["msg"]
    assert error.startswith("error: cannot reach the database")
