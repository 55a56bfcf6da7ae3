"""Request counts by outcome, for the reference service's ``GET /_stats`` and benchmarks."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from outbox.dev.service.faults import FAULT_MODES


class Stats:
    """Request counts by outcome, for ``GET /_stats`` and benchmarks."""

    _REJECTED = ("missing_key", "bad_body", "key_reused", "unknown_release")
    _LOOKUPS = ("found", "missing", "disabled")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str) -> None:
        """Count one ``name`` (``created``, ``rolled_back``, ``rejected.bad_body``, ...)."""
        with self._lock:
            self._counts[name] += 1

    def clear(self) -> None:
        """Start counting from zero."""
        with self._lock:
            self._counts.clear()

    def snapshot(self) -> dict[str, Any]:
        """Every count, zeros included."""
        with self._lock:
            counts = self._counts.copy()
        return {
            "requests": counts["requests"],
            "created": counts["created"],
            "rolled_back": counts["rolled_back"],
            "deduplicated": counts["deduplicated"],
            "rejected": {name: counts[f"rejected.{name}"] for name in self._REJECTED},
            "faulted": {mode: counts[f"faulted.{mode}"] for mode in FAULT_MODES},
            "lookups": {name: counts[f"lookups.{name}"] for name in self._LOOKUPS},
        }
