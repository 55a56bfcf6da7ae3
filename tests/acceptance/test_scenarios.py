"""The scripted run of issue 4: 300 intents, 20% ambiguous faults, three remote contracts."""

from __future__ import annotations

from pathlib import Path

import pytest

from outbox.dev.scenario import MODES, Mode, run_scenario
from tests.conftest import Databases

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", MODES)
def test_every_intent_is_decided_without_a_duplicate(
    mode: Mode, databases: Databases, rabbitmq_url: str, tmp_path: Path
) -> None:
    """300 intents with 20% ambiguous outcomes all end confirmed, failed or needs_human, with
    no second effect, humans only where nothing else can decide, and every escalation's
    webhook signed."""
    url = databases.create()
    report = run_scenario(
        url,
        mode=mode,
        i_own_this_database=url,  # the fixture made it for this test
        intents=300,
        ambiguous_rate=0.2,
        broker_url=rabbitmq_url,
        timeout_s=240,
        workdir=tmp_path,
    )
    print(report.render())  # noqa: T201 -- the figures for the log
    assert report.ok, report.render()
    assert report.duplicates == 0
    assert report.undecided == 0
    if mode == "neither":
        assert report.escalations > 0
        assert report.webhooks_valid >= report.escalations
    else:
        assert report.escalations == 0
