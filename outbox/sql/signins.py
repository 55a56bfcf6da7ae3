"""The console sign-in throttle's statements (:mod:`outbox.signins`): failures counted per
name and per client address, shared by every ``outbox api`` process."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text

from outbox.models import Executor


@dataclass(frozen=True, slots=True)
class RecentFailures:
    """One key's failures inside the window, and how long until its lockout ends."""

    kind: str
    value: str
    failures: int
    #: Seconds from now to the end of the lockout its last failure started (negative: over).
    lockout_left_s: float


# The window and the lockout are measured on the database's clock (DESIGN.md, "Time").
_RECENT_FAILURES = text(
    """
    SELECT kind, value, count(*) AS failures,
           extract(epoch FROM max(failed_at) + make_interval(secs => :lockout_s)
                              - clock_timestamp())::float8 AS lockout_left_s
    FROM outbox.signin_failures
    WHERE ((kind = 'name' AND value = :name) OR (kind = 'address' AND value = :address))
      AND failed_at > clock_timestamp() - make_interval(secs => :window_s)
    GROUP BY kind, value
    """
)


def recent_failures(
    executor: Executor, *, name: str, address: str, window_s: float, lockout_s: float
) -> list[RecentFailures]:
    """The failures of ``name`` and of ``address`` younger than ``window_s`` (a key with none
    is left out)."""
    rows = executor.execute(
        _RECENT_FAILURES,
        {"name": name, "address": address, "window_s": window_s, "lockout_s": lockout_s},
    ).mappings()
    return [
        RecentFailures(
            kind=row["kind"],
            value=row["value"],
            failures=row["failures"],
            lockout_left_s=row["lockout_left_s"],
        )
        for row in rows
    ]


# The keys' transaction-scoped advisory locks, taken in the order given (the caller sorts
# them, so two sign-ins never wait on each other crosswise).
_LOCK_KEYS = text(
    "SELECT count(pg_advisory_xact_lock(k)) FROM unnest(CAST(:keys AS bigint[])) AS k"
)


def lock_keys(executor: Executor, keys: list[int]) -> None:
    """Hold these advisory locks until the caller's transaction ends: a statement after this
    sees every failure committed by the sign-ins that held them before."""
    executor.execute(_LOCK_KEYS, {"keys": keys})


# One statement: the failure against both keys, and the rows that left the window go.
_RECORD_FAILURE = text(
    """
    WITH expired AS (
        DELETE FROM outbox.signin_failures
        WHERE failed_at < clock_timestamp() - make_interval(secs => :window_s)
    )
    INSERT INTO outbox.signin_failures (kind, value)
    VALUES ('name', :name), ('address', :address)
    RETURNING id
    """
)


def record_failure(executor: Executor, *, name: str, address: str, window_s: float) -> list[int]:
    """Count one failed sign-in against ``name`` and ``address``; forget failures older than
    ``window_s``. The two rows' ids."""
    found = executor.execute(
        _RECORD_FAILURE, {"name": name, "address": address, "window_s": window_s}
    )
    return list(found.scalars())


_CLEAR_NAME = text(
    "DELETE FROM outbox.signin_failures "
    "WHERE (kind = 'name' AND value = :name) OR id = ANY(CAST(:ids AS bigint[]))"
)


def clear_name(executor: Executor, *, name: str, ids: list[int] | None = None) -> None:
    """Forget the failures counted against ``name``, and the rows ``ids`` (a reservation)."""
    executor.execute(_CLEAR_NAME, {"name": name, "ids": ids or []})
