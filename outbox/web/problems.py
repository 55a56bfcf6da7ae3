"""RFC 9457 problem details: every error the API answers, as ``application/problem+json``.

One exception, :class:`Problem`, carries an answer; the handlers installed by :func:`install`
turn it, the core's typed errors (:data:`CORE_ERRORS`), FastAPI's validation errors, Starlette's
own (an unknown route, a wrong method) and anything unexpected into a problem document, and
never a stack trace: an unexpected error is logged (without payloads) and answered as a bare
500.

A problem's ``type`` is ``about:blank`` for plain HTTP statuses, else
``urn:agent-outbox:problem:<slug>`` (docs/api.md lists the slugs), and its extension members
(``field``, ``differences``, ``operation_id``, ``errors``…) name what a program needs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from outbox.errors import (
    AlreadyDecided,
    ApprovalMismatch,
    ApprovalRefused,
    BudgetExceeded,
    DatabaseUnavailable,
    IntentAlreadyDone,
    IntentConflict,
    InvalidIntent,
    InvalidSagaRequest,
    NotCancellable,
    OperationBusy,
    OperationNotFound,
    OutboxError,
    PayloadTooLarge,
    ResolutionRefused,
    SagaNotFound,
    SagaNotRunning,
    SchemaNotReady,
    StaleResolution,
    TransitionError,
)
from outbox.logs import Action
from outbox.web.models import UNSTORABLE_TEXT, ProblemOut

log = logging.getLogger(__name__)

MEDIA_TYPE = "application/problem+json"
TYPE_PREFIX = "urn:agent-outbox:problem:"


class Problem(Exception):
    """An answer of status ``status`` as a problem document (raise it from a handler)."""

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        slug: str | None = None,
        title: str | None = None,
        headers: Mapping[str, str] | None = None,
        **extensions: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.type = TYPE_PREFIX + slug if slug else "about:blank"
        self.title = title or HTTPStatus(status).phrase
        self.headers = dict(headers or {})
        self.extensions = {k: v for k, v in extensions.items() if v is not None}

    def response(self, request: Request) -> JSONResponse:
        """The problem document, with its status and headers."""
        body = {
            "type": self.type,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "instance": request.url.path,
            **self.extensions,
        }
        return JSONResponse(body, self.status, headers=self.headers, media_type=MEDIA_TYPE)


# (error class, status, slug), the most specific first: the first class the error is an
# instance of answers. Anything else the core refuses is a 422.
_ANSWERS: tuple[tuple[type[OutboxError], int, str], ...] = (
    (PayloadTooLarge, 413, "payload-too-large"),
    (InvalidIntent, 422, "invalid-intent"),
    (IntentConflict, 422, "intent-conflict"),
    (IntentAlreadyDone, 409, "intent-already-done"),
    (BudgetExceeded, 429, "budget-exceeded"),
    (OperationNotFound, 404, "operation-not-found"),
    (StaleResolution, 412, "stale"),
    (OperationBusy, 409, "busy"),
    (ApprovalMismatch, 409, "payload-hash-mismatch"),
    (AlreadyDecided, 409, "already-decided"),
    (NotCancellable, 409, "not-cancellable"),
    (InvalidSagaRequest, 422, "invalid-request"),
    (SagaNotFound, 404, "saga-not-found"),
    (SagaNotRunning, 409, "saga-not-running"),
    (DatabaseUnavailable, 503, "unavailable"),
    (SchemaNotReady, 503, "schema-not-ready"),
    (TransitionError, 409, "refused"),
)
# The error's identifiers a program may need, copied as extension members when set.
_MEMBERS = (
    "field",
    "limit",
    "size",
    "operation_id",
    "saga_key",
    "state",
    "remote_ref",
    "decided_by",
)
# A budget's refusal: which budget, its window and what is left (numbers kept as numbers).
_BUDGET_MEMBERS = ("budget", "key", "window_s", "measure", "used", "remaining", "asked")


def from_core(exc: OutboxError) -> Problem:
    """The answer to one of the core's refusals: its message as ``detail``, its identifiers
    as extension members (the same rules as the Python API, the same words)."""
    status, slug = next(
        ((status, slug) for kind, status, slug in _ANSWERS if isinstance(exc, kind)),
        (422, "refused"),
    )
    headers: dict[str, str] = {}
    members = {name: _text(getattr(exc, name, None)) for name in _MEMBERS}
    members["limit"], members["size"] = getattr(exc, "limit", None), getattr(exc, "size", None)
    if isinstance(exc, ResolutionRefused | ApprovalRefused) and members["field"]:
        status, slug = 422, "invalid-decision"  # the request itself: an argument at fault
    elif isinstance(exc, ResolutionRefused) and exc.retry_after_s is not None:
        slug = "horizon-not-passed"
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    elif isinstance(exc, OperationBusy):
        headers["Retry-After"] = "1"
    if isinstance(exc, BudgetExceeded):
        # No Retry-After: when room frees up depends on the window's oldest use and on
        # cancellations, not on a time this answer could promise.
        members.update({name: getattr(exc, name) for name in _BUDGET_MEMBERS})
    differences = None
    if isinstance(exc, IntentConflict):
        differences = list(exc.differences)
        members["field"] = differences[0] if differences else None
    return Problem(status, str(exc), slug=slug, headers=headers, differences=differences, **members)


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def install(app: FastAPI) -> None:
    """Answer every error of ``app`` as a problem document."""
    app.add_exception_handler(Problem, _problem)
    app.add_exception_handler(OutboxError, _core)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    # The database's errors by class: answered where the others are (Starlette's exception
    # middleware), so the connection stays open and the access log has the real status. A
    # handler for Exception itself runs in Starlette's outermost middleware, which re-raises
    # to the server (a traceback logged, the keep-alive connection closed): what reaches it
    # is answered by outbox.web.observe first.
    app.add_exception_handler(DBAPIError, unexpected)
    app.add_exception_handler(Exception, unexpected)


async def _problem(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Problem)  # noqa: S101 -- registered for Problem only
    return exc.response(request)


async def _core(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OutboxError)  # noqa: S101 -- registered for OutboxError only
    return from_core(exc).response(request)


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)  # noqa: S101 -- registered for it only
    errors = [_error(error) for error in exc.errors()]
    malformed = next((e for e in exc.errors() if e.get("type") == "json_invalid"), None)
    if malformed is not None:
        return Problem(
            400,
            f"the body is not valid JSON: {malformed.get('ctx', {}).get('error', 'malformed')}",
            slug="malformed-json",
        ).response(request)
    unencodable = next((e for e in exc.errors() if _unencodable_parameter(e)), None)
    if unencodable is not None:
        named = _error(unencodable)
        return Problem(
            400,
            f"{named['field']}: {named['message']}",
            slug="unencodable-parameter",
            field=named["field"],
            errors=[named],
        ).response(request)
    first = errors[0] if errors else {"field": None, "message": "invalid request"}
    where = f"{first['field']}: " if first["field"] else ""
    return Problem(
        422,
        f"{where}{first['message']}"
        + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""),
        slug="invalid-request",
        field=first["field"],
        errors=errors,
    ).response(request)


def _unencodable_parameter(error: Mapping[str, Any]) -> bool:
    """A path or query parameter whose text PostgreSQL cannot store (a NUL, a lone
    surrogate): the URL itself is malformed, a 400 (issue 32), where such text in a body is
    a value the API refuses, a 422."""
    location: Sequence[Any] = error.get("loc", ())
    return (
        error.get("type") == UNSTORABLE_TEXT
        and bool(location)
        and location[0]
        in (
            "path",
            "query",
        )
    )


def _error(error: Mapping[str, Any]) -> dict[str, Any]:
    """One validation error without its input (which may be a payload)."""
    location: Sequence[Any] = error.get("loc", ())
    # ("body", "payload") → "payload"; ("query", "limit") → "limit"; header names as sent;
    # ("body", "steps", 0, "tool") → "steps[0].tool", as the core names a step's field.
    field = ""
    for part in location[1:]:
        field += f"[{part}]" if isinstance(part, int) else f".{part}" if field else str(part)
    return {
        "field": field or None,
        "in": str(location[0]) if location else None,
        "message": str(error.get("msg", "invalid")),
    }


#: FastAPI's detail when decoding a JSON body raised (beyond pydantic's json_invalid).
_UNPARSED = "There was an error parsing the body"


async def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)  # noqa: S101 -- registered for it only
    detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"no such resource: {request.method} {request.url.path} (see /docs)"
    if exc.status_code == 400 and detail == _UNPARSED:  # FastAPI's, e.g. JSON nested too deep
        return Problem(
            400,
            "the body could not be parsed as JSON (is it nested too deeply?)",
            slug="malformed-json",
        ).response(request)
    return Problem(exc.status_code, detail, headers=exc.headers).response(request)


async def unexpected(request: Request, exc: Exception) -> JSONResponse:
    """The answer to an error no handler expects: 422 for a value PostgreSQL refused, 503 when
    the database cannot be reached, else a bare 500 and one log line naming only its type."""
    if isinstance(exc, DataError):  # input the checks let through and the database refused
        return Problem(
            422,
            "a value of the request cannot be stored by PostgreSQL (out of range, or a "
            "character it refuses); nothing was written",
            slug="unstorable-value",
        ).response(request)
    if isinstance(exc, OperationalError | InterfaceError):  # the database is down or gone
        return Problem(
            503,
            "the database cannot be reached; try again",
            slug="unavailable",
            headers={"Retry-After": "1"},
        ).response(request)
    # The type and route only: an exception's message may quote a payload or a statement.
    log.error(
        "unexpected error answering %s %s: %s",
        request.method,
        request.url.path,
        type(exc).__name__,
        extra={"action": Action.API_ERROR, "error": type(exc).__name__},
    )
    return Problem(500, "the server failed to answer; it is logged").response(request)


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route that may answer these error statuses (as problems)."""
    return {
        status: {"model": ProblemOut, "description": HTTPStatus(status).phrase}
        for status in statuses
    }


#: The component every error response's schema refers to (ProblemOut's title).
PROBLEM_SCHEMA = "Problem"


def problem_openapi(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (FastAPI's OpenAPI document) with every error response as
    ``application/problem+json`` of the Problem schema, FastAPI's own 422 included.

    FastAPI publishes :class:`ProblemOut` under its class name; the document publishes it as
    ``Problem`` instead, the one name every error response refers to (so every ``$ref``
    resolves: tests/acceptance/test_api_schema.py walks them)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.pop(ProblemOut.__name__, None)
    components[PROBLEM_SCHEMA] = ProblemOut.model_json_schema(
        ref_template="#/components/schemas/{model}"
    )
    problem = {"$ref": f"#/components/schemas/{PROBLEM_SCHEMA}"}
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            for status, response in operation.get("responses", {}).items():
                if status.isdigit() and int(status) >= 400:
                    response["content"] = {MEDIA_TYPE: {"schema": problem}}
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return schema
