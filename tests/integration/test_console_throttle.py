"""The console's sign-in throttle: per name and per client address, in PostgreSQL (so every
`outbox api` process counts the same failures)."""

from __future__ import annotations

from sqlalchemy import Engine, func, select

from outbox.schema import signin_failures
from outbox.signins import MAX_KEY_LENGTH, Refusal, Reservation, Throttle


def test_five_failures_for_a_name_lock_it_from_any_address(engine: Engine) -> None:
    """After `limit` failures for a name, that name is refused, naming the name as the limit."""
    throttle = Throttle(limit=5, lockout_s=60)
    with engine.begin() as conn:
        for n in range(5):
            assert throttle.refusal(conn, name="alice", address=f"10.0.0.{n}") is None
            throttle.failed(conn, name="alice", address=f"10.0.0.{n}")
        refused = throttle.refusal(conn, name="alice", address="10.0.0.99")
        assert refused is not None
        assert refused.what == "this name"
        assert 1 <= refused.retry_after_s <= 61
        assert throttle.refusal(conn, name="bob", address="10.0.0.99") is None


def test_five_failures_from_an_address_lock_it_for_every_name(engine: Engine) -> None:
    """One address guessing many names is refused for all of them."""
    throttle = Throttle(limit=5)
    with engine.begin() as conn:
        for n in range(5):
            throttle.failed(conn, name=f"user{n}", address="192.0.2.7")
        refused = throttle.refusal(conn, name="someone-else", address="192.0.2.7")
        assert refused is not None
        assert refused.what == "this address"


def test_a_success_clears_the_names_failures_not_the_addresses(engine: Engine) -> None:
    """A successful sign-in forgets the name's failures; the address's are kept."""
    throttle = Throttle(limit=2)
    with engine.begin() as conn:
        throttle.failed(conn, name="alice", address="a")
        throttle.succeeded(conn, name="alice")
        throttle.failed(conn, name="alice", address="b")
        assert throttle.refusal(conn, name="alice", address="c") is None
        throttle.failed(conn, name="carol", address="a")
        assert throttle.refusal(conn, name="dave", address="a") is not None


def test_a_lockout_ends_and_old_failures_leave_the_window(engine: Engine) -> None:
    """With no lockout and no window, failures never lock anything."""
    throttle = Throttle(limit=1, window_s=0.0, lockout_s=0.0)
    with engine.begin() as conn:
        throttle.failed(conn, name="alice", address="a")
        assert throttle.refusal(conn, name="alice", address="a") is None


def test_failures_older_than_the_window_are_deleted(engine: Engine) -> None:
    """Each new failure deletes the ones that left the window, so the table stays small."""
    with engine.begin() as conn:
        conn.execute(
            signin_failures.insert().values(
                kind="name",
                value="old",
                failed_at=func.clock_timestamp() - func.make_interval(0, 0, 0, 0, 1),
            )
        )
        Throttle(window_s=60).failed(conn, name="new", address="b")
        kept = conn.execute(select(signin_failures.c.value).order_by(signin_failures.c.id))
        assert [row.value for row in kept] == ["new", "b"]


def test_a_long_name_is_cut_to_the_stored_length(engine: Engine) -> None:
    """A name longer than any account's is stored cut, and still counts and locks."""
    throttle = Throttle(limit=1)
    long_name = "x" * 10_000
    with engine.begin() as conn:
        throttle.failed(conn, name=long_name, address="c")
        refused = throttle.refusal(conn, name=long_name, address="d")
        assert refused is not None
        assert refused.what == "this name"
        stored = conn.execute(select(func.max(func.char_length(signin_failures.c.value))))
        assert stored.scalar() == MAX_KEY_LENGTH


def test_a_reservation_counts_before_the_check_and_a_success_takes_it_back(
    engine: Engine,
) -> None:
    """`reserve` counts the attempt as a failure at once (the limit-th reservation locks the
    name), and a success with its reservation leaves no row of it, the address's included."""
    throttle = Throttle(limit=2)
    with engine.begin() as conn:
        first = throttle.reserve(conn, name="alice", address="a")
        assert isinstance(first, Reservation)
        assert isinstance(throttle.reserve(conn, name="alice", address="b"), Reservation)
        refused = throttle.reserve(conn, name="alice", address="c")
        assert isinstance(refused, Refusal)
        assert refused.what == "this name"
        mine = throttle.reserve(conn, name="bob", address="d")
        assert isinstance(mine, Reservation)
        throttle.succeeded(conn, name="bob", reservation=mine)
        left = conn.execute(select(signin_failures.c.value).order_by(signin_failures.c.id))
        assert [row.value for row in left] == ["alice", "a", "alice", "b"]
