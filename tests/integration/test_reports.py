"""What an agent is told about an operation (outbox.reports), in every state."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import Engine

from outbox.reports import describe
from outbox.states import SETTLED_STATES, TERMINAL_STATES, State
from tests.factories import make_operation

_DO_NOT_RETRY = "Do not call this tool again with a new intent_key"


@pytest.mark.parametrize("state", list(State))
def test_every_state_has_an_outcome_and_says_whether_to_keep_away(
    engine: Engine, state: State
) -> None:
    """Every state maps to an outcome; only an unfinished one carries the do-not-retry advice."""
    op = make_operation(engine, state, tool="deploy.create_release", target="project-a")
    report = describe(op)

    assert (report.operation_id, report.state) == (str(op.id), state.value)
    assert report.settled is (state in SETTLED_STATES)
    assert str(op.id) in report.message
    assert "deploy.create_release on 'project-a'" in report.message
    assert (_DO_NOT_RETRY in report.message) is (state not in TERMINAL_STATES)
    assert json.loads(json.dumps(report.to_dict())) == report.to_dict()


@pytest.mark.parametrize(
    ("state", "outcome", "opening"),
    [
        (State.CONFIRMED, "confirmed", "Done:"),
        (State.FAILED, "failed", "Refused:"),
        (State.CANCELLED, "cancelled", "Cancelled:"),
        (State.PLANNED, "in_progress", "In progress:"),
        (State.SENT, "in_progress", "In progress:"),
        (State.UNKNOWN, "unknown", "Outcome not known yet:"),
        (State.NEEDS_HUMAN, "needs_human", "Needs a person:"),
        (State.AWAITING_APPROVAL, "awaiting_approval", "Waiting for approval:"),
    ],
)
def test_the_outcome_and_the_first_words(
    engine: Engine, state: State, outcome: str, opening: str
) -> None:
    """The outcome names the state's meaning and the message opens with it."""
    report = describe(make_operation(engine, state))
    assert report.outcome == outcome
    assert report.message.startswith(opening)


def test_a_confirmed_report_carries_the_remote_reference_and_result(engine: Engine) -> None:
    """A confirmed operation's report names its remote_ref; an unfinished one has no result."""
    done = describe(make_operation(engine, State.CONFIRMED))
    assert done.remote_ref == "rel-1"
    assert "remote reference rel-1" in done.message
    assert describe(make_operation(engine, State.SENT)).result is None


@pytest.mark.parametrize("state", [State.SENT, State.UNKNOWN, State.NEEDS_HUMAN])
def test_the_advice_fits_who_names_the_key(engine: Engine, state: State) -> None:
    """A derived key gets the no-new-call advice; a surface's own check replaces the default."""
    op = make_operation(engine, state)
    derived = describe(op, keyed_by_model=False, how_to_check="Ask the operator about {id}.")
    assert _DO_NOT_RETRY not in derived.message
    assert "Do not call this tool again for the same purpose" in derived.message
    assert derived.message.endswith(f"Ask the operator about {op.id}.")
    assert f"look it up by its operation id {op.id}" in describe(op).message


def test_a_refusal_says_why(engine: Engine) -> None:
    """A failed operation's message carries the remote's refusal."""
    assert "422 refused" in describe(make_operation(engine, State.FAILED)).message
