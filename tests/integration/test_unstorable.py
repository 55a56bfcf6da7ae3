"""Answers PostgreSQL cannot store as they came (NUL, bytes that are not UTF-8, lone surrogates,
NaN, huge texts) and writes that fail: dispatches and lookups still record an outcome, count,
and reach a decision (issue 17, finding 2)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from outbox import storable
from outbox.contracts import ContractTable
from outbox.reconcilers.lookup import LookupOutcome, lookup
from outbox.states import State
from outbox.tools import Ambiguous, DispatchResult, ToolCall, ToolRegistry, close_thread_loop, tool
from outbox.workers.dispatch import Outcome, dispatch
from tests.factories import events_of, make_operation, poisoned_updates, reload
from tests.tool_configs import http_registry

#: A body with a NUL byte and a byte that is not UTF-8, as a broken proxy might send.
RAW_NUL = b"upstream said: \x00 and \xff\xfe then stopped"


@dataclass
class Answers:
    """What the local remote answers, per method: (status, body bytes)."""

    post: tuple[int, bytes] = (201, b'{"id": "rel-1"}')
    get: tuple[int, bytes] = (404, b"{}")
    seen: list[str] = field(default_factory=list)


class _Server(ThreadingHTTPServer):
    answers: Answers


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_POST(self) -> None:
        self._answer(self.server.answers.post)

    def do_GET(self) -> None:
        self._answer(self.server.answers.get)

    def _answer(self, answer: tuple[int, bytes]) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.server.answers.seen.append(self.command)
        status, body = answer
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Keep the test output clean."""


@pytest.fixture
def answers() -> Iterator[tuple[Answers, str]]:
    """A real HTTP server on 127.0.0.1 answering what the test sets, and its URL."""
    state = Answers()
    server = _Server(("127.0.0.1", 0), _Handler)
    server.answers = state
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    close_thread_loop()
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def poison(engine: Engine) -> Iterator[None]:
    """Refuses any update that leaves an operation row with ``remote_ref = 'poison'``."""
    with poisoned_updates(engine, "NEW.remote_ref = 'poison'"):
        yield


# --- lookups ---------------------------------------------------------------------------------


def test_a_lookup_answering_nul_counts_its_checks_and_reaches_a_human(
    engine: Engine, answers: tuple[Answers, str], tmp_path: Path
) -> None:
    """A lookup whose remote answers with a NUL byte records an escaped, counted check, and
    after max_checks the operation goes to a human instead of being asked again forever."""
    remote, url = answers
    remote.get = (200, RAW_NUL)
    registry = http_registry(tmp_path, url, max_checks=2)
    op = make_operation(engine, State.UNKNOWN)
    first = lookup(op.id, engine=engine, registry=registry)
    assert first.outcome is LookupOutcome.RECHECK
    checked = reload(engine, op.id)
    assert checked.checks == 1
    assert checked.last_error is not None
    assert "\\x00" in checked.last_error
    assert "\\xff\\xfe" in checked.last_error
    assert lookup(op.id, engine=engine, registry=registry).outcome is LookupOutcome.ROUTED
    assert reload(engine, op.id).state is State.NEEDS_HUMAN
    assert remote.seen == ["GET", "GET"]


def test_a_lookup_whose_answer_cannot_be_written_still_counts_and_reaches_a_human(
    engine: Engine, answers: tuple[Answers, str], tmp_path: Path, poison: None
) -> None:
    """A lookup whose outcome write fails for any other reason counts as an inconclusive check
    with a fixed reason, so max_checks still hands the operation to a human."""
    remote, url = answers
    remote.get = (200, b'{"id": "poison"}')
    registry = http_registry(tmp_path, url, max_checks=2)
    op = make_operation(engine, State.UNKNOWN)
    assert lookup(op.id, engine=engine, registry=registry).outcome is LookupOutcome.RECHECK
    checked = reload(engine, op.id)
    assert (checked.state, checked.checks) == (State.UNKNOWN, 1)
    assert checked.last_error == (
        "lookup inconclusive: the outcome could not be recorded: RaiseException"
    )
    assert lookup(op.id, engine=engine, registry=registry).outcome is LookupOutcome.ROUTED
    assert reload(engine, op.id).state is State.NEEDS_HUMAN


# --- dispatch --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "outcome", "state"),
    [
        # JSON escapes that decode to a NUL and a lone surrogate, and a NaN jsonb refuses.
        (
            (201, b'{"id": "rel\\u0000-1", "note": "\\ud800", "score": NaN}'),
            Outcome.CONFIRMED,
            State.CONFIRMED,
        ),
        ((502, RAW_NUL), Outcome.UNKNOWN, State.UNKNOWN),
        ((422, b'{"error": "bad \\u0000 input", "n": Infinity}'), Outcome.FAILED, State.FAILED),
    ],
)
def test_a_dispatch_answered_with_unstorable_bytes_records_its_outcome(
    engine: Engine,
    answers: tuple[Answers, str],
    tmp_path: Path,
    answer: tuple[int, bytes],
    outcome: Outcome,
    state: State,
) -> None:
    """A remote's answer holding NUL, bytes that are not UTF-8, lone surrogates or NaN is
    stored escaped: the attempt's outcome is recorded, not lost."""
    remote, url = answers
    remote.post = answer
    registry = http_registry(tmp_path, url)
    op = make_operation(engine)
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is outcome
    recorded = reload(engine, op.id)
    assert recorded.state is state
    stored = [recorded.remote_ref, recorded.last_error, events_of(engine, op.id)[-1].reason]
    assert not any("\x00" in value for value in stored if value is not None)
    if state is State.CONFIRMED:
        assert recorded.remote_ref == "rel\\x00-1"
        assert recorded.result == {"id": "rel\\x00-1", "note": "\\ud800", "score": "nan"}
    elif state is State.FAILED:
        assert recorded.result == {"error": "bad \\x00 input", "n": "inf"}
    else:
        assert recorded.last_error is not None
        assert "\\x00 and \\xff\\xfe" in recorded.last_error


def test_a_dispatch_whose_outcome_cannot_be_written_goes_to_unknown(
    engine: Engine, answers: tuple[Answers, str], tmp_path: Path, poison: None
) -> None:
    """An attempt whose outcome write fails is not left `sent`: it goes to `unknown`, maybe
    applied, with a fixed reason naming the error class, for the reconciler to take."""
    remote, url = answers
    remote.post = (201, b'{"id": "poison"}')
    registry = http_registry(tmp_path, url)
    op = make_operation(engine)
    report = dispatch(op.id, engine=engine, registry=registry)
    assert report.outcome is Outcome.UNKNOWN
    recorded = reload(engine, op.id)
    assert recorded.state is State.UNKNOWN
    assert recorded.maybe_applied
    reason = "the outcome (confirmed) could not be recorded: RaiseException"
    assert recorded.last_error == reason
    assert events_of(engine, op.id)[-1].reason == reason


def test_a_stored_reason_is_bounded(engine: Engine) -> None:
    """A huge reason from a tool is cut to storable.MAX_TEXT_CHARS in last_error and the event."""
    registry = ToolRegistry(ContractTable())
    op = make_operation(engine, tool="chatty.call")

    @tool("chatty.call", registry=registry)
    def chatty(call: ToolCall) -> DispatchResult:
        return Ambiguous("x" * 100_000)

    assert dispatch(op.id, engine=engine, registry=registry).outcome is Outcome.UNKNOWN
    recorded = reload(engine, op.id)
    assert recorded.last_error is not None
    assert len(recorded.last_error) == storable.MAX_TEXT_CHARS
    assert recorded.last_error.endswith(storable.TRUNCATED)
    assert len(events_of(engine, op.id)[-1].reason) == storable.MAX_TEXT_CHARS
