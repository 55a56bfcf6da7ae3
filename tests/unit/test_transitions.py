"""outbox.transitions without a database: each move takes only its own columns.

A column that does not fit a move is impossible three ways: the named function has no
parameter for it (a fact mypy checks, tested here by running mypy on misuses), a
:class:`~outbox.transitions.Move` built by hand with it raises ``ValueError``, and the
statement is built only from the columns :data:`outbox.states.COLUMNS_FOR` allows.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from mypy import api as mypy_api

from outbox import transitions
from outbox.states import ALLOWED, COLUMNS_FOR, Actor, State, may_take_late_evidence
from outbox.transitions import Move

#: Every column a move may write besides its state, as the fields of Move name them.
COLUMNS = frozenset().union(*COLUMNS_FOR.values())
#: Keyword parameters every named function has that are not columns.
COMMON = {"from_state", "actor", "attempt", "reason", "detail"}
#: Each named function, the state it moves into, and the columns it takes.
NAMED: list[tuple[Callable[..., Move], State, set[str]]] = [
    (transitions.mark_sent, State.SENT, set()),
    (transitions.confirm, State.CONFIRMED, {"remote_ref", "result"}),
    (transitions.fail, State.FAILED, {"last_error", "result"}),
    (transitions.mark_unknown, State.UNKNOWN, {"last_error", "check_in_s"}),
    (
        transitions.replan,
        State.PLANNED,
        {"last_error", "available_in_s", "replay_window_s", "not_applied"},
    ),
    (transitions.escalate, State.NEEDS_HUMAN, {"not_applied"}),
    (transitions.cancel, State.CANCELLED, set()),
    (transitions.approve, State.PLANNED, {"decided_by", "approved_payload_hash"}),
    (transitions.reject, State.CANCELLED, {"decided_by"}),
    (transitions.expire_approval, State.CANCELLED, set()),
    (transitions.await_approval, State.AWAITING_APPROVAL, {"approval_ttl_s"}),
]


def test_one_named_function_per_target_state() -> None:
    """Every state a move may enter has its named function (and ALLOWED agrees)."""
    assert {to for _, to, _ in NAMED} == {to for _, to in ALLOWED}


@pytest.mark.parametrize(
    ("named", "to_state", "columns"), NAMED, ids=[named.__name__ for named, _, _ in NAMED]
)
def test_named_function_takes_only_its_columns(
    named: Callable[..., Move], to_state: State, columns: set[str]
) -> None:
    """The signature names exactly the move's columns, all allowed into ``to_state``."""
    parameters = set(inspect.signature(named).parameters) - {"operation_id"}
    assert parameters & COLUMNS == columns
    assert parameters - COLUMNS <= COMMON
    assert columns <= COLUMNS_FOR[to_state]


def test_columns_for_names_move_fields() -> None:
    """COLUMNS_FOR speaks of Move's fields, so the check in Move covers all of them."""
    assert {f.name for f in dataclasses.fields(Move)} >= COLUMNS


def _value_for(column: str) -> Any:
    return {
        "remote_ref": "ref-1",
        "result": {"ok": True},
        "last_error": "HTTP 503",
        "not_applied": True,
        "available_in_s": 5.0,
        "replay_window_s": 60.0,
        "check_in_s": 5.0,
        "decided_by": "alice",
        "approved_payload_hash": "0" * 64,
        "approval_ttl_s": 60.0,
    }[column]


@pytest.mark.parametrize(
    ("to_state", "column"),
    [(to, column) for to in State for column in sorted(COLUMNS - COLUMNS_FOR[to])],
    ids=str,
)
def test_a_move_given_a_column_it_does_not_write_is_refused(to_state: State, column: str) -> None:
    """Data that slips past the types (a Move built by hand) raises, naming the column."""
    with pytest.raises(ValueError, match=column):
        Move(
            operation_id=uuid4(),
            from_state=State.SENT,
            to_state=to_state,
            actor=Actor.OPERATOR,
            reason="r",
            attempt=1,
            **{column: _value_for(column)},
        )


@pytest.mark.parametrize("to_state", list(State))
def test_a_move_with_its_own_columns_is_built(to_state: State) -> None:
    """Every column COLUMNS_FOR allows is accepted together."""
    columns = {column: _value_for(column) for column in COLUMNS_FOR[to_state]}
    move = Move(
        operation_id=uuid4(),
        from_state=State.SENT,
        to_state=to_state,
        actor=Actor.OPERATOR,
        reason="r",
        attempt=1,
        **columns,
    )
    assert {name: getattr(move, name) for name in columns} == columns


def test_a_named_function_called_with_a_foreign_column_raises() -> None:
    """Untyped callers get a TypeError: the column has nowhere to go."""
    confirm: Callable[..., Move] = transitions.confirm
    with pytest.raises(TypeError, match="last_error"):
        confirm(
            uuid4(),
            from_state=State.SENT,
            actor=Actor.DISPATCHER,
            attempt=1,
            reason="r",
            remote_ref="x",
            last_error="slow",
        )


def test_fixed_moves_name_their_states_and_actor() -> None:
    """mark_sent and cancel take no from_state or actor: the table allows only one."""
    sent = transitions.mark_sent(uuid4(), attempt=0, reason="r")
    assert (sent.from_state, sent.to_state, sent.actor) == (
        State.PLANNED,
        State.SENT,
        Actor.DISPATCHER,
    )
    cancelled = transitions.cancel(uuid4(), reason="r")
    assert (cancelled.from_state, cancelled.actor, cancelled.attempt) == (
        State.PLANNED,
        Actor.AGENT,
        None,
    )
    assert transitions.fail(
        uuid4(), from_state=State.SENT, actor=Actor.DISPATCHER, attempt=1, reason="r"
    ).not_applied, "a failure is authoritative: it always clears maybe_applied"


def test_mypy_refuses_a_column_that_does_not_fit(tmp_path: Path) -> None:
    """The signatures are what mypy checks callers against: each misuse is an error."""
    source = tmp_path / "misuse.py"
    source.write_text(
        textwrap.dedent(
            """
            from uuid import uuid4
            from outbox import transitions
            from outbox.states import Actor, State
            op = uuid4()
            transitions.confirm(op, from_state=State.SENT, actor=Actor.DISPATCHER,
                                attempt=1, reason="r", remote_ref="x", last_error="slow")
            transitions.mark_sent(op, attempt=0, reason="r", remote_ref="x")
            transitions.escalate(op, from_state=State.UNKNOWN, actor=Actor.RECONCILER,
                                 attempt=1, reason="r", available_in_s=5.0)
            transitions.confirm(op, from_state=State.SENT, actor=Actor.DISPATCHER,
                                attempt=1, reason="r")
            """
        )
    )
    out, _, status = mypy_api.run(
        ["--strict", "--follow-imports=silent", "--no-error-summary", str(source)]
    )
    assert status == 1, out
    errors = sorted(line.split(": error: ")[1] for line in out.splitlines() if ": error: " in line)
    assert errors == sorted(
        [
            'Unexpected keyword argument "last_error" for "confirm"  [call-arg]',
            'Unexpected keyword argument "remote_ref" for "mark_sent"  [call-arg]',
            'Unexpected keyword argument "available_in_s" for "escalate"  [call-arg]',
            'Missing named argument "remote_ref" for "confirm"  [call-arg]',
        ]
    ), out


# --- the late-evidence rule -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "attempts", "expected"),
    [
        (State.UNKNOWN, 2, True),  # still waiting for a verdict on that attempt
        (State.NEEDS_HUMAN, 2, True),
        (State.UNKNOWN, 3, False),  # a later attempt began: its own outcome decides
        (State.NEEDS_HUMAN, 3, False),
        (State.CONFIRMED, 2, False),  # decided: the evidence is only kept
        (State.FAILED, 2, False),
        (State.CANCELLED, 2, False),
        (State.PLANNED, 2, False),  # a replay is on its way: it will tell
        (State.SENT, 2, False),
    ],
)
def test_late_evidence_confirms_only_a_row_waiting_at_that_attempt(
    state: State, attempts: int, expected: bool
) -> None:
    """Evidence about attempt 2 confirms only a row still waiting for a verdict on it."""
    assert may_take_late_evidence(state, attempts, 2) is expected
