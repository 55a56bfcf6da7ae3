"""What the console's sign-in runs on, apart from the agents' requests: its password checks
(argon2id) on threads of their own, bounded; its own small database pool; its counters.

argon2 holds a core (and its lanes' threads) for about a tenth of a second per check. Run on
the threads the agents' requests share (anyio's), a burst of sign-ins, unknown names
included (they cost what a wrong password does), queued behind them and took the CPU: an
agent's enqueue went from milliseconds to seconds. Here each ``outbox api`` process checks at
most ``threads`` passwords at once, on a small ThreadPoolExecutor whose threads run at a
lower CPU priority (Linux's per-thread nice, inherited by argon2's lane threads); at most
``queue`` more sign-ins wait for one, and any beyond are refused at once (:class:`Busy`),
before they read anything from the database.

Its queries (the throttle, the account) run on an engine of their own with
:data:`POOL_SIZE` connections, so that a burst cannot take the connections the agents'
requests need; a sign-in that waits longer than :data:`POOL_TIMEOUT_S` for one is refused
like a busy one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.signins import Throttle

__all__ = ["NICE", "POOL_SIZE", "Busy", "PasswordChecks", "SigninMetrics", "Signins", "Slot"]

T = TypeVar("T")

#: How much nicer than the agents' requests a hashing thread is (19: the lowest priority;
#: argon2's lane threads, which it starts for every check, inherit it). Measured with
#: bench/api.py --mode signin (docs/performance.md, change 31), a burst of 40 sign-ins took an
#: agent's enqueue p99 to 2.8x its quiet value with these threads at nice 10, 2.0x at 19.
NICE = 19
#: Connections of the sign-in's own pool, per process (no overflow).
POOL_SIZE = 2
#: Longest wait for one of them before the sign-in is refused (503) instead.
POOL_TIMEOUT_S = 5.0
#: What a refused sign-in is told to wait, in seconds (Retry-After).
BUSY_RETRY_AFTER_S = 2


class Busy(Exception):
    """Every password-checking thread is busy and the queue is full: refused at once."""


def _lower_priority() -> None:
    """Make the calling thread (a hashing thread) nicer; on Linux nice is per thread."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            current = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), current + NICE)


class Slot:
    """One admitted sign-in's place; once its check is submitted, the check's thread gives it
    back when done (not the request: a client that hangs up cannot leave work uncounted)."""

    __slots__ = ("handed",)

    def __init__(self) -> None:
        self.handed = False


class PasswordChecks:
    """A bounded executor for argon2: ``threads`` at work, ``queue`` waiting, no more.

    :meth:`admitted` and :meth:`run` are called on the event loop's thread only (a plain
    counter, no lock; the threads give places back through the loop).
    """

    def __init__(self, *, threads: int, queue: int, rate: float = 1_000.0) -> None:
        self.capacity = threads + queue
        self.taken = 0
        self._interval_s = 1.0 / rate
        self._next_start = 0.0
        self._pace = threading.Lock()
        self._pool = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="outbox-argon2", initializer=_lower_priority
        )

    def _give_back(self) -> None:
        self.taken -= 1

    @contextlib.contextmanager
    def admitted(self) -> Iterator[Slot]:
        """A place among the ``threads + queue`` sign-ins in progress, held until the sign-in
        ends or, once its check is submitted, until the check ends; :class:`Busy` at once
        when there is none."""
        if self.taken >= self.capacity:
            raise Busy
        self.taken += 1
        slot = Slot()
        try:
            yield slot
        finally:
            if not slot.handed:
                self._give_back()

    def _paced(self, check: Callable[..., T], *args: object) -> T:
        """``check(*args)``, started no sooner than ``1/rate`` after the previous check.

        The nice alone was not enough on a 2-core host: a burst of 40 sign-ins still took an
        agent's enqueue p99 to 3.6x quiet (argon2's 64 MiB per check competes for the caches
        and memory bandwidth whatever the priority); paced at 2 a second it stays within 2x
        (docs/performance.md, change 31). The wait is bounded: at most ``threads + queue``
        checks are ever admitted.
        """
        with self._pace:
            now = time.monotonic()
            start = max(now, self._next_start)
            self._next_start = start + self._interval_s
        if start > now:
            time.sleep(start - now)
        return check(*args)

    async def run(self, slot: Slot, check: Callable[..., T], *args: object) -> T:
        """``check(*args)`` on a hashing thread, for the sign-in admitted with ``slot``."""
        loop = asyncio.get_running_loop()
        submitted = self._pool.submit(self._paced, check, *args)
        slot.handed = True

        def done(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing left to count
                loop.call_soon_threadsafe(self._give_back)

        submitted.add_done_callback(done)
        return await asyncio.wrap_future(submitted)

    def warm(self, make: Callable[[], object]) -> None:
        """Run ``make`` (the dummy hash) on a hashing thread now, not at the first sign-in."""
        self._pool.submit(make)

    def close(self) -> None:
        """Stop the threads (waiting for the checks under way)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


class SigninMetrics:
    """The sign-in's counters, on ``/metrics`` with the request metrics. No label says whether
    a name is an account's: a guesser reading ``/metrics`` learns nothing from them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.password_checks = Counter(
            "outbox_console_password_checks_total",
            "Console passwords checked with argon2id (a known name's hash or, for an unknown "
            "name, a dummy one: the same cost).",
            registry=registry,
        )
        self.refused = Counter(
            "outbox_console_signins_refused_total",
            "Console sign-ins refused before any password check, by why: throttled (too many "
            "failures for the name or the address) or busy (the password checks are full).",
            ["reason"],
            registry=registry,
        )


@dataclass(frozen=True, slots=True)
class Signins:
    """The sign-in's throttle, password checks, engine and counters (``app.state``)."""

    throttle: Throttle
    checks: PasswordChecks
    engine: AsyncEngine
    metrics: SigninMetrics

    async def close(self) -> None:
        """Stop the hashing threads and close the pool (the app's shutdown)."""
        self.checks.close()
        await self.engine.dispose()
