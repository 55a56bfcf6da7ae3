"""The aiohttp transport of HTTP tools: one client per thread's loop, proxies, the send deadline.

This is a dispatch worker's hot path: aiohttp's client costs a third of httpx's async client's
CPU per request. A request is never sent twice: aiohttp's resend of an idempotent method after
a kept-alive connection drops is turned off, redirects are not followed, cookies are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import math
import threading
import urllib.request
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from outbox import tracing
from outbox.errors import SendDeadlinePassed
from outbox.tools.base import ToolCall
from outbox.tools.invoke import is_thread_loop, on_loop_close


@dataclass(frozen=True, slots=True)
class Answer:
    """A response as classified: its status and its whole body."""

    status: int
    content: bytes

    @property
    def is_success(self) -> bool:
        """A 2xx status."""
        return 200 <= self.status < 300


#: What aiohttp raises when the connection never opened (refused, name not resolved, TLS
#: handshake failed, connect or pool wait past its timeout): no byte of the request left.
NEVER_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


async def send(
    client: aiohttp.ClientSession,
    method: str,
    url: URL,
    *,
    headers: dict[str, str],
    body: bytes | None,
    timeout: aiohttp.ClientTimeout,
    template: str,
    propagate: bool,
) -> Answer:
    """Send one request with ``client`` (no redirect followed, proxy from the environment);
    an instrumented client's span shows the URL ``template``, and with ``propagate`` false
    no instrumentation injects a ``traceparent`` (:func:`outbox.tracing.http_request`)."""
    with tracing.http_request(template, propagate=propagate):
        async with client.request(
            method,
            url,
            data=body,
            headers=headers,
            timeout=timeout,
            allow_redirects=False,  # a redirected request would be a second request
            proxy=_env_proxy(url.scheme, url.host or ""),
        ) as response:
            return Answer(response.status, await response.read())


# One client per thread's event loop (outbox.tools.invoke), whose connections it reuses;
# close_thread_loop() closes it before the loop goes.
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = (
    weakref.WeakKeyDictionary()
)
_clients_lock = threading.Lock()


@contextlib.asynccontextmanager
async def http_client() -> AsyncIterator[aiohttp.ClientSession]:
    """The running loop's shared client (a managed thread loop), else one for this call."""
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
SENDING: contextvars.ContextVar[ToolCall | None] = contextvars.ContextVar(
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
        call = SENDING.get()
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
