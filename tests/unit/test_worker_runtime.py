"""The worker process's interpreter settings, applied when Celery starts a worker."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
from celery.signals import worker_init

from outbox.workers import runtime


@pytest.fixture
def switch_interval() -> Iterator[None]:
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(saved)


@pytest.mark.usefixtures("switch_interval")
def test_a_starting_worker_hands_the_interpreter_lock_over_sooner() -> None:
    """Celery's worker_init (sent once the task modules are imported) shortens the switch
    interval, so a thread woken by a message does not wait 5 ms for a busy sibling."""
    worker_init.send(sender=None)
    assert sys.getswitchinterval() == pytest.approx(runtime.SWITCH_INTERVAL_S)
    assert runtime.SWITCH_INTERVAL_S < 0.005
