"""Settings from ``OUTBOX_*`` variables: valid defaults, clear errors naming the variable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from celery import Celery

from outbox.cli.output import environment_help
from outbox.config import (
    OTHER_VARIABLES,
    WEBHOOK_EVENT_NAMES,
    Settings,
    load_settings,
    unknown_variables,
    variable,
)
from outbox.errors import ConfigError
from outbox.reconcilers.sweep import SweepConfig
from outbox.workers.app import (
    DISPATCH_TASK,
    ESCALATE_TASK,
    LOOKUP_TASK,
    QUEUES,
    SWEEP_TASK,
    celery_settings,
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no ``OUTBOX_*`` variable set (the developer's shell may set some)."""
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)


def test_defaults_are_valid_with_no_variable() -> None:
    """With nothing configured the settings load, with the documented defaults."""
    settings = load_settings()
    assert settings.database_url is None
    assert settings.broker_url is None
    assert settings.home == Path(".outbox")
    assert settings.tools == []
    assert settings.sent_timeout == 60.0
    assert settings.sent_max_age == 3600.0
    assert settings.sent_max_age >= settings.sent_timeout
    assert settings.lookup_lease == 60.0
    assert settings.webhook_url is None
    assert settings.webhook_events == [
        "needs_human",
        "resolved",
        "approval_requested",
        "approval_expired",
        "circuit_opened",
        "circuit_closed",
        "budget_exhausted",
        "saga_compensated",
        "saga_needs_human",
    ]
    assert settings.max_payload_bytes == 256 * 1024


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("OUTBOX_SENT_TIMEOUT", "abc"),
        ("OUTBOX_SENT_TIMEOUT", "-1"),
        ("OUTBOX_SENT_TIMEOUT", "0"),
        ("OUTBOX_SENT_MAX_AGE", "-5"),
        ("OUTBOX_SWEEP_INTERVAL", "soon"),
        ("OUTBOX_REPUBLISH_AFTER", "0"),
        ("OUTBOX_LOOKUP_LEASE", "soon"),
        ("OUTBOX_MAX_PAYLOAD_BYTES", "0"),
        ("OUTBOX_MAX_PAYLOAD_BYTES", "1.5"),
        ("OUTBOX_WEBHOOK_URL", "ftp://x"),
        ("OUTBOX_WEBHOOK_URL", "not a url"),
        ("OUTBOX_WEBHOOK_EVENTS", "bogus"),
        ("OUTBOX_WEBHOOK_EVENTS", "needs_human,bogus"),
    ],
)
def test_invalid_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """An invalid value raises ConfigError whose message names the offending variable."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=f"{variable}:"):
        load_settings()


@pytest.mark.parametrize("value", ["0", "-1", "-0.5"])
def test_lookup_lease_must_be_positive(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """OUTBOX_LOOKUP_LEASE of zero or less is refused, naming the variable and the bound."""
    monkeypatch.setenv("OUTBOX_LOOKUP_LEASE", value)
    with pytest.raises(ConfigError, match="OUTBOX_LOOKUP_LEASE: Input should be greater than 0"):
        load_settings()


def test_lookup_lease_reaches_the_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    """OUTBOX_LOOKUP_LEASE (seconds, fractions allowed) is the sweep's lookup lease."""
    monkeypatch.setenv("OUTBOX_LOOKUP_LEASE", "12.5")
    config = SweepConfig.from_settings(load_settings())
    assert config.lookup_lease_s == 12.5
    assert SweepConfig.from_settings(load_settings(lookup_lease=90)).lookup_lease_s == 90.0


def test_the_sweep_defaults_to_the_settings_defaults() -> None:
    """With nothing configured the sweep's config is SweepConfig's own defaults."""
    assert SweepConfig.from_settings(load_settings()) == SweepConfig()


def test_a_short_console_secret_is_refused_without_echoing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OUTBOX_CONSOLE_SECRET under 32 characters is refused, naming the variable, not the value."""
    monkeypatch.setenv("OUTBOX_CONSOLE_SECRET", "short-key-1")
    with pytest.raises(ConfigError, match=r"OUTBOX_CONSOLE_SECRET: .*32 characters") as caught:
        load_settings()
    assert "short-key-1" not in str(caught.value)


def test_unknown_webhook_event_is_named() -> None:
    """An unknown webhook event is named, with the events that may be chosen."""
    with pytest.raises(ConfigError, match="bogus") as caught:
        load_settings(webhook_events="needs_human,bogus")
    assert all(name in str(caught.value) for name in WEBHOOK_EVENT_NAMES)


def test_sent_max_age_below_sent_timeout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """OUTBOX_SENT_MAX_AGE smaller than OUTBOX_SENT_TIMEOUT is refused, naming both variables."""
    monkeypatch.setenv("OUTBOX_SENT_TIMEOUT", "100")
    monkeypatch.setenv("OUTBOX_SENT_MAX_AGE", "50")
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert "OUTBOX_SENT_MAX_AGE" in str(caught.value)
    assert "OUTBOX_SENT_TIMEOUT" in str(caught.value)


def test_sent_max_age_below_the_default_timeout_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lowering only OUTBOX_SENT_MAX_AGE below the default sent timeout is refused too."""
    monkeypatch.setenv("OUTBOX_SENT_MAX_AGE", "30")
    with pytest.raises(ConfigError, match="OUTBOX_SENT_MAX_AGE"):
        load_settings()


def test_sent_max_age_equal_to_sent_timeout_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """OUTBOX_SENT_MAX_AGE equal to OUTBOX_SENT_TIMEOUT is the smallest accepted value."""
    monkeypatch.setenv("OUTBOX_SENT_TIMEOUT", "90")
    monkeypatch.setenv("OUTBOX_SENT_MAX_AGE", "90")
    settings = load_settings()
    assert settings.sent_timeout == settings.sent_max_age == 90.0


def test_every_problem_is_reported_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several invalid variables are all named in one ConfigError."""
    monkeypatch.setenv("OUTBOX_SENT_TIMEOUT", "abc")
    monkeypatch.setenv("OUTBOX_WEBHOOK_URL", "ftp://x")
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert "OUTBOX_SENT_TIMEOUT" in str(caught.value)
    assert "OUTBOX_WEBHOOK_URL" in str(caught.value)


def test_tools_are_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    """OUTBOX_TOOLS is split on commas, blanks trimmed and empty items dropped."""
    monkeypatch.setenv("OUTBOX_TOOLS", " myapp.tools , other.mod,,third ")
    assert load_settings().tools == ["myapp.tools", "other.mod", "third"]


def test_single_tool_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """A single module name in OUTBOX_TOOLS is a one-item list."""
    monkeypatch.setenv("OUTBOX_TOOLS", "myapp.tools")
    assert load_settings().tools == ["myapp.tools"]


def test_webhook_events_are_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    """OUTBOX_WEBHOOK_EVENTS is a comma-separated list of known events."""
    monkeypatch.setenv("OUTBOX_WEBHOOK_EVENTS", "confirmed, failed")
    assert load_settings().webhook_events == ["confirmed", "failed"]


def test_valid_values_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Valid variables are read and converted to their types."""
    monkeypatch.setenv("OUTBOX_SENT_TIMEOUT", "2.5")
    monkeypatch.setenv("OUTBOX_SENT_MAX_AGE", "120")
    monkeypatch.setenv("OUTBOX_WEBHOOK_URL", "https://hooks.example.com/outbox")
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://u:secret@db/outbox")
    settings = load_settings()
    assert settings.sent_timeout == 2.5
    assert settings.sent_max_age == 120.0
    assert str(settings.webhook_url) == "https://hooks.example.com/outbox"
    assert settings.database_url is not None
    assert settings.database_url.get_secret_value() == "postgresql://u:secret@db/outbox"


def test_database_url_is_not_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The database URL is a secret: its password does not appear in the settings' repr."""
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://u:hunter2@db/outbox")
    assert "hunter2" not in repr(load_settings())


def test_settings_are_frozen() -> None:
    """Loaded settings cannot be changed by assignment."""
    settings = load_settings()
    with pytest.raises(ValueError, match="frozen"):
        settings.sent_timeout = 5.0


def test_a_batch_is_grouped_in_order_into_bounded_messages() -> None:
    """group_messages keeps the order, caps a message at ops_per_message, spreads a batch
    over at least `spread` messages, and makes sizes that differ by one at most."""
    import uuid  # noqa: PLC0415

    from outbox.relay import OutboundMessage  # noqa: PLC0415
    from outbox.workers.publish import group_messages  # noqa: PLC0415

    batch = [OutboundMessage(uuid.uuid4(), "t", str(i)) for i in range(200)]
    groups = group_messages(batch, 8, 16)
    assert [m for g in groups for m in g] == batch
    assert {len(g) for g in groups} == {8}
    assert [len(g) for g in group_messages(batch[:20], 8, 16)] == [2] * 4 + [1] * 12
    assert [len(g) for g in group_messages(batch[:5], 8, 16)] == [1] * 5
    assert [len(g) for g in group_messages(batch[:17], 8, 1)] == [6, 6, 5]
    assert group_messages([], 8, 16) == []


def test_task_events_are_on_by_default_and_can_be_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Flower's task events are sent on RabbitMQ unless OUTBOX_TASK_EVENTS turns them off,
    for the workers (received, started, succeeded) and the relay (sent) alike."""
    # A database URL of its own: with none, the database broker's URL would be looked up
    # from an embedded server this unit test must not need.
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://u@db/outbox")
    monkeypatch.setenv("OUTBOX_BROKER_URL", "amqp://guest:guest@mq:5672//")
    on = celery_settings(load_settings(), deployment="unit")
    assert on["worker_send_task_events"] is True
    assert on["task_send_sent_event"] is True
    monkeypatch.setenv("OUTBOX_TASK_EVENTS", "false")
    off = celery_settings(load_settings(), deployment="unit")
    assert off["worker_send_task_events"] is False
    assert off["task_send_sent_event"] is False


@pytest.mark.parametrize("broker", [None, "outboxdb+postgresql+psycopg://u@db/outbox"])
def test_no_task_events_on_the_database_broker(
    monkeypatch: pytest.MonkeyPatch, broker: str | None
) -> None:
    """The database broker carries no events to another process (kombu's exchanges live in
    each process's memory): none are sent, whatever OUTBOX_TASK_EVENTS says."""
    monkeypatch.setenv("OUTBOX_DATABASE_URL", "postgresql://u@db/outbox")
    if broker is None:
        monkeypatch.delenv("OUTBOX_BROKER_URL", raising=False)
    else:
        monkeypatch.setenv("OUTBOX_BROKER_URL", broker)
    monkeypatch.setenv("OUTBOX_TASK_EVENTS", "true")
    conf = celery_settings(load_settings(), deployment="unit")
    assert conf["worker_send_task_events"] is False
    assert conf["task_send_sent_event"] is False


def test_task_events_value_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value that is not a boolean is refused, naming the variable."""
    monkeypatch.setenv("OUTBOX_TASK_EVENTS", "sometimes")
    with pytest.raises(ConfigError, match="OUTBOX_TASK_EVENTS"):
        load_settings()


def test_deployment_name_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """OUTBOX_DEPLOYMENT takes a broker-safe name and refuses anything else, naming it."""
    monkeypatch.setenv("OUTBOX_DEPLOYMENT", "prod-eu.1")
    assert load_settings().deployment == "prod-eu.1"
    for bad in ("two words", "-leading", "a" * 64, "", "x/y"):
        monkeypatch.setenv("OUTBOX_DEPLOYMENT", bad)
        with pytest.raises(ConfigError, match="OUTBOX_DEPLOYMENT"):
            load_settings()


def test_every_queue_and_exchange_is_the_deployments_own() -> None:
    """Tasks route, and ``-Q`` selects, by kind to ``outbox.<deployment>.<kind>``; remote
    control and events use exchanges of the deployment's own."""
    settings = load_settings(broker_url="amqp://guest:guest@127.0.0.1:5672//")
    app = Celery("unit")
    app.conf.update(celery_settings(settings, deployment="east"))
    routes = {
        DISPATCH_TASK: "dispatch",
        LOOKUP_TASK: "lookup",
        SWEEP_TASK: "reconcile",
        ESCALATE_TASK: "human",
    }
    for task, kind in routes.items():
        assert app.amqp.router.route({}, task)["queue"].name == f"outbox.east.{kind}"
        assert app.amqp.router.route({"queue": kind}, task)["queue"].name == f"outbox.east.{kind}"
    assert sorted(app.amqp.queues) == sorted(f"outbox.east.{kind}" for kind in QUEUES)
    app.amqp.queues.select(["dispatch", "lookup"])
    assert sorted(app.amqp.queues.consume_from) == ["outbox.east.dispatch", "outbox.east.lookup"]
    assert app.conf.control_exchange == "outbox.east"
    assert app.conf.event_exchange == "outbox.east.celeryev"
    west = celery_settings(settings, deployment="west")
    assert not {q.name for q in west["task_queues"]} & set(app.amqp.queues)


def test_a_misspelt_variable_is_named_with_the_closest_known_one() -> None:
    """OUTBOX_DATABSE_URL is not silently ignored: the warning names it and the right one."""
    assert unknown_variables({"OUTBOX_DATABSE_URL": "postgresql://x"}) == [
        "unknown variable OUTBOX_DATABSE_URL is ignored; did you mean OUTBOX_DATABASE_URL?"
    ]
    assert unknown_variables({"OUTBOX_SWEEP_INTERVALL": "5"}) == [
        "unknown variable OUTBOX_SWEEP_INTERVALL is ignored; did you mean OUTBOX_SWEEP_INTERVAL?"
    ]


def test_a_variable_close_to_nothing_is_named_alone() -> None:
    """No suggestion when nothing is close (the shared OUTBOX_ prefix does not count)."""
    assert unknown_variables({"OUTBOX_FOO": "1"}) == ["unknown variable OUTBOX_FOO is ignored"]


def test_known_and_foreign_variables_are_not_warned_about() -> None:
    """Every setting (in any case), the variables read elsewhere, and non-outbox names pass."""
    environ = {variable(name): "x" for name in Settings.model_fields}
    environ |= dict.fromkeys(OTHER_VARIABLES, "x")
    environ |= {"outbox_home": "home", "PATH": "/bin", "NOT_OUTBOX_X": "1"}
    assert unknown_variables(environ) == []


def test_the_help_lists_every_setting_with_its_default() -> None:
    """Generated from the model: each variable, its default as written in the environment."""
    epilog = environment_help()
    for name in Settings.model_fields:
        assert f"`{variable(name)}` (default: " in epilog
    for shown in (
        "`OUTBOX_SENT_TIMEOUT` (default: 60)",
        "`OUTBOX_HOME` (default: .outbox)",
        "`OUTBOX_TASK_EVENTS` (default: true)",
        "`OUTBOX_LOG_FORMAT` (default: logfmt)",
        "`OUTBOX_WEBHOOK_EVENTS` (default: needs_human,resolved,approval_requested,"
        "approval_expired,circuit_opened,circuit_closed,budget_exhausted,saga_compensated,"
        "saga_needs_human)",
        "`OUTBOX_FLOWER_BASIC_AUTH` (default: unset)",
        "`OUTBOX_TOOLS` (default: none)",
    ):
        assert shown in epilog
