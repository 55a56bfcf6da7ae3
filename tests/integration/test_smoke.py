"""A first check that the fixtures give a migrated, empty database."""

from sqlalchemy import Engine

from outbox.states import State
from tests.factories import event_count, make_operation


def test_factory_reaches_every_state(engine: Engine) -> None:
    """The factory builds an operation in each state through real transitions."""
    for state in State:
        op = make_operation(engine, state)
        assert op.state is state
    assert event_count(engine) > len(State)
