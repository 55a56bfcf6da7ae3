"""Which fault, if any, each create request of the reference service gets.

Faults apply to ``POST .../releases`` and ``POST .../rollbacks`` (lookups and the rest never
fault):

* ``commit_then_timeout``: commit, then wait ``delay_s`` before answering, so the caller's
  timeout fires first; ``commit_then_reset``: commit, then reset the connection (SO_LINGER 0)
  without an answer; ``error_503`` and ``reject_422``: answer so and commit nothing; ``slow``:
  wait ``delay_s``, then behave normally. With a dedup window, "commit" means "decide as a
  normal request would": a repeated key is deduplicated, not committed again.
* The first source that names a fault wins: the request's ``X-Fault`` header, the payload's
  ``"_fault"`` field (so a replay of that payload faults again), the key's armed fault
  (``POST /_faults/keys/{key}`` ``{"mode": ..., "times": N}``: the next N requests with that key
  that no header or payload already faulted), then the rates (``POST /_faults``
  ``{"rates": {mode: probability}, "seed": 42, "delay_s": 5}``). Every create request draws one
  number from the seeded generator while rates are set, so one seed and one sequence of
  requests give one sequence of faults. ``DELETE /_faults`` removes every fault and restores the
  start-up delay.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from outbox.dev.service.errors import DeployServiceError

FaultMode = Literal["commit_then_timeout", "commit_then_reset", "error_503", "reject_422", "slow"]

#: Every fault mode, in the order the rates are laid out on [0, 1) when one is drawn.
FAULT_MODES: tuple[FaultMode, ...] = (
    "commit_then_timeout",
    "commit_then_reset",
    "error_503",
    "reject_422",
    "slow",
)
_MODE_BY_NAME: dict[str, FaultMode] = {mode: mode for mode in FAULT_MODES}


def fault_mode(value: object, source: str) -> FaultMode:
    """``value`` as a fault mode, or :class:`DeployServiceError` naming ``source``."""
    mode = _MODE_BY_NAME.get(value) if isinstance(value, str) else None
    if mode is None:
        raise DeployServiceError(
            f"{source}: unknown fault mode {value!r} (one of: {', '.join(FAULT_MODES)})"
        )
    return mode


def check_rates(rates: Mapping[str, object]) -> dict[str, float]:
    """Validated fault rates: known modes, each in 0..1, adding up to at most 1."""
    checked: dict[str, float] = {}
    for name, rate in rates.items():
        mode = fault_mode(name, "fault rate")
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
            raise DeployServiceError(f"fault rate of {name}: {rate!r} is not a number in 0..1")
        checked[mode] = float(rate)
    total = sum(checked.values())
    if total > 1 + 1e-9:
        raise DeployServiceError(f"fault rates add up to {total:g}, more than 1")
    return checked


def parse_fault_rates(items: Iterable[str]) -> dict[str, float]:
    """Parse ``MODE=RATE`` strings (the command line's ``--fault-rate``) into checked rates."""
    rates: dict[str, object] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise DeployServiceError(f"--fault-rate {item!r}: expected MODE=RATE")
        mode = fault_mode(name.strip(), f"--fault-rate {item!r}")
        if mode in rates:
            raise DeployServiceError(f"--fault-rate: {mode} given twice")
        try:
            rate = float(text)
        except ValueError:
            rate = math.nan
        if not 0 <= rate <= 1:
            raise DeployServiceError(f"--fault-rate {item!r}: the rate must be a number in 0..1")
        rates[mode] = rate
    return check_rates(rates)


def _check_delay(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise DeployServiceError(f"{name} must be a number of seconds >= 0, got {value!r}")
    if not math.isfinite(value):
        raise DeployServiceError(f"{name} must be finite, got {value!r}")
    return float(value)


class Faults:
    """Which fault, if any, each create request gets: per request, per key, or by rate."""

    def __init__(self, rates: Mapping[str, object], seed: int | None, delay_s: float) -> None:
        self._lock = threading.Lock()
        self._start_delay_s = _check_delay(delay_s, "fault delay")
        self._rates = check_rates(rates)
        self._seed = seed
        self._rng = random.Random(seed)  # noqa: S311 - reproducible fault draws, not secrets
        self._delay_s = self._start_delay_s
        self._by_key: dict[str, tuple[FaultMode, int]] = {}

    @property
    def delay_s(self) -> float:
        """How long ``commit_then_timeout`` and ``slow`` wait."""
        return self._delay_s

    def configure(
        self,
        *,
        rates: Mapping[str, object] | None = None,
        seed: int | None = None,
        delay_s: float | None = None,
        reseed: bool = True,
    ) -> None:
        """Replace the rates (if given) and the delay (if given); reseed with ``seed``."""
        checked = None if rates is None else check_rates(rates)
        delay = None if delay_s is None else _check_delay(delay_s, "delay_s")
        with self._lock:
            if checked is not None:
                self._rates = checked
            if delay is not None:
                self._delay_s = delay
            if reseed:
                self._seed = seed
                self._rng = random.Random(seed)  # noqa: S311 - see __init__

    def arm_key(self, key: str, mode: FaultMode, times: int = 1) -> None:
        """Fault the next ``times`` requests with ``key`` (those no header or payload faults)."""
        if times < 1:
            raise DeployServiceError(f"times must be at least 1, got {times}")
        with self._lock:
            self._by_key[key] = (mode, times)

    def clear(self) -> None:
        """No faults at all; the delay returns to its start-up value."""
        with self._lock:
            self._rates = {}
            self._by_key.clear()
            self._delay_s = self._start_delay_s

    def choose(self, key: str, requested: FaultMode | None) -> FaultMode | None:
        """The fault for one create request (``requested``: named by its header or payload)."""
        with self._lock:
            drawn = self._draw()
            if requested is not None:
                return requested
            armed = self._by_key.get(key)
            if armed is not None:
                mode, left = armed
                if left > 1:
                    self._by_key[key] = (mode, left - 1)
                else:
                    del self._by_key[key]
                return mode
            return drawn

    def snapshot(self) -> dict[str, Any]:
        """The current configuration, as ``GET /_faults`` answers it."""
        with self._lock:
            return {
                "rates": dict(self._rates),
                "seed": self._seed,
                "delay_s": self._delay_s,
                "keys": {
                    key: {"mode": mode, "times": left} for key, (mode, left) in self._by_key.items()
                },
            }

    def _draw(self) -> FaultMode | None:
        if not self._rates:
            return None
        point, edge = self._rng.random(), 0.0
        for mode in FAULT_MODES:
            edge += self._rates.get(mode, 0.0)
            if point < edge:
                return mode
        return None
