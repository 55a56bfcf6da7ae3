"""Around every request: the body size limit (413), request metrics, and the access log.

A plain ASGI middleware (no per-request task or body copy beyond the one it checks):

* a request body larger than ``OUTBOX_API_MAX_BODY_BYTES`` is answered 413 before the app
  reads any of it (by its ``Content-Length``, or as it streams in without one);
* a body sent to ``/v1`` as anything but JSON (``Content-Type`` other than
  ``application/json`` or ``…+json``) is answered 415 (the console's forms are not ``/v1``);
* ``outbox_api_requests_total`` and ``outbox_api_request_duration_seconds`` count and time
  requests by method, route template (never a raw path: ids would explode the series) and
  status, served on ``/metrics`` of the API process;
* one access-log line per request (``action=api_request``): method, path, status, duration
  and the token's name, never its query, body or headers (payloads, tokens).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.requests import Request

from outbox.logs import Action
from outbox.web.problems import MEDIA_TYPE, TYPE_PREFIX, unexpected

log = logging.getLogger("outbox.web.access")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Probes and scrapes: logged at DEBUG only, so they do not drown the requests that matter.
QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


class RequestMetrics:
    """The API's request metrics, in a registry of their own (one per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "outbox_api_requests_total",
            "HTTP API requests answered, by method, route and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "outbox_api_request_duration_seconds",
            "Time to answer an HTTP API request (a long-poll's wait included), by route.",
            ["method", "route"],
            buckets=(
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1,
                2.5,
                5,
                10,
                30,
                60,
            ),
            registry=self.registry,
        )


class Observe:
    """The body limit, the metrics and the access log, around ``app``."""

    def __init__(self, app: ASGIApp, *, metrics: RequestMetrics, max_body_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one request (other ASGI events pass through)."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]
        answering = [False]

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                answering[0] = True
            await send(message)

        try:
            body = await self._read_body(scope, receive)
            if body is None:
                await _too_large(scope, sending, self.max_body_bytes)
            elif (media := _not_json(scope, body)) is not None:
                await _unsupported(scope, sending, media)
            else:
                try:
                    await self.app(scope, _replay(body, receive), sending)
                except Exception as exc:
                    if answering[0]:
                        raise
                    # Answered here, not re-raised: the server would log its traceback (whose
                    # message may quote a statement's parameters: a payload) and close the
                    # client's keep-alive connection. One log line names its type.
                    answer = await unexpected(Request(scope), exc)
                    await answer(scope, receive, sending)
        finally:
            self._record(scope, status[0], time.perf_counter() - started)

    async def _read_body(self, scope: Scope, receive: Receive) -> list[Message] | None:
        """The request's body messages, or None once it is larger than the limit."""
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            return None
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # a disconnect: the app finds out
            size += len(message.get("body", b""))
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return messages

    def _record(self, scope: Scope, status: int, seconds: float) -> None:
        route = scope.get("route")
        template = getattr(route, "path", None) or "unmatched"
        method = scope["method"]
        self.metrics.requests.labels(method, template, str(status)).inc()
        self.metrics.duration.labels(method, template).observe(seconds)
        caller = scope.get("state", {}).get("caller")
        path = scope["path"]
        log.log(
            logging.DEBUG if path in QUIET_PATHS else logging.INFO,
            "%s %s %d",
            method,
            path,
            status,
            extra={
                "action": Action.API_REQUEST,
                "method": method,
                "path": path,
                "status": status,
                "ms": round(seconds * 1000, 1),
                "caller": caller,
            },
        )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _not_json(scope: Scope, body: list[Message]) -> str | None:
    """The media type of a non-empty ``/v1`` body that is not JSON, else ``None`` (no
    ``Content-Type`` is read as JSON, as FastAPI reads it)."""
    if not str(scope.get("path", "")).startswith("/v1/"):
        return None
    if not any(message.get("body") for message in body):
        return None
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media = value.decode("latin-1").split(";", 1)[0].strip().lower()
            if media == "application/json" or media.endswith("+json"):
                return None
            return media or None
    return None


async def _unsupported(scope: Scope, send: Send, media: str) -> None:
    await _answer(
        scope,
        send,
        415,
        "unsupported-media-type",
        title="Unsupported Media Type",
        detail=f"the request body is {media}: send it as application/json",
        header=(b"accept-post", b"application/json"),
    )


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` giving ``messages`` first, then whatever comes next (a disconnect)."""
    pending = list(messages)

    async def replaying() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replaying


async def _too_large(scope: Scope, send: Send, limit: int) -> None:
    await _answer(
        scope,
        send,
        413,
        "body-too-large",
        title="Content Too Large",
        detail=f"the request body is larger than {limit} bytes (OUTBOX_API_MAX_BODY_BYTES)",
        header=(b"connection", b"close"),
        limit=limit,
    )


async def _answer(
    scope: Scope,
    send: Send,
    status: int,
    slug: str,
    *,
    title: str,
    detail: str,
    header: tuple[bytes, bytes],
    **members: Any,
) -> None:
    """A problem document answered here, before the app (which has not read the body)."""
    body = json.dumps(
        {
            "type": TYPE_PREFIX + slug,
            "title": title,
            "status": status,
            "detail": detail,
            "instance": scope["path"],
            **members,
        }
    ).encode()
    headers = [
        (b"content-type", MEDIA_TYPE.encode()),
        (b"content-length", str(len(body)).encode()),
        header,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
