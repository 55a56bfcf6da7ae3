"""Declarative HTTP tools: ``[tools."name"]`` tables of ``OUTBOX_CONFIG`` (DESIGN.md keys).

One call is one HTTP request with the operation id as idempotency key, sent by aiohttp (its
client costs a third of httpx's async client's CPU per request, the largest single cost of a
dispatch worker); the answer is classified by status only where the tool's declaration makes
it authoritative:

- dispatch: 2xx whose JSON has a non-empty ``remote_ref`` → :class:`Applied`; a declared
  ``rejected_statuses`` status → :class:`Rejected`; a connection that never opened
  (refused, TLS handshake failed, connect or pool timeout) → :class:`NotDelivered`;
  everything else (409 "key in use", 5xx, other statuses, 2xx without a reference or with
  malformed JSON, timeouts after the connection opened, resets) → :class:`Ambiguous`.
- lookup: 2xx whose JSON has a non-empty ``lookup_remote_ref`` → :class:`Applied`; a declared
  ``lookup_not_applied_statuses`` status → :class:`NotApplied`; anything else →
  :class:`Inconclusive`.

A request is never sent twice: aiohttp's resend of an idempotent method (PUT, DELETE) after a
kept-alive connection drops is turned off, redirects are not followed, cookies are refused.
The URL is sent as rendered (``encoded=True``): a template must be written percent-encoded,
and a placeholder's value is encoded as one segment, so no URL normalisation moves it.

Header values (``headers``, and ``env_headers`` read from the environment at load) are
secrets: they are never logged nor put in an error message or a ``repr``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import math
import os
import re
import string
import threading
import tomllib
import urllib.request
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from yarl import URL

from outbox import storable
from outbox.contracts import DedupContract, ToolContract
from outbox.errors import ConfigError, SendDeadlinePassed
from outbox.tools.base import Tool, ToolCall, check_tool_name
from outbox.tools.invoke import is_thread_loop, on_loop_close
from outbox.tools.results import (
    Ambiguous,
    Applied,
    DispatchResult,
    Inconclusive,
    LookupResult,
    NotApplied,
    NotDelivered,
    Rejected,
)

#: Values a URL may interpolate, each percent-encoded as one path segment or query value.
PLACEHOLDERS = frozenset({"target", "operation_id", "intent_key"})
#: Methods of a consequential call (a GET has no effect to make durable).
METHODS = ("POST", "PUT", "PATCH", "DELETE")

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 header field name
_HEADER_VALUE = re.compile(r"[\x20-\x7e\t]*")  # visible ASCII: no CR/LF smuggling
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_EXCERPT_CHARS = 200
# A rendered host an allow-list may admit: DNS labels or a dotted IPv4 (nothing encoded).
_PLAIN_HOST = re.compile(r"(?:[a-z0-9-]+\.)*[a-z0-9-]+")
_KEY_IN_USE = 409

HttpStatus = Annotated[int, Field(ge=100, le=599)]


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
        if _KEY_IN_USE in value:
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
            if not _HEADER_VALUE.fullmatch(header_value):
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
            )
            if getattr(self, key) is not None
        }
        return ToolContract(
            name=name, has_lookup=self.lookup_url is not None, dedup=self._dedup(), **knobs
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


class HttpTool(Tool):
    """A tool declared in ``OUTBOX_CONFIG``: one HTTP request per dispatch or lookup."""

    def __init__(
        self, name: str, spec: HttpToolSpec, headers: Mapping[str, str], source: Path
    ) -> None:
        self.contract = spec.contract(name)
        self.spec = spec
        #: The file that declared the tool.
        self.source = source
        self._headers = dict(headers)  # static and environment values: secrets, never shown

    async def dispatch(self, call: ToolCall) -> DispatchResult:
        """Send the request once (body: the payload as JSON) and classify the answer."""
        url = render_url(self.spec.url, call)
        if not self._host_allowed(url):
            # Refused before any connection: provably not sent, and never sendable.
            return Rejected(f"{self._host_refusal(url)}; nothing was sent")
        body = json.dumps(call.payload, ensure_ascii=False, separators=(",", ":")).encode()
        headers = self._request_headers(call)
        headers["Content-Type"] = "application/json"
        sending = _SENDING.set(call)  # the connector checks its send deadline (see there)
        try:
            async with _http_client() as client:
                answer = await _send(
                    client,
                    self.spec.method,
                    url,
                    headers=headers,
                    body=body,
                    timeout=self._timeout(call),
                )
        except SendDeadlinePassed:
            raise  # connected too late: nothing written; run_dispatch makes it NotSent
        except _NEVER_SENT as exc:
            # The connection never opened, so no byte of the request was written.
            return NotDelivered(f"{_exception_text(exc)}; nothing was sent")
        except Exception as exc:  # noqa: BLE001 - after a byte may have left, all is ambiguous
            return Ambiguous(f"{_exception_text(exc)}; the request may have been applied")
        finally:
            _SENDING.reset(sending)
        return self._classify_dispatch(answer)

    async def lookup(self, call: ToolCall) -> LookupResult:
        """Ask ``lookup_url`` whether the operation's effect exists (GET, no body)."""
        if self.spec.lookup_url is None:
            return Inconclusive(f"tool {self.name!r} has no lookup_url")
        url = render_url(self.spec.lookup_url, call)
        if not self._host_allowed(url):
            return Inconclusive(f"{self._host_refusal(url)}; the lookup was not sent")
        try:
            async with _http_client() as client:
                answer = await _send(
                    client,
                    "GET",
                    url,
                    headers=self._request_headers(call),
                    body=None,
                    timeout=self._timeout(call),
                )
        except Exception as exc:  # noqa: BLE001 - an unanswered lookup proves nothing
            return Inconclusive(_exception_text(exc))
        return self._classify_lookup(answer)

    def _host_allowed(self, url: URL) -> bool:
        allowed = self.spec.allowed_hosts
        return allowed is None or host_allowed((url.raw_host or "").lower(), allowed)

    def _host_refusal(self, url: URL) -> str:
        return f"host {url.raw_host!r} is not in tool {self.name!r}'s allowed_hosts"

    def _classify_dispatch(self, response: _Answer) -> DispatchResult:
        status = response.status
        if response.is_success:
            parsed, document = _parse_json(response)
            if not parsed:
                return Ambiguous(
                    f"HTTP {status} with a malformed JSON answer: {_excerpt(response)}"
                )
            ref = resolve_ref(document, self.spec.remote_ref)
            if ref is None:
                return Ambiguous(
                    f"HTTP {status} without a value at {self.spec.remote_ref!r}: "
                    f"{_excerpt(response)}"
                )
            return Applied(ref, result=document)
        if status in self.spec.rejected_statuses:
            return Rejected(f"HTTP {status}: {_excerpt(response)}", result=_parse_json(response)[1])
        if status == _KEY_IN_USE:
            return Ambiguous(
                "409: key in use (a request with this idempotency key is in progress or was "
                f"made with another payload): {_excerpt(response)}"
            )
        return Ambiguous(f"HTTP {status}: {_excerpt(response)}")

    def _classify_lookup(self, response: _Answer) -> LookupResult:
        status = response.status
        if response.is_success and self.spec.lookup_remote_ref is not None:
            parsed, document = _parse_json(response)
            ref = resolve_ref(document, self.spec.lookup_remote_ref) if parsed else None
            if ref is not None:
                return Applied(ref, result=document)
        if status in (self.spec.lookup_not_applied_statuses or ()):
            return NotApplied(f"HTTP {status}")
        return Inconclusive(f"HTTP {status}: {_excerpt(response)}")

    def _request_headers(self, call: ToolCall) -> dict[str, str]:
        headers = dict(self._headers)
        if self.spec.idempotency_header is not None:
            headers[self.spec.idempotency_header] = call.operation_id
        return headers

    def _timeout(self, call: ToolCall) -> aiohttp.ClientTimeout:
        # Connecting (a new connection, or waiting for a pooled one) may take only what is
        # left of the send deadline (all of it for a call that carries none): after it the
        # request must not leave. _DeadlineConnector checks again once connected. The total
        # deadline is enforced around the whole call (outbox.tools.invoke, which names it
        # in the result); each read is bounded here too, for a caller awaiting dispatch() on
        # a loop of its own. No rounding up to whole seconds (aiohttp's default above 5 s):
        # it would stretch the send deadline.
        left = call.send_time_left()
        send_window = self.contract.send_deadline_s if left is None else max(left, 0.001)
        connect = min(send_window, call.timeout_s)
        return aiohttp.ClientTimeout(
            total=None, connect=connect, sock_read=call.timeout_s, ceil_threshold=math.inf
        )

    @property
    def origin(self) -> str:
        """``http tool in <file>``."""
        return f"http tool in {self.source}"

    def same_definition(self, other: Tool) -> bool:
        """The same table (the file loaded again) defines the same tool."""
        return isinstance(other, HttpTool) and (other.name, other.spec) == (self.name, self.spec)

    def __repr__(self) -> str:
        return f"<HttpTool {self.name!r} {self.spec.method} {self.spec.url}>"


def load_http_tools(path: Path, environ: Mapping[str, str] | None = None) -> list[HttpTool]:
    """Read the ``[tools."name"]`` tables of the TOML file ``path`` (``OUTBOX_CONFIG``).

    ``env_headers`` are read from ``environ`` (default: ``os.environ``). Raises
    :class:`ConfigError` naming ``OUTBOX_CONFIG``, the file and the offending key (or the
    TOML line); header values never appear in the message.
    """
    document = _read_toml(path)
    environ = os.environ if environ is None else environ
    unknown = sorted(set(document) - {"tools"})
    if unknown:
        _fail(path, f'unknown top-level key(s) {", ".join(unknown)}; declare [tools."name"]')
    tables = document.get("tools", {})
    if not isinstance(tables, dict):
        _fail(path, 'tools must be a table of [tools."name"] tables')
    tools: list[HttpTool] = []
    problems: list[str] = []
    for name, table in tables.items():
        try:
            tools.append(_build_tool(name, table, environ, path))
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        _fail(path, "; ".join(problems))
    return tools


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


def render_url(template: str, call: ToolCall) -> URL:
    """Fill the placeholders of a (checked) URL template with ``call``'s percent-encoded values.

    The URL is taken as encoded: nothing is decoded or normalised on the way out.
    """
    rendered = template.format(
        target=_encode(call.target),
        operation_id=_encode(call.operation_id),
        intent_key=_encode(call.intent_key),
    )
    return URL(rendered, encoded=True)


def resolve_ref(document: Any, path: str) -> str | None:
    """The non-empty string or number at dotted ``path`` ("data.id", "items.0.id"), or None."""
    node = document
    for part in path.split("."):
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    if isinstance(node, bool) or not isinstance(node, str | int | float):
        return None  # True is an int to Python, not a reference
    text = str(node)
    return text if text.strip() else None


def _build_tool(name: str, table: Any, environ: Mapping[str, str], path: Path) -> HttpTool:
    where = f'tools."{name}"'
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    if "kind" not in table and table and all(isinstance(v, dict) for v in table.values()):
        inner = next(iter(table))
        raise ConfigError(
            f'{where} holds tables, not a tool: quote dotted names, [tools."{name}.{inner}"]'
        )
    try:
        check_tool_name(name)
        spec = HttpToolSpec.model_validate(table)
        headers = {**spec.headers, **_environment_headers(where, spec, environ)}
        return HttpTool(name, spec, headers, path)
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe(where, dict(e)) for e in exc.errors())) from None
    except ConfigError as exc:
        raise ConfigError(f"{where}: {str(exc).removeprefix(f'tool {name!r}: ')}") from None


def _environment_headers(
    where: str, spec: HttpToolSpec, environ: Mapping[str, str]
) -> dict[str, str]:
    headers = {}
    for name, variable in spec.env_headers.items():
        value = environ.get(variable, "")
        if not value:
            raise ConfigError(
                f"env_headers.{name}: environment variable {variable} is not set (or empty)"
            )
        if not _HEADER_VALUE.fullmatch(value):
            raise ConfigError(
                f"env_headers.{name}: environment variable {variable} holds characters HTTP "
                "forbids in a header"
            )
        headers[name] = value
    return headers


def _describe(where: str, error: dict[str, Any]) -> str:
    location = where
    for part in error.get("loc", ()):
        if part == "[key]":
            continue
        location += f"[{part}]" if isinstance(part, int) else f".{part}"
    kind = error.get("type")
    if kind == "extra_forbidden":
        return f"{location}: unknown key; allowed keys: {', '.join(HttpToolSpec.model_fields)}"
    if kind == "missing":
        return f"{location}: required key is missing"
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{location}: {message}"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"OUTBOX_CONFIG: cannot read {path}: {reason}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"OUTBOX_CONFIG {path}: invalid TOML: {exc}") from None


def _fail(path: Path, problem: str) -> None:
    raise ConfigError(f"OUTBOX_CONFIG {path}: {problem}")


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


def _encode(value: str) -> str:
    encoded = quote(value, safe="")
    # "." and ".." survive quoting but are path navigation: URL normalisation would drop them.
    return encoded.replace(".", "%2E") if encoded in (".", "..") else encoded


@dataclass(frozen=True, slots=True)
class _Answer:
    """A response as classified: its status and its whole body."""

    status: int
    content: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300


def _parse_json(response: _Answer) -> tuple[bool, Any]:
    try:
        return True, json.loads(response.content)
    except ValueError:
        return False, None


def _excerpt(response: _Answer) -> str:
    """The body's start for a reason: bounded, and storable (bytes that are not UTF-8 and NUL
    escaped as ``\\xNN``), since it lands in ``last_error`` and the event log."""
    head = response.content[: _EXCERPT_CHARS * 4]  # enough bytes for _EXCERPT_CHARS characters
    decoded = head.decode("utf-8", errors="surrogateescape")
    text = " ".join(storable.text(decoded, limit=None).split())
    if not text:
        return "(empty body)"
    return text if len(text) <= _EXCERPT_CHARS else text[: _EXCERPT_CHARS - 1] + "…"


#: What aiohttp raises when the connection never opened (refused, name not resolved, TLS
#: handshake failed, connect or pool wait past its timeout): no byte of the request left.
_NEVER_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


async def _send(
    client: aiohttp.ClientSession,
    method: str,
    url: URL,
    *,
    headers: dict[str, str],
    body: bytes | None,
    timeout: aiohttp.ClientTimeout,
) -> _Answer:
    async with client.request(
        method,
        url,
        data=body,
        headers=headers,
        timeout=timeout,
        allow_redirects=False,  # a redirected request would be a second request
        proxy=_env_proxy(url.scheme, url.host or ""),
    ) as response:
        return _Answer(response.status, await response.read())


def _exception_text(exc: BaseException) -> str:
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


# One client per thread's event loop (outbox.tools.invoke), whose connections it reuses;
# close_thread_loop() closes it before the loop goes.
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = (
    weakref.WeakKeyDictionary()
)
_clients_lock = threading.Lock()


@contextlib.asynccontextmanager
async def _http_client() -> AsyncIterator[aiohttp.ClientSession]:
    if not is_thread_loop():
        # A loop we do not manage (a caller's asyncio.run) may close with connections open:
        # use a client for this call only.
        async with _new_client() as one_shot:
            yield one_shot
        return
    loop = asyncio.get_running_loop()
    with _clients_lock:
        shared = _clients.get(loop)
        if shared is None or shared.closed:
            shared = _clients[loop] = _new_client()
    yield shared


@functools.lru_cache(maxsize=1024)
def _env_proxy(scheme: str, host: str) -> str | None:
    """The proxy ``HTTP_PROXY``/``HTTPS_PROXY`` name for ``host``, unless ``NO_PROXY`` exempts it.

    Read once per host, not per request: aiohttp's ``trust_env`` reads the environment and
    the netrc file on every request (a tenth of a dispatch worker's CPU).
    """
    if urllib.request.proxy_bypass(host):
        return None
    return urllib.request.getproxies().get(scheme)


#: The dispatch call whose request the running task is sending (None for a lookup).
_SENDING: contextvars.ContextVar[ToolCall | None] = contextvars.ContextVar(
    "outbox_http_sending", default=None
)


class _DeadlineConnector(aiohttp.TCPConnector):
    """A connector that hands over a connection only while the call's send deadline holds.

    ``connect()`` is the last point aiohttp gives control before it writes the request:
    once it returns, the client sets the response parameters and writes the headers with no
    await in between. So the check sits after the name lookup, the TCP (and TLS, or proxy
    tunnel) handshake and any wait for a pooled connection, which are where time goes; a
    pause between this check and the write (the process stopped, the loop blocked) is not
    covered, and is what the in-flight horizon's margin must absorb. A connection fetched
    too late is closed unused, and :class:`SendDeadlinePassed` is raised: nothing written.
    (aiohttp's ``on_connection_create_end`` trace would leak the new connection if it
    raised, and is not called for a pooled one.)
    """

    async def connect(
        self, req: aiohttp.ClientRequest, traces: list[Any], timeout: aiohttp.ClientTimeout
    ) -> aiohttp.connector.Connection:
        """A connection for ``req``, or SendDeadlinePassed if the call's deadline passed."""
        connection = await super().connect(req, traces, timeout)
        call = _SENDING.get()
        if call is not None:
            try:
                call.check_send_deadline()
            except SendDeadlinePassed:
                connection.close()
                raise
        return connection


def _new_client() -> aiohttp.ClientSession:
    client = aiohttp.ClientSession(
        # Refuse every cookie: one operation's call must not change the next one's.
        cookie_jar=aiohttp.DummyCookieJar(),
        headers={"User-Agent": "agent-outbox"},
        connector=_DeadlineConnector(timeout_ceil_threshold=math.inf),
    )
    # aiohttp sends an idempotent method (PUT, DELETE) again when a kept-alive connection
    # turns out closed; that second request would be a second call the remote may apply.
    # (The flag aiohttp's own test client clears; tests/integration/test_http_tool.py
    # checks that one PUT stays one request.)
    client._retry_connection = False
    return client


async def close_client() -> None:
    """Close the HTTP client of the running event loop, if it has one."""
    with _clients_lock:
        client = _clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.close()


on_loop_close(close_client)
