"""Processes whose wall clock is moved, with libfaketime (Debian's ``faketime`` package).

libfaketime is preloaded into the process and answers every wall-clock read (``time.time``,
``datetime.now``, libc's ``clock_gettime(CLOCK_REALTIME)``) with the real time plus an
offset, so Celery, kombu and our own code all see the moved clock, exactly as on a host
whose clock is wrong. ``FAKETIME_DONT_FAKE_MONOTONIC=1`` leaves the monotonic clock alone:
faked, it made every timed wait of a thread (``threading.Event.wait``) block for decades,
since glibc's ``sem_clockwait`` reaches the kernel without libfaketime. The one call that
breaks then, ``time.sleep``, is mended by ``tests/clock_shim/sitecustomize.py``.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

#: Where distributions install the preloadable library (Debian: /usr/lib/<triplet>/faketime).
_LIBRARY_PATTERNS = (
    "/usr/lib/*/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
    "/usr/local/lib/faketime/libfaketime.so.1",
)
#: A directory holding the ``sitecustomize`` that mends ``time.sleep`` under libfaketime.
_SHIM = Path(__file__).resolve().parent / "clock_shim"


def libfaketime() -> Path:
    """The preloadable libfaketime; fails the test under ``CI=true`` if it is missing, else
    skips it (``apt-get install faketime``)."""
    for pattern in _LIBRARY_PATTERNS:
        found = sorted(glob.glob(pattern))
        if found:
            return Path(found[0])
    if os.environ.get("CI") == "true":
        pytest.fail("libfaketime is not installed (apt-get install faketime), and CI requires it")
    pytest.skip("libfaketime is not installed (apt-get install faketime)")


def moved_clock(offset_s: int, library: Path) -> dict[str, str]:
    """Environment variables that move a process's wall clock by ``offset_s`` seconds."""
    python_path = [str(_SHIM)]
    if os.environ.get("PYTHONPATH"):
        python_path.append(os.environ["PYTHONPATH"])
    return {
        "LD_PRELOAD": str(library),
        "FAKETIME": f"{offset_s:+d}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": os.pathsep.join(python_path),
    }


def movable_clock(offset_file: Path, offset_s: int, library: Path) -> dict[str, str]:
    """Like :func:`moved_clock`, but the offset is read from ``offset_file`` at every clock
    read, so the test can step the clock of the running process (:func:`step_clock`)."""
    step_clock(offset_file, offset_s)
    env = moved_clock(offset_s, library)
    del env["FAKETIME"]  # libfaketime prefers it to the file
    return env | {"FAKETIME_TIMESTAMP_FILE": str(offset_file), "FAKETIME_NO_CACHE": "1"}


def step_clock(offset_file: Path, offset_s: int) -> None:
    """Set the offset of the processes started with :func:`movable_clock` on ``offset_file``."""
    offset_file.write_text(f"{offset_s:+d}s", encoding="utf-8")


def measured_offset(env: Mapping[str, str]) -> float:
    """How far ahead of this process's clock a Python process started with ``env`` reads
    the time (negative: behind), after checking that it can still sleep."""
    probe = "import time; time.sleep(0.05); print(time.time())"
    before = time.time()
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    after = time.time()
    return float(done.stdout) - (before + after) / 2
