"""Sagas against the reference service with real processes: the stack's tools and settings,
opening a saga, what the service's ledger says of it, and a receiver of signed webhooks."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session
from standardwebhooks import Webhook

import outbox
from outbox.dev.service import DeployService, Effect
from outbox.models import Operation
from outbox.sagas import Compensate, SagaView
from tests.acceptance.conftest import clean_environment
from tests.integration.test_webhooks import Receiver
from tests.tool_configs import ROLLBACK_TOOL, TOOL, http_tool_toml, rollback_tool_toml

__all__ = ["ROLLBACK_TOOL", "TOOL"]

SECRET = "whsec_" + base64.b64encode(bytes(range(96, 128))).decode()
#: Every process of a saga stack: short timeouts so a lost dispatcher is found in seconds,
#: a sweep (which also advances due sagas) every second, and a lookup lost with a killed
#: worker (the database broker does not redeliver it) routed again after 5 s, not 60.
STACK_ENV = {
    "OUTBOX_SENT_TIMEOUT": "2",
    "OUTBOX_SENT_MAX_AGE": "60",
    "OUTBOX_SWEEP_INTERVAL": "1",
    "OUTBOX_REPUBLISH_AFTER": "2",
    "OUTBOX_LOOKUP_LEASE": "5",
}
#: Both tools' settings: a 1 s call inside a 1 s send deadline; the in-flight horizon is the
#: smallest the contract allows (send deadline + timeout + 5 s), so "not applied" is provable
#: (by a lookup, or by an operator) 7 s after a send.
TOOL_SETTINGS: dict[str, Any] = {
    "timeout_s": 1.0,
    "send_deadline_s": 1.0,
    "inflight_horizon_s": 7,
    "max_attempts": 20,
}


#: Who opens the sagas here: their requested_by, so the agent their keys belong to.
AGENT = "agent-7"


def tools_toml(url: str, **settings: Any) -> str:
    """The create tool and its undo, the rollback tool, on the reference service at ``url``."""
    chosen = {**TOOL_SETTINGS, **settings}
    return http_tool_toml(url, **chosen) + rollback_tool_toml(url, **chosen)


def stack_env(
    database_url: str, broker: str | None, tmp_path: Path, url: str, **more: str
) -> dict[str, str]:
    """The environment of every process of a saga stack on the service at ``url``
    (``broker`` ``None``: the database broker)."""
    config = tmp_path / "tools.toml"
    config.write_text(tools_toml(url), encoding="utf-8")
    env = clean_environment(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_CONFIG=str(config),
        OUTBOX_HOME=str(tmp_path / "home"),
        **STACK_ENV,
        **more,
    )
    if broker is not None:
        env["OUTBOX_BROKER_URL"] = broker
    return env


@dataclass(frozen=True)
class Step:
    """One step to add: a release on ``target``, undone by its rollback unless ``pivot``."""

    name: str
    target: str
    #: Extra payload fields (``_fault`` makes the service fault every request of the step).
    extra: dict[str, Any] = field(default_factory=dict)
    pivot: bool = False
    group: str | None = None
    #: Extra fields of its rollback's payload.
    undo_extra: dict[str, Any] = field(default_factory=dict)


def undo(target: str, **extra: Any) -> Compensate:
    """The rollback of a step's release on ``target``: ``{"release": "{remote_ref}"}``."""
    return Compensate(ROLLBACK_TOOL, target, {"release": "{remote_ref}", **extra})


def open_saga(engine: Engine, key: str, steps: Sequence[Step]) -> list[Operation]:
    """Open saga ``key`` and add ``steps`` (each a release of the create tool), committed
    together; their operations, in order."""
    with Session(engine) as session, session.begin():
        opened = outbox.saga(session, key, requested_by=AGENT)
        return [
            opened.step(
                step.name,
                tool=TOOL,
                target=step.target,
                payload={"version": "1.2.3", "saga": key, "step": step.name, **step.extra},
                compensate=None if step.pivot else undo(step.target, **step.undo_extra),
                pivot=step.pivot,
                group=step.group,
            )
            for step in steps
        ]


def view(engine: Engine, key: str) -> SagaView:
    """The saga as read now (the agent's that opened it: :func:`open_saga`)."""
    with Session(engine) as session:
        found = outbox.get_saga(session, key, agent=AGENT)
    assert found is not None, key
    return found


def rollbacks_of(service: DeployService, saga: SagaView) -> list[Effect]:
    """The service's rollback effects keyed by one of this saga's compensations, in the
    ledger's order."""
    keys = {str(s.compensation_operation_id) for s in saga.steps if s.compensation_operation_id}
    return [e for e in service.ledger() if e.kind == "rollback" and e.key in keys]


def assert_undone_once_in_reverse(
    service: DeployService, saga: SagaView, undone: Sequence[str], *, not_applied: Sequence[str]
) -> None:
    """The service holds one release for each step of the saga except ``not_applied``, and
    exactly the rollbacks of ``undone``'s releases, one each, in reverse saga order."""
    counts = service.effects_by_key()
    steps = {s.name: s for s in saga.steps}
    for step in saga.steps:
        expected = 0 if step.name in not_applied else 1
        assert counts.get(str(step.operation_id), 0) == expected, (step.name, counts)
    order = [s.name for s in saga.steps if s.name in undone][::-1]
    rolled_back = rollbacks_of(service, saga)
    assert [(e.key, e.payload["release"]) for e in rolled_back] == [
        (str(steps[name].compensation_operation_id), steps[name].remote_ref) for name in order
    ]
    for name in order:
        assert counts[str(steps[name].compensation_operation_id)] == 1, name
    assert all(s.compensation_operation_id is None for s in saga.steps if s.name not in undone)


@dataclass(frozen=True)
class Hook:
    """One validly signed webhook: its ``webhook-id`` and its message."""

    id: str
    message: dict[str, Any]


class SignedReceiver:
    """A real HTTP receiver; :meth:`hooks` verifies each request's Standard Webhooks
    signature with :data:`SECRET`, counting the ones that fail."""

    def __init__(self) -> None:
        self.receiver = Receiver()
        self._verifier = Webhook(SECRET)

    @property
    def url(self) -> str:
        """Where the outbox posts."""
        return self.receiver.url

    def hooks(self, kind: str | None = None) -> list[Hook]:
        """The validly signed webhooks (of type ``kind``), in arrival order."""
        verified = []
        for received in list(self.receiver.requests):
            message = self._verified(received.body, received.headers)
            if message is not None and (kind is None or message["type"] == kind):
                verified.append(Hook(received.headers["webhook-id"], message))
        return verified

    def invalid(self) -> int:
        """Requests whose signature did not verify."""
        return sum(self._verified(r.body, r.headers) is None for r in list(self.receiver.requests))

    def _verified(self, body: bytes, headers: dict[str, str]) -> dict[str, Any] | None:
        try:
            message: dict[str, Any] = self._verifier.verify(body, headers)
        except Exception:  # noqa: BLE001 -- any failure to verify is an invalid webhook
            return None
        return message

    def about(self, kind: str, saga_key: str) -> list[Hook]:
        """The validly signed webhooks of type ``kind`` about saga ``saga_key``."""
        return [h for h in self.hooks(kind) if h.message["data"].get("saga_key") == saga_key]

    def bodies(self) -> list[dict[str, Any]]:
        """Every body received, signed or not (for a failing test's output)."""
        return [json.loads(r.body) for r in list(self.receiver.requests)]


@contextmanager
def signed_receiver() -> Iterator[SignedReceiver]:
    """A :class:`SignedReceiver`, closed afterwards."""
    receiving = SignedReceiver()
    try:
        yield receiving
    finally:
        receiving.receiver.close()
