"""The ``outbox`` command line, run as a real subprocess against a real PostgreSQL."""

from __future__ import annotations

import concurrent.futures
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.acceptance.conftest import CLI, REPO, Result, clean_environment, run_outbox
from tests.conftest import Databases

TOOL = "deploy.create_release"


def _enqueue(outbox_cli: CLI, payload: str, *extra: str) -> Result:
    return outbox_cli(
        "enqueue", "--tool", TOOL, "--target", "project-a", "--payload", payload, *extra
    )


def test_enqueue_records_the_traceparent_of_its_environment(
    cli_env: dict[str, str], engine: object
) -> None:
    """TRACEPARENT/TRACESTATE in the environment are recorded with the operation; an invalid
    TRACEPARENT is ignored."""
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    args = ("enqueue", "--tool", TOOL, "--target", "project-a", "--json")
    traced = run_outbox(
        *args,
        "--payload",
        '{"version": "1"}',
        env={**cli_env, "TRACEPARENT": traceparent, "TRACESTATE": "k=v"},
    )
    assert traced.code == 0, traced.stderr
    assert (traced.json()["traceparent"], traced.json()["tracestate"]) == (traceparent, "k=v")
    invalid = run_outbox(
        *args, "--payload", '{"version": "2"}', env={**cli_env, "TRACEPARENT": "nonsense"}
    )
    assert invalid.code == 0, invalid.stderr
    assert invalid.json()["traceparent"] is None


def _assert_one_line_error(stderr: str, *fragments: str) -> None:
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_enqueue_twice_with_one_key_prints_the_same_operation(outbox_cli: CLI) -> None:
    """Enqueueing the same key and input twice prints the same id; the list holds one operation."""
    first = _enqueue(outbox_cli, '{"version": "1.2.0"}', "--key", "K", "--json")
    second = _enqueue(outbox_cli, '{"version":"1.2.0"}', "--key", "K", "--json")
    assert first.code == 0, first.stderr
    assert second.code == 0, second.stderr
    created = first.json()
    assert second.json()["id"] == created["id"]
    for field in (
        "id",
        "intent_key",
        "tool",
        "target",
        "state",
        "payload_hash",
        "attempts",
        "remote_ref",
        "created_at",
    ):
        assert field in created
    assert created["state"] == "planned"
    assert created["intent_key"] == "K"

    listed = outbox_cli("ops", "list", "--json")
    assert listed.code == 0, listed.stderr
    assert [op["id"] for op in listed.json() if op["intent_key"] == "K"] == [created["id"]]


def test_reused_key_with_another_payload_is_a_conflict(outbox_cli: CLI) -> None:
    """The same key with another payload exits non-zero saying "conflict" and writes nothing."""
    assert _enqueue(outbox_cli, '{"version": "1"}', "--key", "K").code == 0
    clash = _enqueue(outbox_cli, '{"version": "2"}', "--key", "K", "--json")
    assert clash.code == 1
    assert clash.stdout == ""
    _assert_one_line_error(clash.stderr, "conflict", "payload")
    assert len(outbox_cli("ops", "list", "--json").json()) == 1


def test_one_key_for_two_agents_is_two_operations_and_show_asks_which(outbox_cli: CLI) -> None:
    """`enqueue --agent` scopes the key: two agents' same key prints two ids; `ops show KEY`
    then names both agents and asks for the id (one line, exit 1); by id it shows the agent."""
    a = _enqueue(outbox_cli, '{"version": "1"}', "--key", "K", "--agent", "shop", "--json")
    b = _enqueue(outbox_cli, '{"version": "1"}', "--key", "K", "--agent", "crm", "--json")
    assert (a.code, b.code) == (0, 0), (a.stderr, b.stderr)
    assert a.json()["id"] != b.json()["id"]
    assert (a.json()["agent"], b.json()["agent"]) == ("shop", "crm")
    which = outbox_cli("ops", "show", "K")
    assert which.code == 1
    _assert_one_line_error(which.stderr, "2 operations", "agent crm", "agent shop", "give the id")
    shown = outbox_cli("ops", "show", a.json()["id"])
    assert shown.code == 0, shown.stderr
    assert "agent: shop" in shown.stdout


def test_show_prints_the_operation_with_its_events(outbox_cli: CLI) -> None:
    """`ops show --json` prints the operation and its events, each with states, actor and time."""
    op = _enqueue(outbox_cli, '{"v": 1}', "--json").json()
    shown = outbox_cli("ops", "show", op["id"], "--json")
    assert shown.code == 0, shown.stderr
    body = shown.json()
    assert body["id"] == op["id"]
    assert body["payload"] == {"v": 1}
    [event] = body["events"]
    assert event["from_state"] is None
    assert event["to_state"] == "planned"
    assert event["actor"] == "agent"
    assert event["reason"] == "enqueued"
    assert event["at"]


def test_show_and_list_print_tables_for_people(outbox_cli: CLI) -> None:
    """Without --json, list and show print readable tables naming the operation."""
    op = _enqueue(outbox_cli, '{"v": 1}', "--key", "human-key", "--json").json()
    listed = outbox_cli("ops", "list")
    assert listed.code == 0
    assert op["id"] in listed.stdout
    assert "human-key" in listed.stdout
    shown = outbox_cli("ops", "show", op["id"])
    assert shown.code == 0
    assert "enqueued" in shown.stdout
    assert op["payload_hash"] in shown.stdout


def test_payload_from_a_file_and_from_stdin(outbox_cli: CLI, tmp_path: Path) -> None:
    """`--payload @file` and `--payload @-` read the JSON from a file and from stdin."""
    path = tmp_path / "payload.json"
    path.write_text('{"from": "file"}', encoding="utf-8")
    from_file = _enqueue(outbox_cli, f"@{path}", "--json")
    assert from_file.code == 0, from_file.stderr
    assert from_file.json()["payload"] == {"from": "file"}
    from_stdin = outbox_cli(
        "enqueue", "--tool", TOOL, "--target", "t", "--payload", "@-", "--json", stdin='{"a": 1}'
    )
    assert from_stdin.code == 0, from_stdin.stderr
    assert from_stdin.json()["payload"] == {"a": 1}
    missing = _enqueue(outbox_cli, f"@{tmp_path / 'absent.json'}")
    assert missing.code == 2  # the option's value cannot be read: a usage error
    _assert_one_line_error(missing.stderr, "--payload", "absent.json")


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--tool", "bad tool", "--target", "t", "--payload", "{}"], ["tool", "bad tool"]),
        (["--tool", TOOL, "--target", "", "--payload", "{}"], ["target"]),
        (["--tool", TOOL, "--target", "t", "--payload", "[1, 2]"], ["payload", "JSON object"]),
        (["--tool", TOOL, "--target", "t", "--payload", '{"n": 1e400}'], ["payload"]),
        (["--tool", TOOL, "--target", "t", "--payload", "{}", "--key", "k" * 256], ["intent_key"]),
        (["--tool", TOOL, "--target", "t", "--payload", "{}", "--metadata", "[]"], ["metadata"]),
    ],
    ids=["tool", "target", "not-object", "infinity", "long-key", "metadata"],
)
def test_bad_input_is_refused_with_one_line(
    outbox_cli: CLI, args: list[str], fragments: list[str]
) -> None:
    """Malformed input exits 1 with one line naming the field, and writes nothing."""
    refused = outbox_cli("enqueue", *args)
    assert refused.code == 1
    _assert_one_line_error(refused.stderr, *fragments)
    assert outbox_cli("ops", "list", "--json").json() == []


def test_missing_option_is_a_usage_error(outbox_cli: CLI) -> None:
    """A missing required option exits 2, the usage-error code."""
    assert outbox_cli("enqueue", "--tool", TOOL, "--target", "t").code == 2


def test_list_filters_by_state_tool_and_limit(outbox_cli: CLI) -> None:
    """`ops list` filters by --state and --tool and stops at --limit."""
    kept = _enqueue(outbox_cli, '{"n": 1}', "--json").json()
    cancelled = _enqueue(outbox_cli, '{"n": 2}', "--json").json()
    other = outbox_cli(
        "enqueue", "--tool", "mail.send", "--target", "x", "--payload", "{}", "--json"
    ).json()
    assert outbox_cli("ops", "cancel", cancelled["id"]).code == 0

    planned = outbox_cli("ops", "list", "--state", "planned", "--json").json()
    assert {op["id"] for op in planned} == {kept["id"], other["id"]}
    by_tool = outbox_cli("ops", "list", "--tool", "mail.send", "--json").json()
    assert [op["id"] for op in by_tool] == [other["id"]]
    newest = outbox_cli("ops", "list", "--limit", "1", "--json").json()
    assert [op["id"] for op in newest] == [other["id"]]
    bad_state = outbox_cli("ops", "list", "--state", "bogus")
    assert bad_state.code == 2
    _assert_one_line_error(bad_state.stderr, "--state", "bogus")


def test_cancel_planned_then_refuse_a_second_cancel(outbox_cli: CLI) -> None:
    """`ops cancel` cancels a planned operation and refuses one that is not planned any more."""
    op = _enqueue(outbox_cli, '{"n": 1}', "--json").json()
    done = outbox_cli("ops", "cancel", op["id"], "--json")
    assert done.code == 0, done.stderr
    assert done.json()["state"] == "cancelled"
    again = outbox_cli("ops", "cancel", op["id"])
    assert again.code == 1
    _assert_one_line_error(again.stderr, "cancelled", "only a planned operation")
    events = outbox_cli("ops", "show", op["id"], "--json").json()["events"]
    assert [(e["to_state"], e["actor"]) for e in events] == [
        ("planned", "agent"),
        ("cancelled", "agent"),
    ]


@pytest.mark.parametrize("command", ["show", "cancel"])
def test_unknown_or_malformed_ids_are_refused(outbox_cli: CLI, command: str) -> None:
    """An id that names no operation, or is not an id at all, exits 1 with one line."""
    absent = outbox_cli("ops", command, str(uuid.uuid4()))
    assert absent.code == 1
    _assert_one_line_error(absent.stderr, "no operation")
    garbage = outbox_cli("ops", command, "not-an-id")
    assert garbage.code == 1
    _assert_one_line_error(garbage.stderr, "not-an-id")


def test_unreachable_database_is_named_without_its_password(tmp_path: Path) -> None:
    """An unreachable database exits 1 naming the URL with the password masked."""
    env = clean_environment(
        OUTBOX_DATABASE_URL="postgresql://someone:s3cret@127.0.0.1:9/outbox",
        OUTBOX_HOME=str(tmp_path),
    )
    result = run_outbox("ops", "list", env=env)
    assert result.code == 1
    _assert_one_line_error(result.stderr, "cannot reach the database", "127.0.0.1:9")
    assert "s3cret" not in result.stderr + result.stdout


def test_invalid_setting_is_named(tmp_path: Path) -> None:
    """An invalid OUTBOX_* value exits 1 naming the variable."""
    env = clean_environment(OUTBOX_SENT_TIMEOUT="soon", OUTBOX_HOME=str(tmp_path))
    result = run_outbox("ops", "list", env=env)
    assert result.code == 1
    _assert_one_line_error(result.stderr, "OUTBOX_SENT_TIMEOUT")


def test_schema_missing_says_to_upgrade(databases: Databases, tmp_path: Path) -> None:
    """On a database never migrated, commands say to run `outbox db upgrade`."""
    env = clean_environment(OUTBOX_DATABASE_URL=databases.create(), OUTBOX_HOME=str(tmp_path))
    listed = run_outbox("ops", "list", env=env)
    assert listed.code == 1
    _assert_one_line_error(listed.stderr, "outbox db upgrade")
    checked = run_outbox("db", "check", env=env)
    assert checked.code == 1
    _assert_one_line_error(checked.stderr, "outbox db upgrade")


def test_db_upgrade_then_check(databases: Databases, tmp_path: Path) -> None:
    """`db upgrade` brings a fresh database to head, a second run says so, and `db check` passes."""
    env = clean_environment(OUTBOX_DATABASE_URL=databases.create(), OUTBOX_HOME=str(tmp_path))
    first = run_outbox("db", "upgrade", env=env)
    assert first.code == 0, first.stderr
    assert "upgraded from empty" in first.stdout
    second = run_outbox("db", "upgrade", env=env)
    assert second.code == 0
    assert "already" in second.stdout
    checked = run_outbox("db", "check", env=env)
    assert checked.code == 0, checked.stderr


def test_two_concurrent_upgrades_both_succeed(databases: Databases, tmp_path: Path) -> None:
    """Two `db upgrade` processes started together on an empty database both exit 0."""
    env = clean_environment(OUTBOX_DATABASE_URL=databases.create(), OUTBOX_HOME=str(tmp_path))
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda _: run_outbox("db", "upgrade", env=env), range(2)))
    assert [r.code for r in results] == [0, 0], [r.stderr for r in results]
    assert run_outbox("db", "check", env=env).code == 0


def test_db_sql_prints_ddl_without_a_database(tmp_path: Path) -> None:
    """`db sql` prints the DDL even when no database is reachable."""
    env = clean_environment(
        OUTBOX_DATABASE_URL="postgresql://nobody@127.0.0.1:9/none", OUTBOX_HOME=str(tmp_path)
    )
    result = run_outbox("db", "sql", env=env)
    assert result.code == 0, result.stderr
    assert "CREATE SCHEMA IF NOT EXISTS outbox" in result.stdout
    assert "CREATE TABLE outbox.operations" in result.stdout
    assert "CREATE TABLE outbox.events" in result.stdout


def test_help_names_every_setting(tmp_path: Path) -> None:
    """`outbox --help` lists the OUTBOX_* variables; each command has its own help."""
    env = clean_environment(OUTBOX_HOME=str(tmp_path))
    top = run_outbox("--help", env=env)
    assert top.code == 0
    for variable in ("OUTBOX_DATABASE_URL", "OUTBOX_BROKER_URL", "OUTBOX_SENT_TIMEOUT"):
        assert variable in top.stdout
    for command in (["db"], ["db", "upgrade"], ["ops"], ["ops", "list"], ["enqueue"]):
        assert run_outbox(*command, "--help", env=env).code == 0


def test_installed_console_script_runs() -> None:
    """The `outbox` console script installed with the package is on the venv's path."""
    script = Path(sys.executable).parent / "outbox"
    if not script.exists():
        found = shutil.which("outbox")
        assert found is not None, "the outbox console script is not installed"
        script = Path(found)
    done = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, check=False, cwd=REPO
    )
    assert done.returncode == 0
    assert "enqueue" in done.stdout


# admin_url: on the embedded path the suite's tuned server is up (started under the suite's
# lock) before this command reuses it, rather than started beside it by a parallel worker.
@pytest.mark.usefixtures("admin_url")
def test_embedded_database_when_nothing_is_configured() -> None:
    """With no OUTBOX_DATABASE_URL the CLI starts (or reuses) the embedded PostgreSQL."""
    env = clean_environment(OUTBOX_HOME=str(REPO / ".outbox-test"))
    assert run_outbox("db", "upgrade", env=env, timeout=120).code == 0
    key = f"embedded-{uuid.uuid4()}"
    made = run_outbox(
        "enqueue",
        "--tool",
        TOOL,
        "--target",
        "t",
        "--payload",
        "{}",
        "--key",
        key,
        "--json",
        env=env,
    )
    assert made.code == 0, made.stderr
    shown = run_outbox("ops", "show", made.json()["id"], "--json", env=env)
    assert shown.json()["intent_key"] == key
