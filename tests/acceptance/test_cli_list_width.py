"""`outbox ops list` on an 80-column screen, run as a real subprocess against a real
PostgreSQL: nothing a reader needs is cut, and `--wide` keeps everything whole."""

from __future__ import annotations

from sqlalchemy import Engine

from outbox.models import Operation
from outbox.states import State
from tests.acceptance.conftest import Result, run_outbox
from tests.factories import make_operation

#: A tool and a target as long as real ones, which the 80-column table used to cut.
TOOL = "billing.refund_customer_invoice"
TARGET = "customer-4242/invoice-2026-0001"


def _awaiting(engine: Engine, n: int) -> list[Operation]:
    return [
        make_operation(engine, State.AWAITING_APPROVAL, tool=TOOL, target=TARGET) for _ in range(n)
    ]


def _list(cli_env: dict[str, str], *args: str, columns: int = 80) -> Result:
    done = run_outbox("ops", "list", *args, env=cli_env | {"COLUMNS": str(columns)})
    assert done.code == 0, done.stderr
    return done


def _expiry(op: Operation) -> str:
    assert op.approval_expires_at is not None
    return op.approval_expires_at.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_the_approval_queue_fits_80_columns_with_nothing_needed_cut(
    cli_env: dict[str, str], engine: Engine
) -> None:
    """At 80 columns the approval queue keeps each id, tool, target and expiry whole, shows
    the hash's first 12 characters, and no line is wider than 80."""
    ops = _awaiting(engine, 2)
    out = _list(cli_env, "--state", "awaiting_approval").stdout
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80, out
    assert "…" not in out, out
    for op in ops:
        assert any(str(op.id) in line for line in lines), out
        assert any(TOOL in line for line in lines), out
        assert any(TARGET in line for line in lines), out
        assert any(_expiry(op) in line for line in lines), out
        assert op.payload_hash[:12] in out, out
        assert op.payload_hash not in out, out


def test_every_list_keeps_tool_target_and_state_whole_at_80_columns(
    cli_env: dict[str, str], engine: Engine
) -> None:
    """At 80 columns the plain list and the operator's queue keep tool, target and state
    whole, and no line is wider than 80."""
    [approval] = _awaiting(engine, 1)
    stuck = make_operation(engine, State.NEEDS_HUMAN, tool=TOOL, target=TARGET)
    for args, op, state in (
        ((), approval, "awaiting_approval"),
        (("--state", "needs_human"), stuck, None),
    ):
        out = _list(cli_env, *args).stdout
        lines = out.splitlines()
        assert max(len(line) for line in lines) <= 80, out
        assert any(TOOL in line for line in lines), out
        assert any(TARGET in line for line in lines), out
        assert any(str(op.id) in line for line in lines), out
        if state is not None:
            assert any(state in line for line in lines), out


def test_wide_prints_one_line_per_operation_with_the_whole_hash(
    cli_env: dict[str, str], engine: Engine
) -> None:
    """`--wide` prints each operation on one line with its id, tool, target, expiry and whole
    payload hash, however narrow the screen."""
    ops = _awaiting(engine, 2)
    out = _list(cli_env, "--state", "awaiting_approval", "--wide").stdout
    for op in ops:
        [line] = [line for line in out.splitlines() if str(op.id) in line]
        for whole in (TOOL, TARGET, _expiry(op), op.payload_hash):
            assert whole in line, out


def test_json_is_the_same_whatever_the_width(cli_env: dict[str, str], engine: Engine) -> None:
    """`--json` prints every field whole, at 80 columns as at 400."""
    _awaiting(engine, 1)
    narrow = _list(cli_env, "--state", "awaiting_approval", "--json").json()
    wide = _list(cli_env, "--state", "awaiting_approval", "--json", columns=400).json()
    assert narrow == wide
    assert len(narrow[0]["payload_hash"]) == 64
