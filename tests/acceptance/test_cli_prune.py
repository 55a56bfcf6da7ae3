"""`outbox db prune`, run as a real subprocess against a real PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from outbox.states import State
from tests.acceptance.conftest import CLI, clean_environment, run_outbox
from tests.conftest import Databases
from tests.factories import age, make_operation
from tests.tool_configs import http_tool_toml

DAY = 86400
PRUNED = "with their events and webhook deliveries; their intents are remembered"


@pytest.fixture
def cli_env(database_url: str, tmp_path: Path) -> dict[str, str]:
    """The CLI on the test database, with the tools' contracts as the workers load them:
    deploy.create_release without a dedup window, billing.charge with one of 90 days."""
    config = tmp_path / "tools.toml"
    url = "http://127.0.0.1:9"
    config.write_text(
        http_tool_toml(url)
        + http_tool_toml(url, "billing.charge", dedup_window_s=90 * DAY, dedup_margin_s=300),
        encoding="utf-8",
    )
    return clean_environment(
        OUTBOX_DATABASE_URL=database_url, OUTBOX_HOME=str(tmp_path), OUTBOX_CONFIG=str(config)
    )


def _assert_one_line_error(stderr: str, *fragments: str) -> None:
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def _rows(engine: Engine) -> tuple[int, int]:
    """How many operations and events are committed."""
    with engine.connect() as conn:
        return (
            int(conn.execute(text("SELECT count(*) FROM outbox.operations")).scalar_one()),
            int(conn.execute(text("SELECT count(*) FROM outbox.events")).scalar_one()),
        )


@pytest.fixture
def history(engine: Engine) -> dict[str, int]:
    """Three finished operations resolved 40 days ago, one yesterday, and two waiting ones."""
    for state in (State.CONFIRMED, State.FAILED, State.CANCELLED):
        op = make_operation(engine, state)
        age(engine, op.id, 40 * DAY, "resolved_at")
    recent = make_operation(engine, State.CONFIRMED)
    age(engine, recent.id, DAY, "resolved_at")
    make_operation(engine, State.NEEDS_HUMAN)
    make_operation(engine, State.PLANNED)
    operations, events = _rows(engine)
    return {"operations": operations, "events": events}


@pytest.mark.parametrize("value", ["30", "30x", "0d", "1.5h"])
def test_a_bad_duration_is_refused_naming_it(tmp_path: Path, value: str) -> None:
    """Not a whole number with s/m/h/d, or zero: a usage error (exit 2), one line naming the
    value, before any connection is attempted (the database here is unreachable)."""
    env = clean_environment(
        OUTBOX_DATABASE_URL="postgresql://nobody@127.0.0.1:9/none", OUTBOX_HOME=str(tmp_path)
    )
    refused = run_outbox("db", "prune", "--older-than", value, env=env)
    assert refused.code == 2
    assert refused.stdout == ""
    _assert_one_line_error(refused.stderr, "--older-than", repr(value))


def test_older_than_is_required(outbox_cli: CLI) -> None:
    """Without --older-than there is nothing to decide: a usage error, exit 2."""
    assert outbox_cli("db", "prune").code == 2


def test_dry_run_counts_and_deletes_nothing(
    outbox_cli: CLI, engine: Engine, history: dict[str, int]
) -> None:
    """`--dry-run` prints how many would go and leaves every row."""
    result = outbox_cli("db", "prune", "--older-than", "30d", "--dry-run")
    assert result.code == 0, result.stderr
    assert "would prune 3 operations resolved more than 30d ago" in result.stdout
    assert _rows(engine) == (history["operations"], history["events"])


def test_prune_deletes_the_old_finished_operations_in_batches(
    outbox_cli: CLI, engine: Engine, history: dict[str, int]
) -> None:
    """A real prune, one operation per batch: progress after each full batch, then the final
    line, exit 0; the recent and the waiting operations stay. A second run finds nothing."""
    result = outbox_cli(
        "db", "prune", "--older-than", "30d", "--batch-size", "1", "--progress-every", "0"
    )
    assert result.code == 0, result.stderr
    assert result.stdout.splitlines() == [
        "pruned 1 operation so far",
        "pruned 2 operations so far",
        "pruned 3 operations so far",
        f"pruned 3 operations resolved more than 30d ago, {PRUNED}",
    ]
    operations, events = _rows(engine)
    assert operations == history["operations"] - 3
    assert 0 < events < history["events"]
    with engine.connect() as conn:
        states = set(conn.execute(text("SELECT state FROM outbox.operations")).scalars())
    assert states == {"confirmed", "needs_human", "planned"}

    again = outbox_cli("db", "prune", "--older-than", "30d")
    assert again.code == 0, again.stderr
    assert again.stdout.splitlines() == [
        f"pruned 0 operations resolved more than 30d ago, {PRUNED}"
    ]


def test_the_output_says_what_was_kept_and_why(
    outbox_cli: CLI, engine: Engine, history: dict[str, int]
) -> None:
    """An operation inside its tool's dedup window and one of a tool not registered are kept,
    and both the dry run and the prune say so; the pruned intents can be forgotten later."""
    charged = make_operation(engine, State.CONFIRMED, tool="billing.charge")
    age(engine, charged.id, 40 * DAY, "resolved_at", "first_sent_at", "sent_at")
    legacy = make_operation(engine, State.FAILED, tool="legacy.tool")
    age(engine, legacy.id, 40 * DAY, "resolved_at")
    kept = [
        "kept 1 operation inside their tool's dedup window (the remote still remembers the key)",
        "kept 1 operation of tools not registered here, whose dedup window is unknown (set "
        "OUTBOX_TOOLS / OUTBOX_CONFIG as the workers do)",
    ]

    dry = outbox_cli("db", "prune", "--older-than", "30d", "--dry-run")
    assert dry.code == 0, dry.stderr
    flat = " ".join(dry.stdout.split())  # the console wraps long lines
    assert flat.startswith("dry run: would prune 3 operations resolved more than 30d ago"), flat
    for line in kept:
        assert line in flat, dry.stdout
    assert _rows(engine)[0] == history["operations"] + 2

    real = outbox_cli("db", "prune", "--older-than", "30d", "--forget-intents-older-than", "35d")
    assert real.code == 0, real.stderr
    flat = " ".join(real.stdout.split())
    assert f"pruned 3 operations resolved more than 30d ago, {PRUNED}" in flat
    for line in kept:
        assert line in flat, real.stdout
    assert "forgot 3 pruned intents whose operation ended more than 35d ago" in flat
    with engine.connect() as conn:
        left = set(conn.execute(text("SELECT id FROM outbox.operations")).scalars())
    assert {charged.id, legacy.id} <= left


def test_prune_on_an_unmigrated_database_says_to_upgrade(
    databases: Databases, tmp_path: Path
) -> None:
    """A database not at the latest revision: one line with the fix, exit 1."""
    env = clean_environment(OUTBOX_DATABASE_URL=databases.create(), OUTBOX_HOME=str(tmp_path))
    result = run_outbox("db", "prune", "--older-than", "30d", env=env)
    assert result.code == 1
    _assert_one_line_error(result.stderr, "outbox db upgrade")


def test_help_says_what_is_kept_and_suggests_cron(tmp_path: Path) -> None:
    """`db prune --help` names what is never pruned, what goes along, and cron."""
    env = clean_environment(OUTBOX_HOME=str(tmp_path))
    result = run_outbox("db", "prune", "--help", env=env)
    assert result.code == 0, result.stderr
    text_ = " ".join(result.stdout.split())
    for fragment in ("needs_human", "planned", "events", "webhook deliveries", "cron"):
        assert fragment in text_, result.stdout
