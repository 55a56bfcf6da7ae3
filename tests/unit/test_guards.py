"""The guards' declarations and arithmetic (breaker transitions, GCRA), without a database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.errors import ConfigError
from outbox.guards import (
    CLOSED_ROW,
    Breaker,
    BreakerState,
    Concurrency,
    GuardKey,
    Rate,
    Verdict,
    gcra,
    next_breaker,
)
from outbox.tools import ToolRegistry, tool
from outbox.tools.http import load_http_tools
from tests.tool_configs import http_tool_toml

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_toml_sub_tables_become_contract_fields(tmp_path: Path) -> None:
    """The breaker, rate and concurrency sub-tables of a tool fill its contract, with defaults."""
    config = tmp_path / "tools.toml"
    config.write_text(
        http_tool_toml("http://127.0.0.1:9")
        + '[tools."deploy.create_release".breaker]\nfailures = 2\n'
        + '[tools."deploy.create_release".rate]\nper_second = 10\nburst = 10\nper = "tool"\n'
        + '[tools."deploy.create_release".concurrency]\nmax_in_flight = 2\n',
        encoding="utf-8",
    )
    (loaded,) = load_http_tools(config)
    contract = loaded.contract
    assert contract.breaker == Breaker(failures=2)
    assert contract.rate == Rate(per_second=10, burst=10, per="tool")
    assert contract.concurrency == Concurrency(max_in_flight=2)
    assert contract.guarded


def test_no_sub_table_means_no_guard(tmp_path: Path) -> None:
    """A tool without any guard sub-table has no guard at all."""
    config = tmp_path / "tools.toml"
    config.write_text(http_tool_toml("http://127.0.0.1:9"), encoding="utf-8")
    (loaded,) = load_http_tools(config)
    assert not loaded.contract.guarded


@pytest.mark.parametrize(
    ("guards", "field"),
    [
        ({"breaker": Breaker(failures=0)}, "breaker.failures"),
        ({"breaker": Breaker(ratio=1.5)}, "breaker.ratio"),
        ({"breaker": Breaker(per="host")}, "breaker.per"),
        ({"rate": Rate(per_second=0)}, "rate.per_second"),
        ({"rate": Rate(per_second=1, burst=0)}, "rate.burst"),
        ({"concurrency": Concurrency(max_in_flight=0)}, "concurrency.max_in_flight"),
    ],
)
def test_bad_guard_names_tool_and_field(guards: dict[str, object], field: str) -> None:
    """A contradictory guard is refused when the contract is built, naming tool and field."""
    with pytest.raises(ConfigError, match=rf"tool 'a\.b': {field}"):
        tool("a.b", registry=ToolRegistry(), **guards)  # type: ignore[arg-type]


def test_guard_key_round_trips() -> None:
    """A key is `tool` or `tool:target`, and a target may itself contain a colon."""
    assert str(GuardKey.of("t.x", "a:b", "target")) == "t.x:a:b"
    assert GuardKey.parse("t.x:a:b") == GuardKey("t.x", "a:b")
    assert GuardKey.of("t.x", "a", "tool") == GuardKey.parse("t.x")


def test_breaker_opens_after_consecutive_failures_and_a_success_resets_the_run() -> None:
    """Failures open it only when consecutive; a success in between starts the count again."""
    breaker = Breaker(failures=3, open_s=10)
    row = CLOSED_ROW
    for verdict in (Verdict.FAILURE, Verdict.FAILURE, Verdict.SUCCESS, Verdict.FAILURE):
        row = next_breaker(row, breaker, verdict, now=T0, operation_id="x")
    assert row.state is BreakerState.CLOSED
    for _ in range(2):
        row = next_breaker(row, breaker, Verdict.FAILURE, now=T0, operation_id="x")
    assert row.state is BreakerState.OPEN
    assert row.open_until == T0 + timedelta(seconds=10)


def test_probe_success_closes_probe_failure_reopens_others_do_not_decide() -> None:
    """Only the probe's own outcome closes or re-opens a half-open breaker."""
    breaker = Breaker(failures=1, open_s=10)
    half = CLOSED_ROW.__class__(BreakerState.HALF_OPEN, 1, T0, 1, 1, T0, "probe")
    late = next_breaker(half, breaker, Verdict.SUCCESS, now=T0, operation_id="older")
    assert late.state is BreakerState.HALF_OPEN
    assert late.probe_operation_id == "probe"
    assert next_breaker(half, breaker, Verdict.SUCCESS, now=T0, operation_id="probe").state is (
        BreakerState.CLOSED
    )
    again = next_breaker(half, breaker, Verdict.FAILURE, now=T0, operation_id="probe")
    assert again.state is BreakerState.OPEN


def test_ratio_opens_only_past_min_calls() -> None:
    """The failure ratio opens the breaker once min_calls calls are in the window."""
    breaker = Breaker(failures=100, ratio=0.5, min_calls=4, window_s=60)
    row = CLOSED_ROW
    for verdict in (Verdict.FAILURE, Verdict.SUCCESS, Verdict.FAILURE):
        row = next_breaker(row, breaker, verdict, now=T0, operation_id="x")
    assert row.state is BreakerState.CLOSED
    row = next_breaker(row, breaker, Verdict.SUCCESS, now=T0, operation_id="x")
    assert row.state is BreakerState.CLOSED  # 2 of 4: the last was a success
    row = next_breaker(row, breaker, Verdict.FAILURE, now=T0, operation_id="x")
    assert row.state is BreakerState.OPEN


@given(
    per_second=st.floats(min_value=0.5, max_value=200),
    burst=st.integers(min_value=1, max_value=20),
    gaps=st.lists(st.floats(min_value=0, max_value=0.5), min_size=1, max_size=200),
)
def test_gcra_never_allows_more_than_rate_times_window_plus_burst(
    per_second: float, burst: int, gaps: list[float]
) -> None:
    """In any window of w seconds the GCRA allows at most burst + w * rate sends."""
    rate = Rate(per_second=per_second, burst=burst)
    tat, now, allowed = None, T0, []
    for gap in gaps:
        now += timedelta(seconds=gap)
        verdict = gcra(tat, rate, now)
        tat = verdict.tat
        if verdict.allowed:
            allowed.append(now)
        else:
            assert verdict.next_at > now
            assert gcra(tat, rate, verdict.next_at).allowed
    for i, start in enumerate(allowed):
        for j in range(i, len(allowed)):
            window = (allowed[j] - start).total_seconds()
            assert j - i + 1 <= burst + window * per_second + 1e-6
