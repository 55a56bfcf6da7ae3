"""The ``[tools."name"]`` table of an HTTP tool: its keys, validated, and the URL rules.

Validation only: nothing is resolved here (environment headers are read by
:mod:`outbox.tools.http.load`). Errors name the key; header values (secrets) never appear.
"""

from __future__ import annotations

import re
import string
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from yarl import URL

from outbox.contracts import DedupContract, ToolContract
from outbox.guards import Breaker, Concurrency, Rate

#: Values a URL may interpolate, each percent-encoded as one path segment or query value.
PLACEHOLDERS = frozenset({"target", "operation_id", "intent_key"})
#: Methods of a consequential call (a GET has no effect to make durable).
METHODS = ("POST", "PUT", "PATCH", "DELETE")

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 header field name
#: A header value HTTP allows: visible ASCII, no CR/LF smuggling.
HEADER_VALUE = re.compile(r"[\x20-\x7e\t]*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A rendered host an allow-list may admit: DNS labels or a dotted IPv4 (nothing encoded).
_PLAIN_HOST = re.compile(r"(?:[a-z0-9-]+\.)*[a-z0-9-]+")
#: "Key in use": never an authoritative refusal (see HttpToolSpec.rejected_statuses).
KEY_IN_USE = 409

HttpStatus = Annotated[int, Field(ge=100, le=599)]
Per = Literal["tool", "target"]


class BreakerSpec(BaseModel):
    """``[tools."name".breaker]``: the keys of :class:`outbox.guards.Breaker`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    failures: int = Breaker.failures
    open_s: float = Breaker.open_s
    per: Per = "target"
    ratio: float | None = None
    window_s: float = Breaker.window_s
    min_calls: int = Breaker.min_calls


class RateSpec(BaseModel):
    """``[tools."name".rate]``: the keys of :class:`outbox.guards.Rate`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    per_second: float
    burst: int = Rate.burst
    per: Per = "target"


class ConcurrencySpec(BaseModel):
    """``[tools."name".concurrency]``: the keys of :class:`outbox.guards.Concurrency`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_in_flight: int
    per: Per = "target"


class HttpToolSpec(BaseModel):
    """One ``[tools."name"]`` table, exactly as written (validated, nothing resolved)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    kind: Literal["http"]
    method: str = "POST"
    url: str
    idempotency_header: str | None = None
    timeout_s: float | None = None
    send_deadline_s: float | None = None
    remote_ref: str
    rejected_statuses: list[HttpStatus] = Field(default_factory=list)
    lookup_url: str | None = None
    lookup_remote_ref: str | None = None
    lookup_not_applied_statuses: list[HttpStatus] | None = None
    inflight_horizon_s: float | None = None
    max_checks: int | None = None
    max_attempts: int | None = None
    dedup_window_s: float | None = None
    dedup_margin_s: float | None = None
    dedup_concurrent_safe: bool | None = None
    headers: dict[str, str] = Field(default_factory=dict)
    env_headers: dict[str, str] = Field(default_factory=dict)
    allowed_hosts: list[str] | None = None
    #: Send the W3C ``traceparent`` / ``tracestate`` headers so the remote's spans join the
    #: agent's trace; ``false`` for a remote that must not see it.
    propagate_trace: bool = True
    approval: Literal["none", "required"] = "none"
    approval_ttl_s: float | None = None
    #: The JSON Schema of the payload (a TOML table), checked at enqueue where the tool is known.
    input_schema: dict[str, Any] | None = None
    #: What the action does, for models and people (the MCP server and adapters show it).
    description: str | None = None
    #: The guards (docs/guards.md): sub-tables of the tool's table.
    breaker: BreakerSpec | None = None
    rate: RateSpec | None = None
    concurrency: ConcurrencySpec | None = None

    @field_validator("method")
    @classmethod
    def _known_method(cls, value: str) -> str:
        if value.upper() not in METHODS:
            raise ValueError(f"must be one of {', '.join(METHODS)}, not {value!r}")
        return value.upper()

    @field_validator("url", "lookup_url")
    @classmethod
    def _valid_url(cls, value: str | None) -> str | None:
        if value is not None:
            check_url_template(value)
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _host_patterns(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("must name at least one host (or be left out)")
        for pattern in value:
            if not _PLAIN_HOST.fullmatch(pattern.removeprefix("*.")) or pattern != pattern.lower():
                raise ValueError(
                    f"{pattern!r} is not a lower-case host name, IPv4 address or '*.domain'"
                )
        return value

    @field_validator("remote_ref", "lookup_remote_ref")
    @classmethod
    def _dotted_path(cls, value: str | None) -> str | None:
        if value is not None and not all(value.split(".")):
            raise ValueError(f"{value!r} is not a dotted path such as 'data.id' or 'items.0.id'")
        return value

    @field_validator("rejected_statuses")
    @classmethod
    def _authoritative_refusals(cls, value: list[int]) -> list[int]:
        if KEY_IN_USE in value:
            raise ValueError(
                "409 is never an authoritative refusal: it means the idempotency key is in "
                "use (an earlier or concurrent request with this key); remove it"
            )
        return _client_errors(value)

    @field_validator("lookup_not_applied_statuses")
    @classmethod
    def _declared_absence(cls, value: list[int] | None) -> list[int] | None:
        return None if value is None else _client_errors(value)

    @field_validator("idempotency_header")
    @classmethod
    def _header_name(cls, value: str | None) -> str | None:
        if value is not None and not _TOKEN.fullmatch(value):
            raise ValueError(f"{value!r} is not an HTTP header name")
        return value

    @field_validator("headers")
    @classmethod
    def _static_headers(cls, value: dict[str, str]) -> dict[str, str]:
        for name, header_value in value.items():
            _check_header_name(name)
            if not HEADER_VALUE.fullmatch(header_value):
                # Name the header, never its value: it may be a secret.
                raise ValueError(f"the value of header {name!r} has characters HTTP forbids")
        return value

    @field_validator("env_headers")
    @classmethod
    def _environment_headers(cls, value: dict[str, str]) -> dict[str, str]:
        for name, variable in value.items():
            _check_header_name(name)
            if not _ENV_NAME.fullmatch(variable):
                raise ValueError(f"header {name!r}: {variable!r} is not an environment variable")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> HttpToolSpec:
        problems = [
            *self._key_problems(),
            *self._lookup_problems(),
            *self._dedup_problems(),
            *self._host_problems(),
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _key_problems(self) -> list[str]:
        problems = []
        if self.idempotency_header is None and "{operation_id}" not in self.url:
            problems.append(
                "the operation id must reach the remote: set idempotency_header or put "
                "{operation_id} in url"
            )
        names = [*self.headers, *self.env_headers]
        if self.idempotency_header is not None:
            names.append(self.idempotency_header)
        lowered = [name.lower() for name in names]
        twice = sorted({name for name in names if lowered.count(name.lower()) > 1})
        if twice:
            problems.append(
                f"header(s) {', '.join(twice)} set more than once across headers, "
                "env_headers and idempotency_header"
            )
        return problems

    def _lookup_problems(self) -> list[str]:
        if self.lookup_url is not None:
            missing = [
                key
                for key, value in (
                    ("lookup_remote_ref", self.lookup_remote_ref),
                    ("lookup_not_applied_statuses", self.lookup_not_applied_statuses),
                )
                if value is None
            ]
            return [f"{key} is required when lookup_url is set" for key in missing]
        stray = [
            key
            for key in ("lookup_remote_ref", "lookup_not_applied_statuses")
            if getattr(self, key) is not None
        ]
        return [f"{key} has no effect without lookup_url" for key in stray]

    def _dedup_problems(self) -> list[str]:
        if self.dedup_window_s is not None:
            return []
        stray = [
            key
            for key in ("dedup_margin_s", "dedup_concurrent_safe")
            if getattr(self, key) is not None
        ]
        return [f"{key} has no effect without dedup_window_s" for key in stray]

    def _host_problems(self) -> list[str]:
        # A placeholder in the host sends the request wherever the agent's value says (the
        # cloud metadata address, an internal service): only inside a declared allow-list.
        problems = []
        for key in ("url", "lookup_url"):
            template = getattr(self, key)
            if template is None:
                continue
            if self.allowed_hosts is None and "{" in _url_part(template, "host"):
                problems.append(
                    f"{key}: a placeholder in the host sends the request wherever the value "
                    "says; declare allowed_hosts (host names or '*.domain') to allow it"
                )
            elif self.allowed_hosts is not None and "{" not in _url_part(template, "host"):
                host = _url_part(template, "host").lower()
                if not host_allowed(host, self.allowed_hosts):
                    problems.append(f"{key}: host {host!r} is not in allowed_hosts")
        return problems

    def contract(self, name: str) -> ToolContract:
        """The :class:`ToolContract` this table declares (raises ConfigError if contradictory)."""
        knobs = {
            key: getattr(self, key)
            for key in (
                "timeout_s",
                "send_deadline_s",
                "inflight_horizon_s",
                "max_checks",
                "max_attempts",
                "approval_ttl_s",
            )
            if getattr(self, key) is not None
        }
        return ToolContract(
            name=name,
            has_lookup=self.lookup_url is not None,
            dedup=self._dedup(),
            approval_required=self.approval == "required",
            input_schema=self.input_schema,
            description=self.description,
            breaker=Breaker(**self.breaker.model_dump()) if self.breaker else None,
            rate=Rate(**self.rate.model_dump()) if self.rate else None,
            concurrency=Concurrency(**self.concurrency.model_dump()) if self.concurrency else None,
            **knobs,
        )

    def _dedup(self) -> DedupContract | None:
        if self.dedup_window_s is None:
            return None
        extra: dict[str, Any] = {}
        if self.dedup_margin_s is not None:
            extra["margin_s"] = self.dedup_margin_s
        if self.dedup_concurrent_safe is not None:
            extra["concurrent_safe"] = self.dedup_concurrent_safe
        return DedupContract(window_s=self.dedup_window_s, **extra)


def check_url_template(template: str) -> None:
    """Raise ValueError unless ``template`` is an http(s) URL whose placeholders are known."""
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"{template!r} has unbalanced braces ({exc})") from None
    for _, field, spec, conversion in fields:
        if field is None:
            continue
        if field not in PLACEHOLDERS or spec or conversion:
            raise ValueError(
                f"unknown placeholder {{{field}}}; use {', '.join(sorted(PLACEHOLDERS))} "
                "(written {target}, without format specs)"
            )
    for part in ("scheme", "port"):
        if "{" in _url_part(template, part):
            raise ValueError(f"{template!r} has a placeholder in its {part}; write it out")
    sample = template.format(**dict.fromkeys(PLACEHOLDERS, "x"))
    try:
        url = URL(sample, encoded=True)
        normalised = URL(sample)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{template!r} is not a URL ({exc})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"{template!r} is not an http:// or https:// URL with a host")
    if url.user is not None or url.password is not None:
        raise ValueError("credentials do not belong in the URL; use env_headers")
    if (url.raw_path, url.raw_query_string) != (normalised.raw_path, normalised.raw_query_string):
        # The URL is sent as written (placeholders aside), so it must be written as sent.
        raise ValueError(
            f"{template!r} is not written as it is sent: use {str(normalised)!r} "
            "(percent-encoded, no '.' or '..' segments)"
        )


def host_allowed(host: str, allowed_hosts: list[str]) -> bool:
    """Whether lower-case ``host`` is one of ``allowed_hosts``: an exact name or address, or
    ``*.domain`` for any name under ``domain`` (not ``domain`` itself)."""
    if not _PLAIN_HOST.fullmatch(host):
        return False  # percent-encoded or bracketed: never what a pattern means
    for pattern in allowed_hosts:
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]):
                return True
        elif host == pattern:
            return True
    return False


def _url_part(template: str, part: str) -> str:
    """The ``scheme``, ``host`` or ``port`` text of a URL template, placeholders as written.

    Placeholders render percent-encoded, so the template's own ``://``, ``:`` and ``/`` are
    where the rendered URL's parts begin and end.
    """
    scheme, _, rest = template.partition("://")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0].rpartition("@")[2]
    host, colon, port = authority.rpartition(":")
    if not colon or (host.startswith("[") and not host.endswith("]")):
        host, port = authority, ""
    return {"scheme": scheme, "host": host, "port": port}[part]


def _client_errors(statuses: list[int]) -> list[int]:
    # Only a 4xx is a considered answer about this request; a 5xx or a 2xx is never an
    # authoritative refusal or absence.
    outside = [status for status in statuses if not 400 <= status <= 499]
    if outside:
        raise ValueError(f"only 4xx statuses are allowed here, not {outside}")
    return statuses


def _check_header_name(name: str) -> None:
    if not _TOKEN.fullmatch(name):
        raise ValueError(f"{name!r} is not an HTTP header name")
