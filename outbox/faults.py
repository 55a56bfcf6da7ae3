"""Named fault points at the commit boundaries, for crash tests and the chaos harness.

Production code calls :func:`point` right after each commit that matters
(``faults.point("after_sent_commit")``). Disarmed, a point costs one dictionary lookup on an
empty dict. A test arms a point to raise, hang or end the process on the spot
(``os._exit``, like a SIGKILL: no ``finally``, no atexit, connections dropped by the kernel).

Points are armed in-process with :func:`arm` / :func:`armed`, or for a whole process tree
through ``OUTBOX_FAULTS="after_sent_commit=exit,before_call=raise"`` (read at import), with
an optional ``@N`` to fire on the N-th pass only (``after_sent_commit=exit@3``).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from outbox.logs import Action

log = logging.getLogger(__name__)

ENV_VARIABLE = "OUTBOX_FAULTS"
#: The exit status of a process ended by a fault point (distinct from crashes and signals).
EXIT_STATUS = 86

#: Every fault point in the code base, with where it sits; arming an unknown name fails.
POINTS: dict[str, str] = {
    "relay_before_publish": (
        "relay: rows claimed (locked, published_at stamped, not committed), nothing published"
    ),
    "relay_after_publish": "relay: messages published and confirmed, published_at not committed",
    "relay_after_commit": "relay: published_at committed",
    "direct_after_take": (
        "worker (database broker): a due operation taken directly, published_at committed, "
        "its message not delivered"
    ),
    "lock_granted": "locks: an advisory lock granted, its lock step (durability, commit) not done",
    "after_lock": "dispatch: advisory lock taken, nothing written",
    "after_sent_commit": "dispatch: `sent` committed, nothing sent to the remote",
    "after_call": "dispatch: the remote answered, the outcome not committed",
    "after_outcome_commit": "dispatch: outcome committed, lock not released",
    "sweep_after_move": "sweep: `sent` -> `unknown`/`needs_human` committed, lock not released",
    "lookup_after_call": "lookup: the remote answered, the outcome not committed",
    "lookup_after_commit": "lookup: outcome committed, lock not released",
    "webhook_after_claim": "webhooks: deliveries leased (committed), nothing POSTed yet",
    "webhook_after_send": "webhooks: a delivery POSTed and answered, the outcome not recorded",
}


class FaultAction(enum.StrEnum):
    """What an armed point does."""

    RAISE = "raise"
    HANG = "hang"
    EXIT = "exit"


class InjectedFault(Exception):
    """Raised by a fault point armed with ``raise``."""

    def __init__(self, name: str) -> None:
        super().__init__(f"fault injected at {name}")
        self.point = name


@dataclass
class _Arming:
    action: FaultAction
    #: Fire on this pass only (1-based); ``None`` fires on every pass.
    on_pass: int | None = None
    passes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fires(self) -> bool:
        with self.lock:
            self.passes += 1
            return self.on_pass is None or self.passes == self.on_pass


_armed: dict[str, _Arming] = {}


def point(name: str) -> None:
    """A commit boundary named ``name``: a no-op unless a test armed it."""
    if not _armed:
        return
    arming = _armed.get(name)
    if arming is None or not arming.fires():
        return
    if arming.action is FaultAction.RAISE:
        raise InjectedFault(name)
    if arming.action is FaultAction.EXIT:
        os._exit(EXIT_STATUS)
    # Said once, so a test can tell the process is stuck exactly here before it kills it.
    log.warning("fault point %s: hanging", name, extra={"action": Action.FAULT_HANG, "point": name})
    while True:  # HANG: a process that is alive but never gets further
        time.sleep(3600)


def arm(name: str, action: FaultAction | str, *, on_pass: int | None = None) -> None:
    """Make point ``name`` raise, hang or exit (on every pass, or only the ``on_pass``-th)."""
    if name not in POINTS:
        raise ValueError(f"unknown fault point {name!r}; known: {', '.join(sorted(POINTS))}")
    _armed[name] = _Arming(FaultAction(action), on_pass)


def disarm(name: str | None = None) -> None:
    """Disarm one point, or every point when ``name`` is ``None``."""
    if name is None:
        _armed.clear()
    else:
        _armed.pop(name, None)


@contextmanager
def armed(name: str, action: FaultAction | str, *, on_pass: int | None = None) -> Iterator[None]:
    """Arm ``name`` for the duration of a ``with`` block."""
    arm(name, action, on_pass=on_pass)
    try:
        yield
    finally:
        disarm(name)


def arm_from_environment(value: str | None = None) -> None:
    """Arm the points listed in ``OUTBOX_FAULTS`` (``name=action[@pass],…``)."""
    spec = os.environ.get(ENV_VARIABLE, "") if value is None else value
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, rest = item.partition("=")
        action, _, on_pass = rest.partition("@")
        try:
            arm(name.strip(), action.strip(), on_pass=int(on_pass) if on_pass else None)
        except ValueError as exc:
            raise ValueError(f"{ENV_VARIABLE}: {item!r}: {exc}") from exc


arm_from_environment()
