"""Which tracing the standard OTEL_* variables ask for (outbox.tracing.config_from), and that
nothing is traced, nor OpenTelemetry's SDK set up, unless they do."""

from __future__ import annotations

import pytest

from outbox.tracing import TracingConfig, config_from, setup


def test_nothing_set_means_no_tracing() -> None:
    """No OTEL_* variable: off, saying why."""
    config = config_from({})
    assert config.enabled is False
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" in config.reason


@pytest.mark.parametrize(
    "variable", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
)
def test_an_otlp_endpoint_turns_otlp_on(variable: str) -> None:
    """An OTLP endpoint (all signals' or traces') alone turns OTLP export on."""
    assert config_from({variable: "http://collector:4318"}) == TracingConfig(True, "otlp")


@pytest.mark.parametrize(("value", "exporter"), [("otlp", "otlp"), ("console", "console")])
def test_the_traces_exporter_names_the_exporter(value: str, exporter: str) -> None:
    """OTEL_TRACES_EXPORTER=otlp or console turns that exporter on, endpoint or not."""
    assert config_from({"OTEL_TRACES_EXPORTER": value}) == TracingConfig(True, exporter)


def test_the_first_exporter_of_a_list_is_used() -> None:
    """A list (otlp,console) uses its first member."""
    assert config_from({"OTEL_TRACES_EXPORTER": " Console , otlp"}).exporter == "console"


@pytest.mark.parametrize(
    "environ",
    [
        {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
        {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"},
        {"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"},
    ],
)
def test_none_or_a_disabled_sdk_wins(environ: dict[str, str]) -> None:
    """OTEL_TRACES_EXPORTER=none and OTEL_SDK_DISABLED=true turn it off over an endpoint."""
    assert config_from(environ).enabled is False


def test_an_unknown_exporter_is_off_and_named() -> None:
    """An exporter this build does not ship (zipkin) is off, the reason naming it."""
    config = config_from({"OTEL_TRACES_EXPORTER": "zipkin"})
    assert config.enabled is False
    assert "zipkin" in config.reason


def test_forced_without_an_endpoint_is_otlp() -> None:
    """`outbox up --otel` (forced) with no variable: OTLP to the SDK's default endpoint."""
    assert config_from({}, forced=True) == TracingConfig(True, "otlp")
    assert config_from({"OTEL_TRACES_EXPORTER": "none"}, forced=True).enabled is False


def test_setup_does_nothing_when_not_asked() -> None:
    """setup() with no variable sets no SDK up and says so."""
    assert setup("outbox-test", environ={}) is False
