"""``outbox guards list|reset``, run as a real subprocess against a real PostgreSQL."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import api
from outbox.budgets import Budget, publish_budgets_committed
from tests.acceptance.conftest import run_outbox
from tests.tool_configs import TOOL, http_tool_toml

GUARDS = """
[tools."deploy.create_release".breaker]
failures = 3
open_s = 30
[tools."deploy.create_release".rate]
per_second = 10
burst = 10
per = "tool"
[tools."deploy.create_release".concurrency]
max_in_flight = 2
"""


def _env(cli_env: dict[str, str], tmp_path: Path, guards: str) -> dict[str, str]:
    config = tmp_path / "tools.toml"
    config.write_text(http_tool_toml("http://127.0.0.1:9") + guards, encoding="utf-8")
    return cli_env | {"OUTBOX_CONFIG": str(config)}


def test_list_then_reset_an_open_breaker(
    engine: Engine, cli_env: dict[str, str], tmp_path: Path
) -> None:
    """`guards list --json` shows every declared guard and an open breaker; `reset` closes it
    and records who and why."""
    env = _env(cli_env, tmp_path, GUARDS)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO outbox.guard_breakers (scope, tool, target, state, failures, "
                "open_until) VALUES ('dispatch', :tool, 'p1', 'open', 3, "
                "clock_timestamp() + interval '30 seconds')"
            ),
            {"tool": TOOL},
        )
    listed = run_outbox("guards", "list", "--json", env=env)
    assert listed.code == 0, listed
    rows = {(r["guard"], r["key"]): r for r in listed.json()["guards"]}
    assert rows[("breaker", f"{TOOL}:p1")]["state"]["state"] == "open"
    assert rows[("rate", TOOL)]["declared"] == {"per_second": 10, "burst": 10, "per": "tool"}
    assert rows[("concurrency", f"{TOOL}:*")]["state"] == {"in_flight": 0}
    done = run_outbox("guards", "reset", f"{TOOL}:p1", "--by", "ada", "--note", "fixed", env=env)
    assert done.code == 0, done
    with engine.connect() as conn:
        state = conn.execute(text("SELECT state FROM outbox.guard_breakers")).scalar_one()
        audit = conn.execute(text("SELECT reset_by, note FROM outbox.guard_resets")).one()
    assert (state, tuple(audit)) == ("closed", ("ada", "fixed"))


def test_bad_guard_declaration_names_the_field(
    engine: Engine, cli_env: dict[str, str], tmp_path: Path
) -> None:
    """A breaker with failures = 0 is refused at start-up, one line naming the tool and field."""
    env = _env(cli_env, tmp_path, '[tools."deploy.create_release".breaker]\nfailures = 0\n')
    result = run_outbox("guards", "list", env=env)
    assert result.code == 1, result
    assert "Traceback" not in result.stderr
    assert "breaker.failures" in result.stderr
    assert TOOL in result.stderr


def test_list_shows_each_budget_keys_use(
    engine: Engine, cli_env: dict[str, str], tmp_path: Path
) -> None:
    """`guards list --json` has a budgets section: each key's use inside its window."""
    publish_budgets_committed(
        engine, [Budget(name="spend", tools=(TOOL,), window_s=3600.0, max_operations=5)]
    )
    for n in range(2):
        with Session(engine) as session, session.begin():
            api.enqueue(session, tool=TOOL, target="p1", payload={"n": n}, requested_by="agent-7")
    listed = run_outbox("guards", "list", "--json", env=_env(cli_env, tmp_path, ""))
    assert listed.code == 0, listed
    (used,) = listed.json()["budgets"]
    assert (used["budget"], used["key"], used["operations"], used["max_operations"]) == (
        "spend",
        "agent-7",
        2,
        5,
    )
    shown = run_outbox("guards", "list", env=_env(cli_env, tmp_path, ""))
    assert "no guards declared" in shown.stdout
    assert "agent-7" in shown.stdout
    assert "2/5" in shown.stdout
