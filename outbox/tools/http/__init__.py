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
and a placeholder's value is encoded as one segment; a value with a dot segment (``..``,
``%2E``…, which WHATWG parsers resolve however encoded) is refused at enqueue, and not sent if
an older row holds one, so no URL normalisation moves it.

Header values (``headers``, and ``env_headers`` read from the environment at load) are
secrets: they are never logged nor put in an error message or a ``repr``.
"""

from outbox.tools.http.load import load_http_tools
from outbox.tools.http.spec import HttpToolSpec
from outbox.tools.http.tool import HttpTool

__all__ = ["HttpTool", "HttpToolSpec", "load_http_tools"]
