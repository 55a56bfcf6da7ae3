"""The console's pages and forms: sign-in, overview, queue, operation, search, decisions,
sagas and a saga's cancel.

Every page but the sign-in form needs a signed-in operator (else a redirect to ``/signin``);
every POST needs the session's CSRF token (else a 403 page, nothing read or written). A
decision locks the operation's row, compares it with what the page showed (its state and
attempt number, carried by the form), and only then runs the core's own function
(:func:`outbox.approval.approve`, :func:`~outbox.approval.reject`,
:func:`outbox.resolve.resolve` with ``expect_attempts``) under the operator's name: of two
operators deciding on the same page, the second waits for the first's commit and is told who
decided what, and when; nothing of theirs is written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote
from uuid import UUID

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.datastructures import FormData

from outbox import approval, operators, sagas, sql
from outbox.errors import (
    AlreadyDecided,
    InvalidSagaRequest,
    OperationNotFound,
    OutboxError,
    SagaNotFound,
    SagaNotRunning,
    StaleTransition,
)
from outbox.logs import Action
from outbox.models import Executor, Operation, iso_utc
from outbox.resolve import resolve
from outbox.saga_rules import SagaState
from outbox.signins import Refusal, Reservation
from outbox.web.console import session, signins, views
from outbox.web.context import context
from outbox.web.models import Text
from outbox.web.problems import from_core

log = logging.getLogger(__name__)

router = APIRouter(include_in_schema=False)

_HERE = Path(__file__).resolve().parent
templates = Jinja2Templates(directory=_HERE.parent / "templates")
_CSS = (_HERE.parent / "static" / "console.css").read_bytes()

#: On every console answer: no framing, no inline script, forms post only here, no caching
#: of pages that show payloads, and no referrer leaking an operation's id elsewhere.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _age(seconds: float | None) -> str:
    """``3 s``, ``4 min``, ``2 h 5 min``, ``3 d 4 h``; ``-`` for none."""
    if seconds is None:
        return "-"
    whole = max(0, int(seconds))
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min"
    if whole < 86400:
        return f"{whole // 3600} h {whole % 3600 // 60} min"
    return f"{whole // 86400} d {whole % 86400 // 3600} h"


def _when(moment: datetime | None) -> str:
    return "-" if moment is None else iso_utc(moment)


def _segment(value: object) -> str:
    """``value`` as one URL path segment or query value, every reserved character encoded,
    ``/`` included: Jinja's ``urlencode`` keeps ``/``, so a saga key ``a/../b`` made a link
    to saga ``b`` once the browser resolved the ``..`` (issue 32). Dot segments are refused
    at creation (:mod:`outbox.segments`); a key from before stays one segment here."""
    return quote(str(value), safe="")


templates.env.filters["age"] = _age
templates.env.filters["when"] = _when
templates.env.filters["segment"] = _segment


def _signins(request: Request) -> signins.Signins:
    found: signins.Signins = request.app.state.console_signins
    return found


def _address(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"


def _page(
    request: Request,
    template: str,
    *,
    operator: str | None,
    status_code: int = 200,
    **values: Any,
) -> HTMLResponse:
    """Render ``template`` with what every page shows: the operator, the CSRF token, the flash."""
    settings = context(request).settings
    flash = request.session.pop("flash", None) if operator is not None else None
    response = templates.TemplateResponse(
        request,
        template,
        {
            "operator": operator,
            "csrf": session.csrf_token(request),
            "flash": flash,
            "flower_url": settings.console_flower_url,
            "metrics_url": settings.console_metrics_url,
            **values,
        },
        status_code=status_code,
    )
    response.headers.update(SECURITY_HEADERS)
    return response


def _to_signin() -> RedirectResponse:
    return RedirectResponse("/signin", status_code=303, headers=SECURITY_HEADERS)


async def _read(request: Request, read: Callable[[Executor], Any]) -> Any:
    """Run ``read`` in one transaction (committed: a sign-in may refresh a hash, or count a
    failure)."""
    async with context(request).engine.begin() as conn:
        return await conn.run_sync(read)


async def _signin_read(request: Request, read: Callable[[Executor], Any]) -> Any:
    """Run ``read`` in one committed transaction on the sign-in's own pool (not the agents')."""
    async with _signins(request).engine.begin() as conn:
        return await conn.run_sync(read)


async def _operator(request: Request) -> str | None:
    """The signed-in operator's name, if the session cookie names a session that has not
    ended, of a live account (else the cookie is cleared)."""
    signed_in = session.signed_in(request)
    if signed_in is None:
        return None
    found: operators.Operator | None = await _read(
        request, lambda sync: operators.session_operator(sync, signed_in.session_id)
    )
    if found is None or found.name != signed_in.name:
        session.sign_out(request)
        return None
    name: str = found.name
    request.scope.setdefault("state", {})["caller"] = name  # the access log names the operator
    return name


async def _form(request: Request) -> FormData | None:
    """The POSTed form, if it carries this session's CSRF token; else ``None`` (logged)."""
    form = await request.form()
    if session.csrf_valid(request, form.get(session.CSRF_FIELD)):
        return form
    log.warning(
        "a form was posted without this session's CSRF token: refused",
        extra={"action": Action.CONSOLE_CSRF_REFUSED, "path": request.url.path},
    )
    return None


def _forbidden(request: Request, operator: str | None) -> HTMLResponse:
    return _page(request, "forbidden.html", operator=operator, status_code=403)


@router.get("/console.css")
async def stylesheet() -> Response:
    """The console's one stylesheet."""
    return Response(_CSS, media_type="text/css", headers={"Cache-Control": "max-age=3600"})


# --- sign-in ------------------------------------------------------------------------------


@router.get("/signin", response_class=HTMLResponse)
async def signin_form(request: Request) -> Response:
    """The sign-in form (carries a CSRF token too: a cross-site page cannot sign you in)."""
    if await _operator(request) is not None:
        return RedirectResponse("/", status_code=303, headers=SECURITY_HEADERS)
    return _page(request, "signin.html", operator=None, name="", error=None)


def _signin_page(
    request: Request, name: str, error: str, status_code: int, *, retry_after_s: int | None = None
) -> HTMLResponse:
    """The sign-in form again with ``error``; a refusal for a while says how long (Retry-After)."""
    response = _page(
        request, "signin.html", operator=None, name=name, error=error, status_code=status_code
    )
    if retry_after_s is not None:
        response.headers["Retry-After"] = str(retry_after_s)
    return response


@router.post("/signin", response_class=HTMLResponse)
async def signin(request: Request) -> Response:
    """Check the name and password (argon2id, on the sign-in's own bounded threads),
    throttled per name and per client address: the attempt is counted before the check."""
    form = await _form(request)
    if form is None:
        return _forbidden(request, None)
    name = str(form.get("name", "")).strip()
    password = str(form.get("password", ""))
    address = _address(request)
    own = _signins(request)
    try:
        with own.checks.admitted() as slot:
            return await _check_signin(
                request, own, slot, name=name, password=password, address=address
            )
    except (signins.Busy, PoolTimeout):  # no thread nor connection for it soon
        own.metrics.refused.labels(reason="busy").inc()
        log.warning(
            "sign-in refused: the password checks are busy",
            extra={
                "action": Action.CONSOLE_SIGNIN_BUSY,
                "operator": name,
                "client": address,
            },
        )
        return _signin_page(
            request,
            name,
            f"Too many sign-ins at once: try again in {signins.BUSY_RETRY_AFTER_S} seconds.",
            503,
            retry_after_s=signins.BUSY_RETRY_AFTER_S,
        )


async def _check_signin(
    request: Request,
    own: signins.Signins,
    slot: signins.Slot,
    *,
    name: str,
    password: str,
    address: str,
) -> Response:
    throttle = own.throttle

    def reserve(sync: Executor) -> tuple[Refusal | Reservation, operators.Credentials | None]:
        reserved = throttle.reserve(sync, name=name, address=address)
        account = operators.credentials(sync, name) if isinstance(reserved, Reservation) else None
        return reserved, account

    reserved, account = await _signin_read(request, reserve)
    if isinstance(reserved, Refusal):
        own.metrics.refused.labels(reason="throttled").inc()
        log.warning(
            "sign-in refused: too many failures",
            extra={
                "action": Action.CONSOLE_SIGNIN_THROTTLED,
                "operator": name,
                "client": address,
                "limited": reserved.what,
            },
        )
        error = (
            f"Too many failed sign-ins from {reserved.what}: wait {reserved.retry_after_s} "
            "seconds, then try again."
        )
        return _signin_page(request, name, error, 429, retry_after_s=reserved.retry_after_s)
    # argon2 holds the CPU for a while: on the sign-in's own threads, not the loop's or the
    # agents'; the attempt is already counted as a failure (the reservation).
    check = await own.checks.run(slot, operators.check_password, account, password)
    own.metrics.password_checks.inc()
    found = check.operator
    if found is None:
        log.warning(
            "sign-in failed",
            extra={"action": Action.CONSOLE_SIGNIN_FAILED, "operator": name, "client": address},
        )
        return _signin_page(request, name, "Wrong name or password.", 401)

    def signed_in(sync: Executor) -> UUID | None:
        operators.store_new_hash(sync, check)
        throttle.succeeded(sync, name=name, reservation=reserved)
        return operators.start_session(sync, found.name)

    session_id = await _signin_read(request, signed_in)
    if session_id is None:  # removed between the check and now
        return _signin_page(request, name, "Wrong name or password.", 401)
    session.sign_in(request, found.name, session_id)
    log.info(
        "operator signed in",
        extra={"action": Action.CONSOLE_SIGNED_IN, "operator": found.name, "client": address},
    )
    return RedirectResponse("/", status_code=303, headers=SECURITY_HEADERS)


@router.post("/signout")
async def signout(request: Request) -> Response:
    """End the session, for good: its row goes, so a copy of the cookie is refused too."""
    signed_in = session.signed_in(request)
    operator = signed_in.name if signed_in is not None else None
    if await _form(request) is None:
        return _forbidden(request, operator)
    if signed_in is not None:
        await _read(request, lambda sync: operators.end_session(sync, signed_in.session_id))
    session.sign_out(request)
    log.info(
        "operator signed out", extra={"action": Action.CONSOLE_SIGNED_OUT, "operator": operator}
    )
    return _to_signin()


# --- pages ----------------------------------------------------------------------------------


@router.get("/", response_class=HTMLResponse)
async def overview(request: Request) -> Response:
    """Operations by state, the oldest wait per state, the decided rate, links."""
    operator = await _operator(request)
    if operator is None:
        return _to_signin()
    found = await _read(request, views.read_overview)
    return _page(request, "overview.html", operator=operator, overview=found)


@router.get("/queue", response_class=HTMLResponse)
async def queue(request: Request) -> Response:
    """The operations waiting for a person, the longest-waiting first, with why."""
    operator = await _operator(request)
    if operator is None:
        return _to_signin()
    found = await _read(request, views.read_queue)
    return _page(request, "queue.html", operator=operator, waiting=found)


@router.get("/search", response_class=HTMLResponse)
async def search(request: Request, q: Text = "") -> Response:
    """Go to the operation whose id or intent key is ``q``; list them when agents share the
    key (each agent's same key is another operation)."""
    operator = await _operator(request)
    if operator is None:
        return _to_signin()
    if not q.strip():
        return _page(request, "search.html", operator=operator, query="", status_code=200)
    found: list[Operation] = await _read(request, lambda sync: views.find_operations(sync, q))
    if not found:
        return _page(request, "search.html", operator=operator, query=q, status_code=404)
    if len(found) > 1:
        return _page(request, "search.html", operator=operator, query=q, found=found)
    return RedirectResponse(f"/operations/{found[0].id}", status_code=303, headers=SECURITY_HEADERS)


@router.get("/operations/{operation_id}", response_class=HTMLResponse)
async def operation_page(request: Request, operation_id: str) -> Response:
    """One operation: payload and hash, attempts, trail, webhooks, the last lookup, actions."""
    operator = await _operator(request)
    if operator is None:
        return _to_signin()
    return await _operation_response(request, operator, operation_id)


async def _operation_response(
    request: Request,
    operator: str,
    operation_id: str,
    *,
    notice: str | None = None,
    status_code: int = 200,
) -> HTMLResponse:
    try:
        parsed = UUID(operation_id)
    except ValueError:
        parsed = None
    view = None
    if parsed is not None:
        view = await _read(request, lambda sync: views.read_operation(sync, parsed))
    if view is None:
        return _page(request, "search.html", operator=operator, query=operation_id, status_code=404)
    return _page(
        request,
        "operation.html",
        operator=operator,
        view=view,
        notice=notice,
        status_code=status_code,
    )


# --- decisions ------------------------------------------------------------------------------


class _Stale(Exception):
    """The row is no longer what the page showed: nothing was written."""


@dataclass(frozen=True, slots=True)
class _Seen:
    """What the page showed, as its form carries it."""

    state: str
    attempts: int
    event_id: int


def _seen(form: FormData) -> _Seen | None:
    try:
        return _Seen(
            state=str(form.get("seen_state", "")),
            attempts=int(str(form.get("expect_attempts", ""))),
            event_id=int(str(form.get("seen_event", ""))),
        )
    except ValueError:
        return None


def _text(form: FormData, field: str) -> str:
    value = form.get(field)
    return value.strip() if isinstance(value, str) else ""


def _under_lock(
    operation_id: UUID, seen: _Seen, decide: Callable[[Executor], Operation]
) -> Callable[[Executor], Operation]:
    """``decide`` in the caller's transaction, once the row is locked and still as seen."""

    def run(sync: Executor) -> Operation:
        current = sql.web.lock_operation(sync, operation_id)
        if current is None:
            raise OperationNotFound(f"no operation {operation_id}", operation_id=operation_id)
        if current.state.value != seen.state or current.attempts != seen.attempts:
            raise _Stale
        return decide(sync)

    return run


def _since(view: views.OperationView, seen: _Seen) -> str:
    """Who decided what, and when, since the page was shown: the events it did not show."""
    newer = [event for event in view.events if event.id > seen.event_id] or view.events[-1:]
    told = "; ".join(f"{event.reason} (at {iso_utc(event.at)})" for event in newer)
    return (
        "Nothing was written: this page was out of date. Since it was shown: "
        f"{told}. The operation is now {view.operation.state.value}."
    )


async def _decide(
    request: Request,
    operation_id: str,
    action: str,
    make: Callable[[str, UUID, FormData, _Seen], Callable[[Executor], Operation]],
) -> Response:
    operator = await _operator(request)
    if operator is None:
        return _to_signin()
    form = await _form(request)
    if form is None:
        return _forbidden(request, operator)
    seen = _seen(form)
    try:
        parsed = UUID(operation_id)
    except ValueError:
        parsed = None
    if seen is None or parsed is None:
        return await _operation_response(
            request,
            operator,
            operation_id,
            notice="The form was incomplete (no state or attempt number): reload the page.",
            status_code=422,
        )
    try:
        async with context(request).engine.begin() as conn:
            moved: Operation = await conn.run_sync(
                _under_lock(parsed, seen, make(operator, parsed, form, seen))
            )
    except (_Stale, AlreadyDecided, StaleTransition):
        return await _stale(request, operator, parsed, seen)
    except OutboxError as exc:
        return await _operation_response(
            request, operator, operation_id, notice=_refused(exc), status_code=_status(exc)
        )
    log.info(
        "operator decided",
        extra={
            "action": Action.CONSOLE_DECIDED,
            "operator": operator,
            "operation_id": str(moved.id),
            "decision": action,
            "state": moved.state.value,
        },
    )
    request.session["flash"] = f"{action} by {operator}: the operation is now {moved.state.value}."
    return RedirectResponse(f"/operations/{moved.id}", status_code=303, headers=SECURITY_HEADERS)


async def _stale(request: Request, operator: str, operation_id: UUID, seen: _Seen) -> Response:
    """The operation page as it is now, saying who decided what since the form's page."""
    view = await _read(request, lambda sync: views.read_operation(sync, operation_id))
    if view is None:
        return await _operation_response(request, operator, str(operation_id))
    return _page(
        request,
        "operation.html",
        operator=operator,
        view=view,
        notice=_since(view, seen),
        status_code=409,
    )


def _refused(exc: OutboxError) -> str | None:
    if isinstance(exc, OperationNotFound):
        return None  # the page says there is no such operation
    return f"Nothing was written: {exc}"


def _status(exc: OutboxError) -> int:
    """The status the HTTP API answers the same refusal with (``problems.from_core``), so
    both surfaces read one way: 404, 409 for a conflict with someone else or with time (busy,
    another payload, the in-flight horizon), 422 for a request refused as asked (a missing
    note, no verdict)."""
    return from_core(exc).status


def _approve(
    operator: str, operation_id: UUID, form: FormData, seen: _Seen
) -> Callable[[Executor], Operation]:
    def decide(sync: Executor) -> Operation:
        return approval.approve(
            sync,
            operation_id,
            by=operator,
            payload_hash=_text(form, "payload_hash"),
            note=_text(form, "note") or None,
        )

    return decide


def _reject(
    operator: str, operation_id: UUID, form: FormData, seen: _Seen
) -> Callable[[Executor], Operation]:
    def decide(sync: Executor) -> Operation:
        return approval.reject(
            sync,
            operation_id,
            by=operator,
            reason=_text(form, "reason"),
        )

    return decide


#: The resolve form's verdicts: (applied, replay).
VERDICTS = {"applied": (True, False), "not_applied": (False, False), "replay": (False, True)}


def _resolve(
    operator: str, operation_id: UUID, form: FormData, seen: _Seen
) -> Callable[[Executor], Operation]:
    verdict = _text(form, "verdict")

    def decide(sync: Executor) -> Operation:
        if verdict not in VERDICTS:
            raise OutboxError("choose a verdict: applied, not applied, or not applied: replay")
        applied, replay = VERDICTS[verdict]
        return resolve(
            sync,
            operation_id,
            applied=applied,
            replay=replay,
            remote_ref=(_text(form, "remote_ref") or None) if applied else None,
            by=operator,
            note=_text(form, "note"),
            expect_attempts=seen.attempts,
        )

    return decide


@router.post("/operations/{operation_id}/approve")
async def approve_operation(request: Request, operation_id: str) -> Response:
    """Approve it, bound to the payload hash the page showed."""
    return await _decide(request, operation_id, "approved", _approve)


@router.post("/operations/{operation_id}/reject")
async def reject_operation(request: Request, operation_id: str) -> Response:
    """Reject it, with a reason."""
    return await _decide(request, operation_id, "rejected", _reject)


@router.post("/operations/{operation_id}/resolve")
async def resolve_operation(request: Request, operation_id: str) -> Response:
    """Resolve it (applied / not applied / replay), bound to the attempt the page showed."""
    return await _decide(request, operation_id, "resolved", _resolve)


# --- sagas ----------------------------------------------------------------------------------


@router.get("/sagas", response_class=HTMLResponse)
async def sagas_page(request: Request, state: str = "") -> Response:
    """The sagas, newest first, optionally only those in one state (``?state=needs_human``)."""
    operator = await _operator(request)
    if operator is None:
        return _to_signin()
    notice: str | None = None
    try:
        wanted = SagaState(state) if state else None
    except ValueError:
        wanted = None
        notice = f"There is no saga state {state!r}: every saga is listed."
    found = await _read(request, lambda sync: views.read_sagas(sync, wanted))
    return _page(
        request,
        "sagas.html",
        operator=operator,
        listing=found,
        states=list(SagaState),
        notice=notice,
        status_code=200 if notice is None else 422,
    )


@router.get("/sagas/{key:path}", response_class=HTMLResponse)
async def saga_page(request: Request, key: Text, agent: Text | None = None) -> Response:
    """One saga (``?agent=`` names whose, when several agents use the key): its state and
    why, its steps as a timeline, what waits for a person, its audit trail, and (running)
    the cancel form."""
    operator = await _operator(request)
    if operator is None:
        return _to_signin()
    return await _saga_response(request, operator, key, agent)


async def _saga_response(
    request: Request,
    operator: str,
    key: str,
    agent: str | None,
    *,
    notice: str | None = None,
    status_code: int = 200,
) -> HTMLResponse:
    found = await _read(request, lambda sync: views.read_saga(sync, key, agent))
    if found is None or isinstance(found, list):
        # None: no such saga; a list: the agents that each have one under the key.
        return _page(
            request,
            "saga_missing.html",
            operator=operator,
            key=key,
            agents=found or [],
            status_code=404 if found is None else 200,
        )
    return _page(
        request, "saga.html", operator=operator, view=found, notice=notice, status_code=status_code
    )


@router.post("/sagas/{key:path}/cancel")
async def cancel_saga(request: Request, key: Text) -> Response:
    """Cancel a running saga under the operator's name (actor ``operator``), with a reason;
    refused, nothing written, once it is no longer running."""
    operator = await _operator(request)
    if operator is None:
        return _to_signin()
    form = await _form(request)
    if form is None:
        return _forbidden(request, operator)
    reason = _text(form, "reason")
    # Whose saga: the page's (each agent's same key is a saga of its own).
    agent = form.get("agent")
    agent = agent if isinstance(agent, str) else ""

    def cancel(sync: Executor) -> sagas.SagaView:
        return sagas.cancel_saga(
            sync, key, by=operator, reason=reason, actor=sagas.OPERATOR, agent=agent
        )

    try:
        async with context(request).engine.begin() as conn:
            done: sagas.SagaView = await conn.run_sync(cancel)
    except SagaNotFound:
        return await _saga_response(request, operator, key, agent)
    except (SagaNotRunning, InvalidSagaRequest) as exc:
        return await _saga_response(
            request,
            operator,
            key,
            agent,
            notice=f"Nothing was written: {exc}",
            status_code=409 if isinstance(exc, SagaNotRunning) else 422,
        )
    log.info(
        "operator cancelled a saga",
        extra={
            "action": Action.CONSOLE_DECIDED,
            "operator": operator,
            "saga_key": key,
            "decision": "saga cancelled",
            "state": done.state.value,
        },
    )
    request.session["flash"] = f"cancelled by {operator}: the saga is now {done.state.value}."
    return RedirectResponse(
        f"/sagas/{quote(done.key, safe='')}?agent={quote(done.agent, safe='')}",
        status_code=303,
        headers=SECURITY_HEADERS,
    )
