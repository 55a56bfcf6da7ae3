"""`outbox ops approve|reject` and the approval queue, run as a real subprocess against a real
PostgreSQL."""

from __future__ import annotations

from sqlalchemy import Engine

from outbox.models import Operation
from outbox.states import Actor, State
from tests.acceptance.conftest import CLI, run_outbox
from tests.acceptance.test_cli_resolve import assert_one_line_error
from tests.factories import event_count, events_of, make_operation, reload


def awaiting(engine: Engine) -> Operation:
    """A committed operation awaiting approval."""
    return make_operation(engine, State.AWAITING_APPROVAL)


def test_approve_with_the_right_hash_plans_it(outbox_cli: CLI, engine: Engine) -> None:
    """`ops approve --by --payload-hash` plans it and the trail names the approver."""
    op = awaiting(engine)
    done = outbox_cli(
        "ops",
        "approve",
        str(op.id),
        "--by",
        "alice",
        "--payload-hash",
        op.payload_hash,
        "--note",
        "read it",
    )
    assert done.code == 0, done.stderr
    assert f"{op.id} approved by alice: now planned" in done.stdout
    last = events_of(engine, op.id)[-1]
    assert (last.to_state, last.actor, last.reason) == (
        State.PLANNED,
        Actor.OPERATOR.value,
        "approved by alice: read it",
    )


def test_approve_with_a_wrong_hash_is_one_line_and_writes_nothing(
    outbox_cli: CLI, engine: Engine
) -> None:
    """A wrong hash exits 1 with one line naming both hashes' prefixes; nothing changes."""
    op = awaiting(engine)
    events = event_count(engine, op.id)
    done = outbox_cli("ops", "approve", str(op.id), "--by", "alice", "--payload-hash", "a" * 64)
    assert_one_line_error(done, "payload hash mismatch", "a" * 12, op.payload_hash[:12])
    assert reload(engine, op.id).state is State.AWAITING_APPROVAL
    assert event_count(engine, op.id) == events


def test_a_second_approval_says_who_decided(outbox_cli: CLI, engine: Engine) -> None:
    """Approving twice: the second exits 1 with "already decided by alice at"."""
    op = awaiting(engine)
    args = ["ops", "approve", str(op.id), "--payload-hash", op.payload_hash]
    assert outbox_cli(*args, "--by", "alice").code == 0
    assert_one_line_error(outbox_cli(*args, "--by", "bob"), "already decided by alice at ")


def test_reject_cancels_it(outbox_cli: CLI, engine: Engine) -> None:
    """`ops reject --by --reason` cancels it."""
    op = awaiting(engine)
    done = outbox_cli("ops", "reject", str(op.id), "--by", "carol", "--reason", "wrong target")
    assert done.code == 0, done.stderr
    assert f"{op.id} rejected by carol: now cancelled" in done.stdout
    assert reload(engine, op.id).state is State.CANCELLED


def test_approve_without_by_is_a_usage_error(outbox_cli: CLI, engine: Engine) -> None:
    """A missing --by exits 2 (usage)."""
    op = awaiting(engine)
    done = outbox_cli("ops", "approve", str(op.id), "--payload-hash", op.payload_hash)
    assert done.code == 2


def test_the_approval_queue_lists_what_waits_with_its_hash(
    cli_env: dict[str, str], engine: Engine
) -> None:
    """`ops list --state awaiting_approval --wide` shows each waiting operation, its expiry
    and whole hash; `ops show` prints the commands to approve or reject it."""
    op = awaiting(engine)
    make_operation(engine)  # planned: not listed
    wide = cli_env | {"COLUMNS": "400"}
    listed = run_outbox("ops", "list", "--state", "awaiting_approval", "--wide", env=wide)
    assert listed.code == 0, listed.stderr
    assert str(op.id) in listed.stdout
    assert op.payload_hash in listed.stdout
    assert "expires" in listed.stdout
    shown = run_outbox("ops", "show", str(op.id), env=wide)
    assert shown.code == 0, shown.stderr
    assert "required, waiting" in shown.stdout
    assert f"outbox ops approve {op.id} --by NAME --payload-hash {op.payload_hash}" in shown.stdout
