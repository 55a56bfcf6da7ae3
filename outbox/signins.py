"""The console's sign-in throttle: failed sign-ins per name and per client address, kept in
PostgreSQL so that every ``outbox api`` process (``--workers N``, or several replicas) counts
the same failures.

After ``limit`` failures within ``window_s`` for a name or for an address, that key is
refused until ``lockout_s`` after its last failure; a success forgets the name's failures (an
address's stay: one address guessing many names). Ages are measured on the database's clock.
Failures older than the window are deleted as new ones come in, so the table holds at most
one window's worth.
"""

from __future__ import annotations

from dataclasses import dataclass

from outbox import sql
from outbox.models import Executor

__all__ = ["Refusal", "Throttle"]

#: A key is stored at most this long: a longer "name" cannot be an account's
#: (outbox.tokens.NAME_PATTERN) and is cut, which only makes such junk share a key.
MAX_KEY_LENGTH = 128


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a sign-in is refused before its password is checked: which limit, for how long."""

    what: str
    retry_after_s: int


@dataclass(frozen=True, slots=True)
class Throttle:
    """The throttle's limits; its state is the table ``outbox.signin_failures``.

    Each method runs in the caller's transaction and never commits.
    """

    #: Failures of one key, within the window, that lock it.
    limit: int = 5
    #: How far back failures count (15 minutes: a slow guesser still meets the limit).
    window_s: float = 900.0
    #: How long a locked key stays locked after its last failure.
    lockout_s: float = 60.0

    def refusal(self, executor: Executor, *, name: str, address: str) -> Refusal | None:
        """A :class:`Refusal` if this name or this address is locked out now, else ``None``."""
        name, address = name[:MAX_KEY_LENGTH], address[:MAX_KEY_LENGTH]
        found = {
            row.kind: row
            for row in sql.signins.recent_failures(
                executor,
                name=name,
                address=address,
                window_s=self.window_s,
                lockout_s=self.lockout_s,
            )
        }
        for kind, what in (("name", "this name"), ("address", "this address")):
            row = found.get(kind)
            if row is not None and row.failures >= self.limit and row.lockout_left_s > 0:
                return Refusal(what=what, retry_after_s=max(1, round(row.lockout_left_s + 0.5)))
        return None

    def failed(self, executor: Executor, *, name: str, address: str) -> None:
        """Count a failed sign-in against the name and the address."""
        sql.signins.record_failure(
            executor,
            name=name[:MAX_KEY_LENGTH],
            address=address[:MAX_KEY_LENGTH],
            window_s=self.window_s,
        )

    def succeeded(self, executor: Executor, *, name: str) -> None:
        """Forget the name's failures (the address's stay)."""
        sql.signins.clear_name(executor, name=name[:MAX_KEY_LENGTH])
