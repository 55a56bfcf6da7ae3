"""Makes ``time.sleep`` work in a test process whose wall clock libfaketime moves.

``tests/clocks.py`` starts processes with libfaketime preloaded and
``FAKETIME_DONT_FAKE_MONOTONIC=1``: only the wall clock moves, so the monotonic waits of
threads, sockets and pools keep working. libfaketime 0.9.10 (Debian 12) then breaks one call:
Python 3.11's ``time.sleep`` is ``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)``, which
it rewrites into a negative time, so every sleep raises EINVAL (wolfcw/libfaketime#426).
``select`` with no descriptors sleeps on a relative timeout that libfaketime leaves alone.
"""

from __future__ import annotations

import os
import select
import time
from typing import SupportsIndex

if "libfaketime" in os.environ.get("LD_PRELOAD", ""):

    def _sleep(secs: float | SupportsIndex) -> None:
        seconds = float(secs)
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        select.select([], [], [], seconds)

    time.sleep = _sleep
