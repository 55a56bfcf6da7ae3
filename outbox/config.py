"""Settings, read from ``OUTBOX_*`` environment variables (pydantic-settings).

Nothing configured is a valid configuration: with ``OUTBOX_DATABASE_URL`` unset the outbox
starts (or reuses) an embedded PostgreSQL under ``OUTBOX_HOME``. An invalid value stops the
program at start-up with a message naming the variable (:func:`load_settings`).
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, HttpUrl, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from outbox.errors import ConfigError
from outbox.logs import Action, LogFormat

ENV_PREFIX = "OUTBOX_"

log = logging.getLogger(__name__)

#: ``OUTBOX_*`` variables read outside :class:`Settings`: known, so never warned about.
OTHER_VARIABLES = {
    "OUTBOX_FAULTS": "fault points armed at start (tests only; outbox.faults)",
    "OUTBOX_TEST_DATABASE_URL": "the test suite's PostgreSQL server",
    "OUTBOX_TEST_BROKER_URL": "the test suite's RabbitMQ",
    "OUTBOX_BENCH_URL": "the benchmarks' PostgreSQL server",
    "OUTBOX_IMAGE": "compose.yaml: the image to run",
    "OUTBOX_TOOLS_FILE": "compose.yaml: the tools file mounted as OUTBOX_CONFIG",
    "OUTBOX_OTEL": "`outbox up --otel`: trace every component (outbox.tracing.setup)",
    "OUTBOX_OTEL_SQL": "with tracing on, a span per SQL statement (SQLAlchemy instrumentation)",
}

#: Events an escalation webhook may subscribe to.
WEBHOOK_EVENT_NAMES = frozenset(
    {
        "needs_human",
        "resolved",
        "confirmed",
        "failed",
        "approval_requested",
        "approval_expired",
        "circuit_opened",
        "circuit_closed",
        "budget_exhausted",
        "saga_compensated",
        "saga_needs_human",
    }
)

Seconds = Annotated[float, Field(gt=0)]

#: A deployment name: what every broker allows in a queue or exchange name.
DEPLOYMENT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def _split_commas(value: Any) -> Any:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


class Settings(BaseSettings):
    """Every knob of the outbox; each field is the variable ``OUTBOX_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    database_url: SecretStr | None = Field(
        default=None,
        description="PostgreSQL URL; unset: an embedded PostgreSQL under OUTBOX_HOME.",
    )
    home: Path = Field(
        default=Path(".outbox"),
        description="Directory for local state (the embedded PostgreSQL's data).",
    )
    broker_url: SecretStr | None = Field(
        default=None,
        description="Celery broker URL; unset: the database itself (kombu's SQLAlchemy transport).",
    )
    deployment: str | None = Field(
        default=None,
        description=(
            "Name of this deployment in its broker queues and exchanges; unset: derived from "
            "the database's identity. Set it alike on every process of a deployment."
        ),
    )
    config: Path | None = Field(default=None, description="TOML file declaring HTTP tools.")
    tools: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Comma-separated modules that register tools."
    )
    sent_timeout: Seconds = Field(
        default=60.0, description="A `sent` row older than this is checked by the sweep."
    )
    sent_max_age: Seconds = Field(
        default=3600.0,
        description="A `sent` row still locked by its dispatcher after this goes to a human.",
    )
    sweep_interval: Seconds = Field(default=15.0, description="Seconds between sweeps.")
    broker_poll_interval: Seconds = Field(
        default=5.0,
        description=(
            "On the database broker: seconds between a worker's polls of its empty queues; "
            "a publish wakes it at once (LISTEN/NOTIFY), the poll only covers a lost "
            "notification."
        ),
    )
    broker_direct_take: bool = Field(
        default=True,
        description=(
            "Workers take due operations from the outbox themselves, without the relay's "
            "message in between: on the database broker in the outbox's own database always "
            "(the relay stands by), on RabbitMQ too (a worker waiting for work is left a fresh "
            "row for 0.2 s; one carrying a backlog, several per message, and the relay stands "
            "by); false: every operation goes through the relay's message (the worker says so "
            "in outbox.relays, and a relay standing by for others publishes what they left "
            "for 0.2 s)."
        ),
    )
    lookup_lease: Seconds = Field(
        default=60.0,
        description=(
            "An `unknown` row the sweep sent to a lookup is not routed again for this long; "
            "on the database broker (no redelivery) a lost lookup message delays that "
            "operation by up to this."
        ),
    )
    republish_after: Seconds = Field(
        default=30.0, description="A published `planned` row is published again after this."
    )
    ops_per_message: int = Field(
        default=8,
        ge=1,
        le=100,
        description=(
            "Operations one dispatch message may name (each still gets its own lock and "
            "attempt); a batch is still spread over at least 16 messages when it can be."
        ),
    )
    task_events: bool = Field(
        default=True,
        description=(
            "Send Celery's task events on RabbitMQ (the tasks Flower shows; the database broker "
            "carries none); off, no message costs event publishes: a little less latency and "
            "broker load (docs/performance.md)."
        ),
    )
    task_time_limit_slack: Seconds = Field(
        default=30.0,
        description=(
            "A dispatch message's hard time limit is the slowest tool's send deadline + "
            "timeout plus this; an operation that would not end inside it waits for a new "
            "message instead of being started."
        ),
    )
    max_payload_bytes: int = Field(
        default=256 * 1024, gt=0, description="Largest canonical payload accepted by enqueue."
    )
    allow_async_replicas: bool = Field(
        default=False,
        description=(
            "Let dispatch workers start on a primary whose streaming standbys are all "
            "asynchronous: a failover to one may roll back a committed `sent` and send the "
            "operation again (docs/deploy.md)."
        ),
    )
    log_format: LogFormat = Field(
        default=LogFormat.LOGFMT,
        description="Log lines on stderr: logfmt, or json (one object per line).",
    )
    flower_basic_auth: SecretStr | None = Field(
        default=None,
        description=(
            "Credentials `outbox flower` (and `outbox up --flower`) asks for: user:password, "
            "comma-separated for several."
        ),
    )
    webhook_url: HttpUrl | None = Field(
        default=None, description="Where escalations are POSTed (http or https)."
    )
    webhook_secret: SecretStr | None = Field(
        default=None, description="Standard Webhooks signing secret (whsec_...)."
    )
    webhook_events: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [
            "needs_human",
            "resolved",
            "approval_requested",
            "approval_expired",
            "circuit_opened",
            "circuit_closed",
            "budget_exhausted",
            "saga_compensated",
            "saga_needs_human",
        ],
        description=(
            "Comma-separated events to deliver: needs_human, resolved, approval_requested, "
            "approval_expired, circuit_opened, circuit_closed, budget_exhausted, "
            "saga_compensated, saga_needs_human, confirmed, failed."
        ),
    )

    api_host: str = Field(
        default="127.0.0.1",
        description=(
            "Address `outbox api` binds; a non-loopback one needs OUTBOX_API_TLS_CERT and "
            "OUTBOX_API_TLS_KEY, or OUTBOX_API_BEHIND_PROXY."
        ),
    )
    api_port: int = Field(default=8600, ge=0, le=65535, description="Port `outbox api` binds.")
    api_behind_proxy: bool = Field(
        default=False,
        description=(
            "A reverse proxy terminates TLS in front of `outbox api`: it may bind a "
            "non-loopback address without TLS of its own, and trusts X-Forwarded-* headers "
            "from OUTBOX_API_FORWARDED_ALLOW_IPS."
        ),
    )
    api_forwarded_allow_ips: str = Field(
        default="127.0.0.1",
        description="Comma-separated proxy addresses whose X-Forwarded-* headers are trusted.",
    )
    api_tls_cert: Path | None = Field(
        default=None, description="PEM certificate `outbox api` serves HTTPS with."
    )
    api_tls_key: Path | None = Field(
        default=None, description="PEM private key of OUTBOX_API_TLS_CERT."
    )
    api_max_body_bytes: int = Field(
        default=512 * 1024,
        gt=0,
        description=(
            "Largest request body `outbox api` reads (413 above it); a payload is also held "
            "to OUTBOX_MAX_PAYLOAD_BYTES."
        ),
    )
    api_token_cache: float = Field(
        default=5.0,
        ge=0,
        description=(
            "Seconds `outbox api` trusts a token it checked before checking it again: a "
            "revoked token is refused within this (0: check on every request)."
        ),
    )
    api_max_wait: Seconds = Field(
        default=60.0,
        description="Longest long-poll `GET /v1/operations/{id}?wait=S` holds (S is capped to it).",
    )
    api_workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "Worker processes `outbox api` serves with, on one socket (each its own "
            "interpreter: about one per core)."
        ),
    )

    mcp_agent: str = Field(
        default="mcp",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$",
        description=(
            "The name `outbox mcp` (stdio) records as requested_by of what it enqueues; over "
            "HTTP the bearer token's name is."
        ),
    )
    db_start_timeout: Annotated[float, Field(ge=0)] = Field(
        default=120.0,
        description=(
            "How long the relay, workers, beat, `outbox api` and `outbox mcp` wait at start-up "
            "for an unreachable (or starting) database, trying again with backoff, before "
            "they exit 1 (0: try once)."
        ),
    )
    mcp_wait_s: Seconds = Field(
        default=20.0,
        description=(
            "How long an MCP tool call waits for its operation's outcome before answering "
            "that it is still in progress."
        ),
    )
    mcp_host: str = Field(
        default="127.0.0.1",
        description=(
            "Address `outbox mcp --http` binds; a non-loopback one needs OUTBOX_API_TLS_CERT "
            "and OUTBOX_API_TLS_KEY (--tls-cert/--tls-key), or --behind-proxy."
        ),
    )
    mcp_port: int = Field(
        default=8700, ge=0, le=65535, description="Port `outbox mcp --http` binds."
    )

    console_secret: SecretStr | None = Field(
        default=None,
        description=(
            "Key that signs the console's session cookies (at least 32 random characters); "
            "unset, each `outbox api` makes one (shared by its --workers), so sessions end "
            "when it restarts and are not shared between replicas."
        ),
    )
    console_url: HttpUrl | None = Field(
        default=None,
        description=(
            "The console's public address (e.g. https://outbox.example.com): escalation "
            "webhooks then link to the operation's page (data.console_url)."
        ),
    )
    console_flower_url: HttpUrl | None = Field(
        default=None, description="Flower's address, linked from the console's overview."
    )
    console_signin_limit: int = Field(
        default=5,
        ge=1,
        le=1000,
        description=(
            "Failed console sign-ins, per name and per client address, within "
            "OUTBOX_CONSOLE_SIGNIN_WINDOW that lock that name or address."
        ),
    )
    console_signin_window: Seconds = Field(
        default=900.0, description="Seconds a failed console sign-in counts against the limit."
    )
    console_signin_lockout: Seconds = Field(
        default=60.0,
        description=(
            "Seconds a locked name or address is refused after its last failed sign-in "
            "(then one more password is checked per lockout)."
        ),
    )
    console_hash_threads: int = Field(
        default=1,
        ge=1,
        le=64,
        description=(
            "Threads of each `outbox api` process that check console passwords (argon2id), "
            "at a lower CPU priority than the agents' requests."
        ),
    )
    console_hash_queue: int = Field(
        default=8,
        ge=0,
        le=10_000,
        description=(
            "Console sign-ins that may wait for a password-checking thread, per process; "
            "beyond them a sign-in is refused at once (503, Retry-After)."
        ),
    )
    console_hash_rate: float = Field(
        default=0.25,
        gt=0,
        le=1_000,
        description=(
            "Console passwords checked per second at most, per process: each check (about a "
            "tenth of a second of a core and 64 MiB) starts no sooner than 1/rate after the "
            "previous one, so a burst of sign-ins cannot take the agents' CPU."
        ),
    )
    console_metrics_url: HttpUrl | None = Field(
        default=None,
        description="A metrics dashboard's (or the exporter's) address, linked from the overview.",
    )

    _split_tools = field_validator("tools", "webhook_events", mode="before")(_split_commas)

    @field_validator("log_format", mode="before")
    @classmethod
    def _any_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("webhook_events")
    @classmethod
    def _known_events(cls, value: list[str]) -> list[str]:
        unknown = sorted(set(value) - WEBHOOK_EVENT_NAMES)
        if unknown:
            raise ValueError(
                f"unknown event(s) {', '.join(unknown)}; "
                f"choose from {', '.join(sorted(WEBHOOK_EVENT_NAMES))}"
            )
        return value

    @field_validator("console_secret")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        # A short key can be guessed offline from one signed cookie, and then any session forged.
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError("must have at least 32 characters (secrets.token_urlsafe(32))")
        return value

    @field_validator("deployment")
    @classmethod
    def _deployment_name(cls, value: str | None) -> str | None:
        if value is not None and not DEPLOYMENT_PATTERN.fullmatch(value):
            raise ValueError(
                "must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter "
                "or a digit"
            )
        return value

    @model_validator(mode="after")
    def _tls_in_pairs(self) -> Settings:
        if (self.api_tls_cert is None) != (self.api_tls_key is None):
            raise ValueError(
                "OUTBOX_API_TLS_CERT and OUTBOX_API_TLS_KEY go together: set both or neither"
            )
        return self

    @model_validator(mode="after")
    def _ages_in_order(self) -> Settings:
        if self.sent_max_age < self.sent_timeout:
            raise ValueError(
                f"OUTBOX_SENT_MAX_AGE ({self.sent_max_age:g}s) must be at least "
                f"OUTBOX_SENT_TIMEOUT ({self.sent_timeout:g}s)"
            )
        return self


def _describe(error: dict[str, Any]) -> str:
    location = [str(part) for part in error.get("loc", ()) if part != "__root__"]
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    if not location:
        return message
    return f"{ENV_PREFIX}{location[0].upper()}: {message}"


def variable(field: str) -> str:
    """The environment variable of a :class:`Settings` field: ``OUTBOX_<FIELD>``."""
    return f"{ENV_PREFIX}{field.upper()}"


def known_variables() -> frozenset[str]:
    """Every ``OUTBOX_*`` variable some part of the outbox reads."""
    return frozenset(variable(name) for name in Settings.model_fields) | frozenset(OTHER_VARIABLES)


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning per ``OUTBOX_*`` variable in ``environ`` that nothing reads (a misspelling:
    ``OUTBOX_DATABSE_URL`` would otherwise be ignored silently and an embedded PostgreSQL
    started instead), naming the closest known variable when one is close."""
    known = known_variables()
    # Compared without the prefix, which every name shares: OUTBOX_FOO is close to nothing.
    suffixes = sorted(name.removeprefix(ENV_PREFIX) for name in known)
    warnings = []
    for name in sorted(environ):
        upper = name.upper()  # pydantic-settings reads the names in any case
        if upper.startswith(ENV_PREFIX) and upper not in known:
            close = difflib.get_close_matches(upper.removeprefix(ENV_PREFIX), suffixes, n=1)
            hint = f"; did you mean {ENV_PREFIX}{close[0]}?" if close else ""
            warnings.append(f"unknown variable {name} is ignored{hint}")
    return warnings


def load_settings(**overrides: Any) -> Settings:
    """Read the settings from the environment, raising :class:`ConfigError` naming the variable."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(_describe(dict(error)) for error in exc.errors())
        raise ConfigError(f"invalid configuration: {problems}") from exc


@functools.cache
def get_settings() -> Settings:
    """The process-wide settings, read once; an unknown ``OUTBOX_*`` variable is warned
    about (once, on stderr: the logging warning reaches it even before logging is set up)."""
    for warning in unknown_variables(os.environ):
        log.warning(warning, extra={"action": Action.CONFIG_UNKNOWN_VARIABLE})
    return load_settings()
