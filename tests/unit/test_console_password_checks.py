"""The console's bounded password checks (outbox.web.console.signins.PasswordChecks), on real
threads: the places they admit, and who gives a place back."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from outbox.web.console.signins import NICE, Busy, PasswordChecks


def test_beyond_threads_and_queue_a_sign_in_is_refused_at_once() -> None:
    """With 1 thread and a queue of 1, a third sign-in in progress is refused (Busy) and a
    place freed by an ended sign-in admits the next."""
    checks = PasswordChecks(threads=1, queue=1)
    try:
        with checks.admitted(), checks.admitted(), pytest.raises(Busy), checks.admitted():
            pass
        assert checks.taken == 0
        with checks.admitted():
            assert checks.taken == 1
        assert checks.taken == 0
    finally:
        checks.close()


def test_a_check_keeps_its_place_until_its_thread_ends_even_if_its_request_is_gone() -> None:
    """A sign-in whose request is cancelled while its password is being checked keeps its
    place until the check's thread ends: hung-up clients cannot pile up unbounded work."""
    checks = PasswordChecks(threads=1, queue=0)
    release = threading.Event()
    started = threading.Event()

    def slow_check() -> str:
        started.set()
        release.wait()
        return "checked"

    async def scenario() -> None:
        async def sign_in() -> str:
            with checks.admitted() as slot:
                return await checks.run(slot, slow_check)

        request = asyncio.ensure_future(sign_in())
        await asyncio.to_thread(started.wait)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        assert checks.taken == 1  # the thread still works for it
        with pytest.raises(Busy), checks.admitted():
            pass
        release.set()
        while checks.taken:  # the thread gives the place back through the loop
            await asyncio.sleep(0.01)
        with checks.admitted() as slot:
            assert await checks.run(slot, lambda: "next") == "next"

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        checks.close()


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="per-thread nice is Linux's")
def test_the_hashing_threads_run_at_a_lower_priority() -> None:
    """A check runs on a thread NICE steps nicer than the caller's."""
    checks = PasswordChecks(threads=1, queue=0)

    def own_nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    try:

        async def scenario() -> int:
            with checks.admitted() as slot:
                return await checks.run(slot, own_nice)

        assert asyncio.run(scenario()) == min(19, own_nice() + NICE)
    finally:
        checks.close()


def test_checks_start_at_most_rate_per_second() -> None:
    """Checks submitted together start no sooner than ``1/rate`` apart (the first at once),
    so a burst cannot spend more than ``rate`` argon2 checks a second of the host's CPU.

    Judged against the burst's own start: the k-th check to start does so no sooner than
    ``k/rate`` after it. (Gaps between recorded starts, judged one by one, failed on a loaded
    host: a check whose thread was descheduled before it ran records a late start, and the
    next, on time, a gap shorter than the schedule's.)"""
    checks = PasswordChecks(threads=2, queue=2, rate=20.0)
    starts: list[float] = []
    submitted = time.monotonic()

    async def burst() -> None:
        async def one() -> None:
            with checks.admitted() as slot:
                await checks.run(slot, lambda: starts.append(time.monotonic()))

        await asyncio.gather(*(one() for _ in range(4)))

    try:
        asyncio.run(burst())
    finally:
        checks.close()
    starts.sort()
    assert len(starts) == 4
    since = [start - submitted for start in starts]
    # The schedule is 0, 50, 100 and 150 ms from the first start, itself after `submitted`;
    # a late thread only starts later (2 ms: the monotonic clock's and sleep's floor).
    assert all(at >= k * 0.05 - 0.002 for k, at in enumerate(since)), since
