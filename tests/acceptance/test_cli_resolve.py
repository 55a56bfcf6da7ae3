"""`outbox ops resolve` and the human queue, run as a real subprocess against a real PostgreSQL."""

from __future__ import annotations

import re
import shlex
import uuid
from pathlib import Path

import pytest
from sqlalchemy import Engine

from outbox import sql
from outbox.locks import operation_lock_key
from outbox.models import Operation
from outbox.states import Actor, State
from tests.acceptance.conftest import CLI, Result, run_outbox
from tests.factories import age, event_count, events_of, make_operation, move, reload

#: With no tools configured the CLI knows no contract, so the default horizon applies.
DEFAULT_HORIZON_S = 600
REASON = "no lookup and no dedup window"


def waiting(engine: Engine, state: State = State.NEEDS_HUMAN, *, aged: bool = True) -> Operation:
    """An operation in ``state`` after one attempt; ``aged``: the default horizon has passed."""
    op = make_operation(engine, state)
    if aged:
        age(engine, op.id, DEFAULT_HORIZON_S + 1, "sent_at", "first_sent_at")
    return reload(engine, op.id)


def resolve_args(
    op: Operation, *verdict: str, by: str = "alice", note: str = "checked"
) -> list[str]:
    """The `ops resolve` arguments for ``op`` with ``verdict`` flags, signed and explained."""
    return ["ops", "resolve", str(op.id), *verdict, "--by", by, "--note", note]


def assert_one_line_error(result: Result, *fragments: str) -> None:
    """Exit 1, nothing on stdout, one `error:` line on stderr holding every fragment."""
    assert result.code == 1, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_applied_confirms_and_prints_the_operation(outbox_cli: CLI, engine: Engine) -> None:
    """`--applied --remote-ref` confirms it, prints it, and the trail names the operator."""
    op = waiting(engine, aged=False)
    done = outbox_cli(*resolve_args(op, "--applied", "--remote-ref", "rel-9", note="in console"))
    assert done.code == 0, done.stderr
    assert f"{op.id} resolved by alice: now confirmed" in done.stdout
    assert "rel-9" in done.stdout
    last = events_of(engine, op.id)[-1]
    assert (last.to_state, last.actor, last.reason) == (
        State.CONFIRMED,
        "operator",
        "resolved by alice: in console",
    )
    assert last.detail is not None
    assert last.detail["by"] == "alice"


def test_not_applied_fails_it_as_json(outbox_cli: CLI, engine: Engine) -> None:
    """`--not-applied --json` prints the failed operation with maybe_applied cleared."""
    op = waiting(engine)
    done = outbox_cli(*resolve_args(op, "--not-applied", "--json", note="nothing there"))
    assert done.code == 0, done.stderr
    body = done.json()
    assert (body["id"], body["state"], body["maybe_applied"], body["last_error"]) == (
        str(op.id),
        "failed",
        False,
        "nothing there",
    )


def test_replay_plans_it_again_as_json(outbox_cli: CLI, engine: Engine) -> None:
    """`--not-applied --replay --json` prints it planned, unpublished, same key and hash."""
    op = waiting(engine, State.UNKNOWN)
    done = outbox_cli(*resolve_args(op, "--not-applied", "--replay", "--json"))
    assert done.code == 0, done.stderr
    body = done.json()
    assert body["state"] == "planned"
    assert body["published_at"] is None
    assert body["maybe_applied"] is False
    assert (body["intent_key"], body["payload_hash"]) == (op.intent_key, op.payload_hash)


def test_before_the_horizon_not_applied_is_refused_until_forced(
    outbox_cli: CLI, engine: Engine
) -> None:
    """Before the horizon `--not-applied` exits 1 saying why and how long; `--force` resolves it."""
    op = waiting(engine, aged=False)
    refused = outbox_cli(*resolve_args(op, "--not-applied"))
    assert_one_line_error(
        refused, "default in-flight horizon (600s", "is not registered", "try again in", "--force"
    )
    assert reload(engine, op.id) == op
    forced = outbox_cli(*resolve_args(op, "--not-applied", "--force", "--json"))
    assert forced.code == 0, forced.stderr
    assert forced.json()["state"] == "failed"
    detail = events_of(engine, op.id)[-1].detail
    assert detail is not None
    assert detail["forced"] is True


def test_the_horizon_comes_from_the_configured_tool(
    outbox_cli: CLI, engine: Engine, cli_env: dict[str, str], tmp_path: Path
) -> None:
    """The command loads the tools, so a tool's own in-flight horizon is the one enforced."""
    config = tmp_path / "tools.toml"
    config.write_text(
        '[tools."deploy.create_release"]\n'
        'kind = "http"\n'
        'url = "http://127.0.0.1:9/projects/{target}/releases"\n'
        'idempotency_header = "Idempotency-Key"\n'
        'remote_ref = "id"\n'
        "inflight_horizon_s = 30\n",
        encoding="utf-8",
    )
    env = cli_env | {"OUTBOX_CONFIG": str(config)}
    op = waiting(engine, aged=False)
    refused = run_outbox(*resolve_args(op, "--not-applied"), env=env)
    assert_one_line_error(refused, "tool 'deploy.create_release''s in-flight horizon (30s)")
    age(engine, op.id, 31, "sent_at", "first_sent_at")
    done = run_outbox(*resolve_args(op, "--not-applied", "--json"), env=env)
    assert done.code == 0, done.stderr
    assert done.json()["state"] == "failed"


def test_a_broken_tools_setting_is_one_line(outbox_cli: CLI, cli_env: dict[str, str]) -> None:
    """A tools module that cannot be imported stops the command with one line naming it."""
    env = cli_env | {"OUTBOX_TOOLS": "no_such_tools_module"}
    result = run_outbox(
        "ops",
        "resolve",
        str(uuid.uuid4()),
        "--applied",
        "--remote-ref",
        "r",
        "--by",
        "a",
        "--note",
        "n",
        env=env,
    )
    assert_one_line_error(result, "cannot load the tools", "no_such_tools_module")


@pytest.mark.parametrize(
    ("build", "verdict", "fragments"),
    [
        ("planned", ["--applied", "--remote-ref", "r"], ["is planned", "only unknown or"]),
        ("confirmed", ["--not-applied", "--force"], ["is confirmed", "terminal"]),
        ("waiting", ["--applied"], ["--remote-ref"]),
        ("waiting", ["--applied", "--remote-ref", "r", "--replay"], ["--replay"]),
        ("waiting", ["--not-applied", "--remote-ref", "r"], ["--remote-ref"]),
        ("waiting", ["--applied", "--remote-ref", "r", "--expect-attempts", "0"], ["attempt 1"]),
        ("waiting", ["--applied", "--remote-ref", "r", "--payload-hash", "ab" * 32], ["mismatch"]),
    ],
    ids=["planned", "terminal", "no-ref", "applied-replay", "ref-not-applied", "stale", "hash"],
)
def test_refusals_are_one_line_and_write_nothing(
    outbox_cli: CLI, engine: Engine, build: str, verdict: list[str], fragments: list[str]
) -> None:
    """A refused resolution exits 1 with one line saying why, and the operation is untouched."""
    state = {"planned": State.PLANNED, "confirmed": State.CONFIRMED}.get(build, State.NEEDS_HUMAN)
    op = waiting(engine, state, aged=state is State.NEEDS_HUMAN)
    events_before = event_count(engine, op.id)
    result = outbox_cli(*resolve_args(op, *verdict))
    assert_one_line_error(result, *fragments, "nothing was changed")
    assert reload(engine, op.id) == op
    assert event_count(engine, op.id) == events_before


def test_blank_operator_or_note_is_refused(outbox_cli: CLI, engine: Engine) -> None:
    """An empty --by or --note exits 1 naming the option."""
    op = waiting(engine)
    no_by = outbox_cli(*resolve_args(op, "--applied", "--remote-ref", "r", by=" "))
    assert_one_line_error(no_by, "--by")
    no_note = outbox_cli(*resolve_args(op, "--applied", "--remote-ref", "r", note=""))
    assert_one_line_error(no_note, "--note")
    assert reload(engine, op.id) == op


def test_a_busy_operation_is_one_line(outbox_cli: CLI, engine: Engine) -> None:
    """While another component holds the operation's lock the command exits 1: try again."""
    op = waiting(engine)
    with engine.connect() as holder:
        assert sql.locks.try_lock(holder, operation_lock_key(op.id))
        holder.commit()
        try:
            busy = outbox_cli(*resolve_args(op, "--applied", "--remote-ref", "r"))
        finally:
            sql.locks.unlock_all(holder)
            holder.commit()
    assert_one_line_error(busy, "is working on operation", "try again")
    assert reload(engine, op.id) == op


def test_unknown_and_malformed_ids_are_one_line(outbox_cli: CLI) -> None:
    """An id naming no operation, or no id at all, exits 1 with one line."""
    for operation_id, fragment in ((str(uuid.uuid4()), "no operation"), ("nope", "nope")):
        result = outbox_cli(
            "ops",
            "resolve",
            operation_id,
            "--applied",
            "--remote-ref",
            "r",
            "--by",
            "a",
            "--note",
            "n",
        )
        assert_one_line_error(result, fragment)


@pytest.mark.parametrize(
    "flags",
    [[], ["--applied", "--not-applied", "--remote-ref", "r"]],
    ids=["neither", "both"],
)
def test_exactly_one_verdict_flag_or_a_usage_error(
    outbox_cli: CLI, engine: Engine, flags: list[str]
) -> None:
    """Neither or both of --applied and --not-applied is a usage error (exit 2)."""
    op = waiting(engine)
    result = outbox_cli(*resolve_args(op, *flags))
    assert result.code == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("error: ")
    assert "exactly one of --applied or --not-applied" in line
    assert reload(engine, op.id) == op


def test_by_and_note_are_required(outbox_cli: CLI, engine: Engine) -> None:
    """Leaving out --by or --note is a usage error (exit 2)."""
    op = waiting(engine)
    base = ["ops", "resolve", str(op.id), "--applied", "--remote-ref", "r"]
    assert outbox_cli(*base, "--note", "n").code == 2
    assert outbox_cli(*base, "--by", "a").code == 2


def test_the_human_queue_lists_age_and_reason(outbox_cli: CLI, engine: Engine) -> None:
    """`ops list --state needs_human --wide` shows each operation's tool, target, wait and
    reason on its line."""
    seen = waiting(engine, State.UNKNOWN)
    stuck = move(engine, seen, State.NEEDS_HUMAN, Actor.RECONCILER, reason=REASON)
    make_operation(engine, State.PLANNED)  # not in the queue
    age(engine, stuck.id, 7200, "updated_at")

    listed = outbox_cli("ops", "list", "--state", "needs_human", "--wide")
    assert listed.code == 0, listed.stderr
    [row] = [line for line in listed.stdout.splitlines() if str(stuck.id) in line]
    for column in ("deploy.create_release", "project-a", "2h", REASON):
        assert column in row, row
    assert "waiting" in listed.stdout

    as_json = outbox_cli("ops", "list", "--state", "needs_human", "--json")
    assert as_json.code == 0, as_json.stderr
    [body] = as_json.json()
    assert (body["id"], body["state"], body["reason"]) == (str(stuck.id), "needs_human", REASON)


def test_show_of_an_operation_never_sent_offers_no_applied(outbox_cli: CLI, engine: Engine) -> None:
    """An operation escalated before any attempt (its tool unknown to the worker) cannot
    have applied: `ops show` says so and offers only to fail it or send it."""
    op = make_operation(engine, State.PLANNED, tool="billing.chrage")
    escalated = move(engine, op, State.NEEDS_HUMAN, Actor.DISPATCHER, reason="not registered")
    assert escalated.attempts == 0
    shown = outbox_cli("ops", "show", str(op.id))
    assert shown.code == 0, shown.stderr
    assert "never sent" in shown.stdout
    lines = [line for line in shown.stdout.splitlines() if "outbox ops resolve" in line]
    assert len(lines) == 2
    assert not any("--applied" in line for line in lines)


def test_show_prints_the_commands_to_copy_and_they_work(outbox_cli: CLI, engine: Engine) -> None:
    """`ops show` of a waiting operation prints fenced resolve commands; one, filled in, works."""
    op = waiting(engine)
    shown = outbox_cli("ops", "show", str(op.id))
    assert shown.code == 0, shown.stderr
    fence = f"--expect-attempts {op.attempts} --payload-hash {op.payload_hash}"
    lines = [line for line in shown.stdout.splitlines() if "outbox ops resolve" in line]
    assert len(lines) == 3
    assert all(fence in line for line in lines)
    [applied] = [line for line in lines if "--applied" in line]
    command = applied.split("outbox ", 1)[1]
    command = command.replace("REMOTE_ID", "rel-5")
    command = re.sub(r'"YOUR NAME"', "carol", command)
    command = re.sub(r'"WHAT YOU CHECKED"', '"seen in the console"', command)
    done = outbox_cli(*shlex.split(command), "--json")
    assert done.code == 0, done.stderr
    assert (done.json()["state"], done.json()["remote_ref"]) == ("confirmed", "rel-5")

    settled = outbox_cli("ops", "show", str(op.id))
    assert "outbox ops resolve" not in settled.stdout
