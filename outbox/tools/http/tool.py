"""The HTTP tool: one request per dispatch or lookup, its answer classified into a result.

The classification rules are in :mod:`outbox.tools.http`; the request goes through
:mod:`outbox.tools.http.transport`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from string import Formatter
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
from yarl import URL

from outbox import storable, trace_context
from outbox.errors import SendDeadlinePassed
from outbox.segments import dot_segment_refusal, has_dot_segment
from outbox.tools.base import Tool, ToolCall
from outbox.tools.http.spec import KEY_IN_USE, HttpToolSpec, host_allowed
from outbox.tools.http.transport import NEVER_SENT, SENDING, Answer, http_client, send
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

_EXCERPT_CHARS = 200


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
        dotted = dot_segment_placeholder(self.spec.url, call)
        if dotted is not None:
            # Recorded before enqueue refused it: no encoding keeps it from moving the path.
            return Rejected(f"{dot_segment_refusal(dotted)}; nothing was sent")
        url = render_url(self.spec.url, call)
        if not self._host_allowed(url):
            # Refused before any connection: provably not sent, and never sendable.
            return Rejected(f"{self._host_refusal(url)}; nothing was sent")
        body = json.dumps(call.payload, ensure_ascii=False, separators=(",", ":")).encode()
        headers = self._request_headers(call)
        headers["Content-Type"] = "application/json"
        sending = SENDING.set(call)  # the connector checks its send deadline (see there)
        try:
            async with http_client() as client:
                answer = await send(
                    client,
                    self.spec.method,
                    url,
                    headers=headers,
                    body=body,
                    timeout=self._timeout(call),
                    template=self.spec.url,
                    propagate=self.spec.propagate_trace,
                )
        except SendDeadlinePassed:
            raise  # connected too late: nothing written; run_dispatch makes it NotSent
        except NEVER_SENT as exc:
            # The connection never opened, so no byte of the request was written.
            return NotDelivered(f"{_exception_text(exc)}; nothing was sent")
        except Exception as exc:  # noqa: BLE001 - after a byte may have left, all is ambiguous
            return Ambiguous(f"{_exception_text(exc)}; the request may have been applied")
        finally:
            SENDING.reset(sending)
        return self._classify_dispatch(answer)

    async def lookup(self, call: ToolCall) -> LookupResult:
        """Ask ``lookup_url`` whether the operation's effect exists (GET, no body)."""
        if self.spec.lookup_url is None:
            return Inconclusive(f"tool {self.name!r} has no lookup_url")
        dotted = dot_segment_placeholder(self.spec.lookup_url, call)
        if dotted is not None:
            return Inconclusive(f"{dot_segment_refusal(dotted)}; the lookup was not sent")
        url = render_url(self.spec.lookup_url, call)
        if not self._host_allowed(url):
            return Inconclusive(f"{self._host_refusal(url)}; the lookup was not sent")
        try:
            async with http_client() as client:
                answer = await send(
                    client,
                    "GET",
                    url,
                    headers=self._request_headers(call),
                    body=None,
                    timeout=self._timeout(call),
                    template=self.spec.lookup_url,
                    propagate=self.spec.propagate_trace,
                )
        except Exception as exc:  # noqa: BLE001 - an unanswered lookup proves nothing
            return Inconclusive(_exception_text(exc))
        return self._classify_lookup(answer)

    def _host_allowed(self, url: URL) -> bool:
        allowed = self.spec.allowed_hosts
        return allowed is None or host_allowed((url.raw_host or "").lower(), allowed)

    def _host_refusal(self, url: URL) -> str:
        return f"host {url.raw_host!r} is not in tool {self.name!r}'s allowed_hosts"

    def _classify_dispatch(self, response: Answer) -> DispatchResult:
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
        if status == KEY_IN_USE:
            return Ambiguous(
                "409: key in use (a request with this idempotency key is in progress or was "
                f"made with another payload): {_excerpt(response)}"
            )
        return Ambiguous(f"HTTP {status}: {_excerpt(response)}")

    def _classify_lookup(self, response: Answer) -> LookupResult:
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
        if self.spec.propagate_trace:
            # The span of ours current for this call if there is one (the remote's spans are
            # then its children), else the agent's stored context: the remote joins its trace.
            trace = trace_context.current() or call.trace
            if trace is not None:
                headers.update(trace.headers())
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

    def span_attributes(self, stage: str) -> dict[str, str]:
        """HTTP client semantic conventions: the method and, when the URL template names its
        host outright, ``server.address`` (never the rendered URL: it carries the target)."""
        template = self.spec.lookup_url if stage == "lookup" else self.spec.url
        attributes = {"http.request.method": "GET" if stage == "lookup" else self.spec.method}
        host = urlsplit(template or "").hostname
        if host and "{" not in host:
            attributes["server.address"] = host
        return attributes

    def same_definition(self, other: Tool) -> bool:
        """The same table (the file loaded again) defines the same tool."""
        return isinstance(other, HttpTool) and (other.name, other.spec) == (self.name, self.spec)

    def __repr__(self) -> str:
        return f"<HttpTool {self.name!r} {self.spec.method} {self.spec.url}>"


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


def dot_segment_placeholder(template: str, call: ToolCall) -> str | None:
    """The placeholder of ``template`` whose value has a dot segment (:mod:`outbox.segments`),
    or ``None``. ``enqueue`` refuses such values; an operation recorded before it did may
    still hold one, and WHATWG remotes resolve ``%2E%2E`` as ``..`` however it is encoded."""
    values = {"target": call.target, "intent_key": call.intent_key}
    for _, field, _, _ in Formatter().parse(template):
        if field in values and has_dot_segment(values[field]):
            return field
    return None


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


def _encode(value: str) -> str:
    encoded = quote(value, safe="")
    # "." and ".." survive quoting but are path navigation: URL normalisation would drop them.
    return encoded.replace(".", "%2E") if encoded in (".", "..") else encoded


def _parse_json(response: Answer) -> tuple[bool, Any]:
    try:
        return True, json.loads(response.content)
    except ValueError:
        return False, None


def _excerpt(response: Answer) -> str:
    """The body's start for a reason: bounded, and storable (bytes that are not UTF-8 and NUL
    escaped as ``\\xNN``), since it lands in ``last_error`` and the event log."""
    head = response.content[: _EXCERPT_CHARS * 4]  # enough bytes for _EXCERPT_CHARS characters
    decoded = head.decode("utf-8", errors="surrogateescape")
    text = " ".join(storable.text(decoded, limit=None).split())
    if not text:
        return "(empty body)"
    return text if len(text) <= _EXCERPT_CHARS else text[: _EXCERPT_CHARS - 1] + "…"


def _exception_text(exc: BaseException) -> str:
    message = str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
