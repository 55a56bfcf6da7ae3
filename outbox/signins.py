"""The console's sign-in throttle: failed sign-ins per name and per client address, kept in
PostgreSQL so that every ``outbox api`` process (``--workers N``, or several replicas) counts
the same failures.

After ``limit`` failures within ``window_s`` for a name or for an address, that key is
refused until ``lockout_s`` after its last failure; a success forgets the name's failures (an
address's stay: one address guessing many names). Ages are measured on the database's clock.
Failures older than the window are deleted as new ones come in, so the table holds at most
one window's worth.

Concurrent sign-ins cannot slip past the count: :meth:`Throttle.reserve` takes the name's and
the address's advisory locks, reads their failures and, unless refused, records the attempt
as a failure before its password is checked, all in one transaction the caller commits; a
right password then takes its reservation back (:meth:`Throttle.succeeded`). So at most
``limit`` passwords are checked per window per key, then one per lockout, however many
sign-ins arrive at once and whichever process serves them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from outbox import sql
from outbox.models import Executor

__all__ = ["Refusal", "Reservation", "Throttle"]

#: A key is stored at most this long: a longer "name" cannot be an account's
#: (outbox.tokens.NAME_PATTERN) and is cut, which only makes such junk share a key.
MAX_KEY_LENGTH = 128


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a sign-in is refused before its password is checked: which limit, for how long."""

    what: str
    retry_after_s: int


@dataclass(frozen=True, slots=True)
class Reservation:
    """An attempt counted as a failure before its password is checked: the rows to take back
    if the password is right."""

    name: str
    ids: list[int] = field(default_factory=list)


def _lock_key(kind: str, value: str) -> int:
    """A signed 64-bit advisory lock key for one throttle key (blake2b: stable everywhere)."""
    digest = hashlib.blake2b(f"outbox.signins:{kind}:{value}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


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

    def reserve(self, executor: Executor, *, name: str, address: str) -> Refusal | Reservation:
        """Refuse this sign-in if its name or address is locked out now; else count it as a
        failure already and return the :class:`Reservation`. Holds the two keys' advisory
        locks until the caller's transaction ends: commit it before checking the password."""
        name, address = name[:MAX_KEY_LENGTH], address[:MAX_KEY_LENGTH]
        sql.signins.lock_keys(
            executor, sorted({_lock_key("name", name), _lock_key("address", address)})
        )
        refused = self.refusal(executor, name=name, address=address)
        if refused is not None:
            return refused
        ids = sql.signins.record_failure(
            executor, name=name, address=address, window_s=self.window_s
        )
        return Reservation(name=name, ids=ids)

    def failed(self, executor: Executor, *, name: str, address: str) -> None:
        """Count a failed sign-in against the name and the address."""
        sql.signins.record_failure(
            executor,
            name=name[:MAX_KEY_LENGTH],
            address=address[:MAX_KEY_LENGTH],
            window_s=self.window_s,
        )

    def succeeded(
        self, executor: Executor, *, name: str, reservation: Reservation | None = None
    ) -> None:
        """Forget the name's failures (the address's stay), and take back ``reservation``."""
        ids = reservation.ids if reservation is not None else []
        sql.signins.clear_name(executor, name=name[:MAX_KEY_LENGTH], ids=ids)
