"""The agent-facing API: record an intent, read it back, cancel it, wait for its verdict.

:func:`enqueue` joins the caller's transaction; that is the point of an outbox: the intent is
committed if and only if the agent's own state change is. Nothing here commits on the
caller's behalf, except :func:`wait`, which uses its own connection and writes nothing.
"""

from __future__ import annotations

import difflib
import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict
from uuid import UUID

from sqlalchemy import Engine

from outbox import budgets, sql, trace_context, tracing, transitions, webhooks
from outbox.canonical import NotCanonicalizable, canonical_json, intent_hash, payload_hash
from outbox.config import get_settings
from outbox.contracts import CONTRACTS
from outbox.db import get_engine, translated
from outbox.differences import differing_paths
from outbox.errors import (
    BudgetExceeded,
    IntentAlreadyDone,
    IntentConflict,
    InvalidIntent,
    NotCancellable,
    OperationNotFound,
    PayloadTooLarge,
    WaitTimeout,
)
from outbox.models import Executor, IntentKey, Operation, PrunedIntent
from outbox.payloads import check_payload
from outbox.published import PUBLISHED
from outbox.segments import dot_segment_refusal, has_dot_segment
from outbox.states import State
from outbox.storable import unstorable_text
from outbox.trace_context import TraceContext

#: Dotted names of letters, digits, ``_`` and ``-``: ``deploy.create_release``.
TOOL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*(\.[A-Za-z][A-Za-z0-9_-]*)*")
MAX_TOOL_LENGTH = 128
MAX_TARGET_LENGTH = 1024
MAX_INTENT_KEY_LENGTH = 255
MAX_AGENT_LENGTH = 255
#: The scope of an intent key given neither ``agent`` nor ``requested_by``: the deployment's
#: shared one (a single-agent deployment needs no other).
SHARED_AGENT = ""

# An intent whose key is taken by a row that then vanishes (deleted by retention between our
# INSERT and SELECT) is retried; more than this many misses in a row means something is wrong.
_INSERT_TRIES = 3


def enqueue(  # its errors are translated by enqueue_intent: one layer on the hot path
    session: Executor,
    *,
    tool: str,
    target: str,
    payload: Any,
    intent_key: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    requested_by: str | None = None,
    require_approval: bool = False,
    agent: str | None = None,
) -> Operation:
    """Record the intent to call ``tool`` on ``target`` with ``payload``, in the caller's txn.

    This function joins the transaction of ``session`` (a SQLAlchemy ``Session`` or
    ``Connection``) and does not begin, commit or roll back: the operation exists if and
    only if the caller commits. Until then no relay or worker can see it.

    ``intent_key`` names the intended effect across retries (default: the new operation's
    id). Calling again with the same key and the same tool, target and payload returns the
    existing operation, whatever its state; with any of them different it raises
    :class:`IntentConflict` naming what differs, and writes nothing. Concurrent callers with
    one key end with one operation. A key whose operation finished and was pruned
    (``outbox db prune``) is still remembered: the same intent again raises
    :class:`IntentAlreadyDone` (carrying the operation's id, final state and remote_ref)
    and writes nothing, so it never happens twice; a different one, :class:`IntentConflict`.

    An intent key belongs to its ``agent``: the same key from another agent names another
    operation, and nothing about one agent's operation is in any answer another gets.
    ``agent`` defaults to ``requested_by``, and with neither to the deployment's shared scope
    (``""``: enough for a single agent). The HTTP API and ``outbox mcp`` use the caller's
    agent (its token's, ``OUTBOX_MCP_AGENT``); :func:`find` takes the same ``agent``.

    The payload must be a JSON object; it is canonicalised (RFC 8785) and its sha256 stored,
    and it never changes afterwards. Malformed input raises :class:`InvalidIntent` naming
    the field.

    The tool must be one the deployment knows: this process's loaded tools, if it loaded any;
    else, once any tool is published (each worker publishes its tools' contracts when it
    starts; ``outbox tools publish`` does it without starting one, for a tool whose workers
    have not started yet), one of those. An unknown tool raises :class:`InvalidIntent`
    (``field="tool"``) and a payload its tool's ``input_schema`` refuses
    :class:`~outbox.errors.PayloadInvalid` (``field="payload.amount"``), writing nothing.
    Nothing published at all (a fresh database, no worker started), any tool is accepted.
    A database without the schema raises :class:`~outbox.errors.SchemaNotReady`, one that
    cannot be reached :class:`~outbox.errors.DatabaseUnavailable`.

    The operation is created ``awaiting_approval`` (never published or sent until a person
    approves it: :func:`outbox.approve`) when ``require_approval`` is true or its tool
    requires approval (``approval = "required"``, known from ``outbox.tool_policies`` or
    this process's loaded tools). A call may tighten its tool's policy, never loosen it.

    An intent that would take one of its tool's budgets (``outbox.budgets``, published by the
    workers: docs/budgets.md) over its limit raises :class:`BudgetExceeded` and writes
    nothing; enqueuing a budgeted tool holds the budget key's advisory lock until the caller's
    transaction ends. The same intent again is never refused by a budget nor counted twice.
    """
    return enqueue_intent(
        session,
        Intent(tool, target, payload, intent_key, metadata, requested_by, require_approval, agent),
    ).operation


@dataclass(frozen=True)
class Intent:
    """One intent for :func:`enqueue_many`: the arguments :func:`enqueue` takes."""

    tool: str
    target: str
    payload: Any
    intent_key: str | None = None
    metadata: Mapping[str, Any] | None = field(default=None, hash=False)
    requested_by: str | None = None
    #: Wait for a person's approval before any send, whatever the tool says.
    require_approval: bool = False
    #: The agent whose key it is (default: ``requested_by``, else :data:`SHARED_AGENT`).
    agent: str | None = None

    @property
    def scope(self) -> str:
        """The agent this intent's key belongs to, defaults applied."""
        if self.agent is not None:
            return self.agent
        return self.requested_by if self.requested_by is not None else SHARED_AGENT


@dataclass(frozen=True, slots=True)
class Enqueued:
    """What :func:`enqueue_intent` did: the operation, and whether this call created it."""

    operation: Operation
    #: True: this call recorded the intent; False: it was recorded already (same intent).
    created: bool


@translated
def enqueue_intent(
    session: Executor, intent: Intent, *, announce_approval: bool = True
) -> Enqueued:
    """:func:`enqueue` for one :class:`Intent`, saying whether this call created the operation
    or found the same intent recorded already (the HTTP API answers 201 or 200).

    The same rules, errors and transaction as :func:`enqueue`: it joins the caller's
    transaction and never commits. ``announce_approval=False`` leaves out the
    ``approval_requested`` webhook of an operation created awaiting approval: a saga's held
    step is announced when the saga releases it (:mod:`outbox.sagas`).
    """
    one = _check(session, intent)
    if one.trace is None or not tracing.active():  # no span: no caller's trace, or tracing off
        return _record_intent(session, intent.intent_key, one, announce_approval)
    with tracing.enqueue_spans([tracing.Enqueuing(one.trace, one.tool, one.target)]) as spans:
        if spans:  # the enqueue span's context, recorded in place of the caller's
            one = replace(one, trace=spans.context(0, one.trace))
        enqueued = _record_intent(session, intent.intent_key, one, announce_approval)
        spans.recorded(0, enqueued.operation, created=enqueued.created)
    return enqueued


def _record_intent(
    session: Executor, intent_key: str | None, one: _Checked, announce_approval: bool
) -> Enqueued:
    """Insert a checked intent, or find the same intent recorded already
    (:func:`enqueue_intent`)."""
    tool, target = one.tool, one.target
    for _ in range(_INSERT_TRIES):
        created = sql.intents.insert_intent(
            session,
            intent_key=one.intent_key,
            agent=one.agent,
            tool=one.tool,
            target=one.target,
            canonical_payload=one.canonical_payload,
            payload_hash=one.payload_hash,
            intent_hash=one.intent_hash,
            metadata=one.metadata,
            requested_by=one.requested_by,
            require_approval=one.require_approval,
            approval_ttl_s=one.approval_ttl_s,
            traceparent=one.trace.traceparent if one.trace else None,
            tracestate=one.trace.tracestate if one.trace else None,
        )
        if isinstance(created, sql.intents.Budgeted):
            created = _insert_budgeted(session, [one], created.definitions).get(0)
        if created is not None:
            if created.state is State.AWAITING_APPROVAL and announce_approval:
                webhooks.record_approval_requested(session, created)
            return Enqueued(created, created=True)
        # A generated key is the new operation's id and cannot collide, so intent_key is set.
        existing = sql.intents.find_operation(session, str(intent_key), agent=one.agent)
        if existing is not None:
            _check_same_intent(
                existing,
                tool=tool,
                target=target,
                digest=one.payload_hash,
                canonical=one.canonical_payload,
            )
            return Enqueued(existing, created=False)
        # Not live: pruned, or (rarely) its row was deleted between the two statements, in
        # which case the prune's trigger wrote the pruned intent in the same transaction.
        scoped = IntentKey(one.agent, str(intent_key))
        for pruned in sql.intents.find_pruned_intents(session, [scoped]):
            _refuse_pruned(pruned, tool=tool, target=target, digest=one.payload_hash)
    raise IntentConflict(
        f"intent key {intent_key!r} is being used and removed concurrently; try again",
        intent_key=intent_key,
        agent=one.agent,
        differences=(),
    )


@dataclass(frozen=True)
class _Checked:
    intent_key: str | None
    agent: str
    tool: str
    target: str
    canonical_payload: str
    payload_hash: str
    intent_hash: str
    metadata: dict[str, Any]
    requested_by: str | None
    require_approval: bool
    #: The approval TTL of this process's loaded contract, if it has one (else the policy's).
    approval_ttl_s: float | None
    #: The caller's W3C trace context, if it has one (outbox.trace_context).
    trace: TraceContext | None

    @property
    def scoped_key(self) -> IntentKey | None:
        """The key in its agent's scope; ``None`` for a key left to the operation's id."""
        return IntentKey(self.agent, self.intent_key) if self.intent_key is not None else None


class _Columns(TypedDict):
    intent_keys: list[str | None]
    agents: list[str]
    tools: list[str]
    targets: list[str]
    canonical_payloads: list[str]
    payload_hashes: list[str]
    intent_hashes: list[str]
    metadata: list[str]
    requested_by: list[str | None]
    require_approval: list[bool]
    approval_ttl_s: list[float | None]
    traceparents: list[str | None]
    tracestates: list[str | None]


def _columns(checked: Sequence[_Checked]) -> _Columns:
    """The checked intents as :func:`outbox.sql.intents.insert_intents`' column arguments."""
    return {
        "intent_keys": [c.intent_key for c in checked],
        "agents": [c.agent for c in checked],
        "tools": [c.tool for c in checked],
        "targets": [c.target for c in checked],
        "canonical_payloads": [c.canonical_payload for c in checked],
        "payload_hashes": [c.payload_hash for c in checked],
        "intent_hashes": [c.intent_hash for c in checked],
        "metadata": [json.dumps(c.metadata) for c in checked],
        "requested_by": [c.requested_by for c in checked],
        "require_approval": [c.require_approval for c in checked],
        "approval_ttl_s": [c.approval_ttl_s for c in checked],
        "traceparents": [c.trace.traceparent if c.trace else None for c in checked],
        "tracestates": [c.trace.tracestate if c.trace else None for c in checked],
    }


@translated
def enqueue_many(session: Executor, intents: Iterable[Intent]) -> list[Operation]:
    """Record many intents in the caller's transaction, in one round trip; in input order.

    The batch form of :func:`enqueue`, with the same rules for each intent, for an agent
    that plans several actions at once: the operations exist if and only if the caller
    commits. Every intent is checked before anything is written (:class:`InvalidIntent`
    names the intent's position and field). A key already recorded with the same tool,
    target and payload gives back the existing operation (so does a key repeated inside
    the batch); any difference raises :class:`IntentConflict` and the key of a pruned
    operation :class:`IntentAlreadyDone` (see :func:`enqueue`), and either writes nothing:
    the batch runs under a savepoint that is rolled back. So does :class:`BudgetExceeded`,
    when the batch's budgeted intents together do not fit their budgets (docs/budgets.md).
    """
    checked: list[_Checked] = []
    for position, intent in enumerate(intents):
        if not isinstance(intent, Intent):
            raise InvalidIntent(
                f"intent #{position} is a {type(intent).__name__}, not an outbox.Intent",
                field="intents",
            )
        try:
            checked.append(_check(session, intent))
        except InvalidIntent as exc:
            # The same class and identifiers (field, size, limit...), the position added.
            raise type(exc)(f"intent #{position}: {exc}", **vars(exc)) from None
    if not checked:
        return []
    unique = _unique_keys(checked)
    if all(c.trace is None for c in unique) or not tracing.active():  # no span to make
        return _record_intents(session, checked, unique).all
    with tracing.enqueue_spans(
        [tracing.Enqueuing(c.trace, c.tool, c.target) for c in unique]
    ) as spans:
        if spans:  # the enqueue spans' contexts, recorded in place of the callers'
            traced = {
                id(c): replace(c, trace=spans.context(p, c.trace))
                for p, c in enumerate(unique)
                if c.trace is not None
            }
            unique = [traced.get(id(c), c) for c in unique]
            checked = [traced.get(id(c), c) for c in checked]
        operations = _record_intents(session, checked, unique)
        for position, op in enumerate(operations.unique):
            spans.recorded(position, op, created=position in operations.created)
    return operations.all


@dataclass(frozen=True, slots=True)
class _Recorded:
    #: Every intent's operation, in input order.
    all: list[Operation]
    #: Each unique intent's operation (by position in the unique list).
    unique: list[Operation]
    #: The positions (in the unique list) this call inserted.
    created: set[int]


def _record_intents(
    session: Executor, checked: list[_Checked], unique: list[_Checked]
) -> _Recorded:
    """Insert a batch's unique intents and find those recorded already (:func:`enqueue_many`)."""
    with session.begin_nested():  # a conflict found below rolls the batch back, nothing else
        result = sql.intents.insert_intents(session, **_columns(unique))
        inserted = dict(result.operations)
        if result.budgeted:
            later = _insert_budgeted(session, [unique[p] for p in result.budgeted])
            inserted.update({result.budgeted[i]: op for i, op in later.items()})
        for created in inserted.values():
            if created.state is State.AWAITING_APPROVAL:
                webhooks.record_approval_requested(session, created)
        by_key = {IntentKey(op.agent, op.intent_key): op for op in inserted.values()}
        taken = [k for c in unique if (k := c.scoped_key) is not None and k not in by_key]
        for existing in sql.intents.find_operations(session, taken) if taken else []:
            by_key[IntentKey(existing.agent, existing.intent_key)] = existing
        gone = [key for key in taken if key not in by_key]
        pruned = {
            IntentKey(p.agent, p.intent_key): p
            for p in (sql.intents.find_pruned_intents(session, gone) if gone else [])
        }
        for one in unique:
            scoped = one.scoped_key
            if scoped is None:
                continue
            found = by_key.get(scoped)
            if found is None and scoped in pruned:
                done = pruned[scoped]
                _refuse_pruned(done, tool=one.tool, target=one.target, digest=one.payload_hash)
            if found is None:
                raise IntentConflict(
                    f"intent key {one.intent_key!r} is being used and removed concurrently; "
                    "try again",
                    intent_key=one.intent_key,
                    agent=one.agent,
                    differences=(),
                )
            _check_same_intent(
                found,
                tool=one.tool,
                target=one.target,
                digest=one.payload_hash,
                canonical=one.canonical_payload,
            )
    unnamed = {
        id(one): inserted[position] for position, one in enumerate(unique) if one.intent_key is None
    }

    def operation(one: _Checked) -> Operation:
        scoped = one.scoped_key
        return unnamed[id(one)] if scoped is None else by_key[scoped]

    return _Recorded(
        all=[operation(one) for one in checked],
        unique=[operation(one) for one in unique],
        created=set(inserted),
    )


def _insert_budgeted(
    session: Executor,
    checked: Sequence[_Checked],
    definitions: Sequence[sql.budgets.BudgetDefinition] | None = None,
) -> dict[int, Operation]:
    """Insert intents whose tools have budgets, in the caller's transaction, or raise
    :class:`BudgetExceeded` (writing nothing; the caller's transaction may go on).

    Under each (budget, key)'s transaction-scoped advisory lock, the keys' usage is counted in
    a statement of its own: its snapshot, taken after the locks were granted, holds every
    earlier enqueue of the key that committed, so concurrent enqueuers in any process never
    take a key over its budget (under READ COMMITTED, the default). An intent whose key is
    recorded already is neither refused nor counted again: the insert returns nothing for it
    and the caller returns the recorded operation. Returns the inserted operations by
    position in ``checked``. ``definitions``: the tools' budgets if already read (else read here).
    """
    if definitions is None:
        definitions = sql.budgets.budgets_for(session, [c.tool for c in checked])
    found = [budgets.from_definition(d) for d in definitions]
    wanted = [
        budgets.demands(
            [b for b in found if c.tool in b.tools],
            requested_by=c.requested_by,
            metadata=c.metadata,
            payload=json.loads(c.canonical_payload),
        )
        for c in checked
    ]
    if any(wanted):
        budgets.take_locks(session, [d for ds in wanted for d in ds])
        try:
            budgets.check(
                session,
                [(c.scoped_key, ds) for c, ds in zip(checked, wanted, strict=True)],
            )
        except BudgetExceeded as exc:
            budgets.record_refusal_committed(session, exc)
            raise
    return sql.intents.insert_intents(
        session,
        **_columns(checked),
        usage=[
            sql.intents.UsageRow(position, d.budget.name, d.key, d.cost)
            for position, ds in enumerate(wanted)
            for d in ds
        ],
        budgets_checked=True,
    ).operations


def _check(session: Executor, intent: Intent) -> _Checked:
    _check_tool(intent.tool)
    _check_target(intent.target)
    _check_intent_key(intent.intent_key)
    _check_agent(intent)
    canonical = _canonical_payload(intent.payload)
    digest = payload_hash(canonical)
    if not isinstance(intent.require_approval, bool):
        raise InvalidIntent("require_approval must be True or False", field="require_approval")
    contract = CONTRACTS.get(intent.tool)
    if contract is not None and contract.input_schema is not None:
        check_payload(intent.tool, contract.input_schema, json.loads(canonical))
    if not CONTRACTS.loaded:
        check_published(session, intent.tool, canonical)
    return _Checked(
        intent_key=intent.intent_key,
        agent=intent.scope,
        tool=intent.tool,
        target=intent.target,
        canonical_payload=canonical.decode(),
        payload_hash=digest,
        intent_hash=intent_hash(intent.tool, intent.target, digest),
        metadata=_checked_metadata(intent.metadata),
        requested_by=intent.requested_by,
        # This process's loaded contract counts too (tighten only), with its TTL.
        require_approval=intent.require_approval
        or (contract is not None and contract.approval_required),
        approval_ttl_s=contract.approval_ttl_s if contract is not None else None,
        trace=trace_context.current(),
    )


def _unique_keys(checked: list[_Checked]) -> list[_Checked]:
    """The batch with each agent's named key once; the same key of one agent for different
    intents is refused."""
    seen: dict[IntentKey, _Checked] = {}
    unique: list[_Checked] = []
    for one in checked:
        if one.scoped_key is None:
            unique.append(one)
            continue
        first = seen.setdefault(one.scoped_key, one)
        if first is one:
            unique.append(one)
            continue
        differences = tuple(
            name
            for name in ("tool", "target", "payload_hash")
            if getattr(first, name) != getattr(one, name)
        )
        if differences:
            names = tuple("payload" if d == "payload_hash" else d for d in differences)
            raise IntentConflict(
                f"intent key conflict: {one.intent_key!r} appears twice in the batch with a "
                f"different {', '.join(names)}; nothing was written",
                intent_key=one.intent_key,
                agent=one.agent,
                differences=names,
            )
    return unique


@translated
def known_tool(session: Executor, tool: str) -> bool:
    """Whether this deployment knows ``tool``: this process's loaded tools say so, or, in a
    process that loads none (an agent's, the HTTP API's by default), ``outbox.tool_policies``
    does, where every worker writes its tools when it starts (and ``outbox tools publish``).
    Reads in the caller's txn (:data:`outbox.published.PUBLISHED`: a kept snapshot says yes,
    only a fresh read says no)."""
    if CONTRACTS.loaded:
        return CONTRACTS.get(tool) is not None
    found = PUBLISHED.lookup(session, tool)
    if found.policy is None and found.cached:
        found = PUBLISHED.lookup(session, tool, fresh=True)
    return found.policy is not None


def check_published(
    session: Executor, tool: str, canonical: bytes, *, unresolved: str | None = None
) -> None:
    """Refuse, in a process that loads no tools, a tool the deployment has not published
    (:class:`InvalidIntent`, ``field="tool"``) and a payload its published ``input_schema``
    refuses (:class:`PayloadInvalid` naming the path), once any tool is published; nothing
    published at all, accept. ``canonical``: the payload's canonical JSON; ``unresolved`` as
    :func:`outbox.payloads.check_payload`. A refusal is always decided on a fresh read of
    ``outbox.tool_policies`` (in the caller's transaction), never on a kept snapshot."""
    found = PUBLISHED.lookup(session, tool)
    while True:
        if not found.any:
            return
        try:
            if found.policy is None:
                raise _unpublished(tool, found.policies)
            if found.input_schema is not None:
                payload = json.loads(canonical)
                check_payload(tool, found.input_schema, payload, unresolved=unresolved)
        except InvalidIntent:
            if not found.cached:
                raise
            found = PUBLISHED.lookup(session, tool, fresh=True)
        else:
            return


def _unpublished(tool: str, published: Mapping[str, object]) -> InvalidIntent:
    close = difflib.get_close_matches(tool, list(published), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return InvalidIntent(
        f"unknown tool {tool!r}: no worker of this deployment has published it{hint} "
        f"(published tools: {', '.join(sorted(published))}; a tool is known once a worker "
        "that loads it has started, or after `outbox tools publish`); nothing was written",
        field="tool",
    )


@translated
def get(session: Executor, operation_id: UUID | str) -> Operation | None:
    """The operation with this id, or ``None``. Reads in the caller's transaction."""
    return sql.intents.get_operation(session, _as_uuid(operation_id))


@translated
def find(session: Executor, intent_key: str, *, agent: str = SHARED_AGENT) -> Operation | None:
    """The operation ``agent`` recorded under ``intent_key``, or ``None``: the ``agent`` it
    was enqueued for (:func:`enqueue`'s ``agent``, else its ``requested_by``; default: the
    shared scope). Reads in the caller's transaction."""
    if unstorable_text([intent_key, agent]) is not None:
        return None  # no operation can be stored under it (a NUL, a lone surrogate)
    return sql.intents.find_operation(session, intent_key, agent=agent)


@translated
def find_every_agents(session: Executor, intent_key: str) -> list[Operation]:
    """Every agent's operation recorded under ``intent_key``, by agent: an operator's search
    (an agent reads its own with :func:`find`). Reads in the caller's transaction."""
    if unstorable_text(intent_key) is not None:
        return []
    return sql.intents.find_every_agents(session, intent_key)


@translated
def cancel(session: Executor, operation_id: UUID | str, *, reason: str | None = None) -> Operation:
    """Withdraw a ``planned`` or ``awaiting_approval`` operation that no attempt can have
    reached the remote with.

    Joins the caller's transaction and does not commit. Raises :class:`NotCancellable` when
    the operation is past ``planned`` or an earlier attempt's outcome is in doubt (resolve
    it instead), and :class:`OperationNotFound`.
    """
    op_id = _as_uuid(operation_id)
    current = sql.intents.get_operation(session, op_id)
    if current is None:
        raise OperationNotFound(f"no operation {op_id}", operation_id=op_id)
    if current.state not in (State.PLANNED, State.AWAITING_APPROVAL):
        raise NotCancellable(
            f"operation {op_id} is {current.state.value}; only a planned operation (or one "
            "awaiting approval) can be cancelled",
            operation_id=op_id,
        )
    move = transitions.cancel(
        op_id, reason=reason or "cancelled by the agent", from_state=current.state
    )
    return transitions.apply(session, move).operation


@translated
def wait(
    operation_id: UUID | str,
    timeout: float = 30.0,
    *,
    engine: Engine | None = None,
    poll_interval: float = 1.0,
    through_approval: bool = False,
) -> Operation:
    """Block until the operation is terminal or waits for a person, and return it.

    An operation ``awaiting_approval`` is returned like one that ``needs_human``; with
    ``through_approval=True`` the wait goes on through the approval to the real outcome.

    Sleeps on PostgreSQL ``LISTEN`` (a settled move sends a ``NOTIFY`` for an operation that
    someone waits for: ``outbox.waiters``), re-reading the row at most every
    ``poll_interval`` seconds in case a notification is missed: no busy loop.
    Uses its own connection from ``engine`` (default: the configured database; never a newly
    started embedded server: :func:`outbox.db.database_url`) and writes
    nothing but its own ``outbox.waiters`` row, removed when it returns. Raises
    :class:`WaitTimeout` (carrying the operation as last seen) after ``timeout`` seconds,
    and :class:`OperationNotFound`.
    """
    op_id = _as_uuid(operation_id)
    engine = engine or get_engine()
    deadline = time.monotonic() + timeout
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        # Registered before LISTEN and before the first read: a move committed after the
        # read either finds the registration and notifies, or (a move already under way)
        # is seen at the next re-read.
        sql.intents.register_waiter(conn, op_id)
        sql.notify.listen_settled(conn)
        listener = conn.connection.driver_connection
        try:
            while True:
                current = sql.intents.get_operation(conn, op_id)
                if current is None:
                    raise OperationNotFound(f"no operation {op_id}", operation_id=op_id)
                if current.is_settled and not (
                    through_approval and current.state is State.AWAITING_APPROVAL
                ):
                    return current
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise WaitTimeout(
                        f"operation {op_id} is still {current.state.value} after {timeout:g}s",
                        operation=current,
                    )
                for _ in listener.notifies(  # type: ignore[union-attr]
                    timeout=min(remaining, poll_interval), stop_after=1
                ):
                    pass
        finally:
            sql.notify.unlisten_all(conn)
            # psycopg keeps what arrived before the UNLISTEN for the connection's next
            # notifies(): drained here, the pooled connection's next user hears no stale bell.
            for _ in listener.notifies(timeout=0):  # type: ignore[union-attr]
                pass
            sql.intents.forget_waiter(conn, op_id)


def _as_uuid(value: UUID | str) -> UUID:
    if isinstance(value, UUID):
        return value
    try:
        return UUID(str(value))
    except ValueError:
        raise OperationNotFound(f"{value!r} is not an operation id", operation_id=value) from None


def _check_tool(tool: Any) -> None:
    if not isinstance(tool, str) or not TOOL_NAME.fullmatch(tool) or len(tool) > MAX_TOOL_LENGTH:
        raise InvalidIntent(
            f"tool {tool!r} is not a tool name: dotted words of letters, digits, '_' or '-', "
            f"starting with a letter, at most {MAX_TOOL_LENGTH} characters",
            field="tool",
        )
    if CONTRACTS.loaded and CONTRACTS.get(tool) is None:
        known = ", ".join(CONTRACTS.names()) or "none"
        raise InvalidIntent(f"unknown tool {tool!r}; registered tools: {known}", field="tool")


#: Text PostgreSQL cannot store, refused naming the field (a UnicodeEncodeError before).
_UNSTORABLE = "{} holds a character PostgreSQL cannot store (NUL or a lone surrogate)"


def _check_target(target: Any) -> None:
    if not isinstance(target, str) or not target.strip():
        raise InvalidIntent("target must be a non-empty string", field="target")
    if len(target) > MAX_TARGET_LENGTH:
        raise InvalidIntent(
            f"target is {len(target)} characters; at most {MAX_TARGET_LENGTH} are allowed",
            field="target",
        )
    if unstorable_text(target) is not None:
        raise InvalidIntent(_UNSTORABLE.format("target"), field="target")
    if has_dot_segment(target):
        raise InvalidIntent(dot_segment_refusal("target"), field="target")


def _check_intent_key(intent_key: Any) -> None:
    if intent_key is None:
        return
    if not isinstance(intent_key, str) or not intent_key.strip():
        raise InvalidIntent("intent_key must be a non-empty string", field="intent_key")
    if len(intent_key) > MAX_INTENT_KEY_LENGTH:
        raise InvalidIntent(
            f"intent_key is {len(intent_key)} characters; at most "
            f"{MAX_INTENT_KEY_LENGTH} are allowed",
            field="intent_key",
        )
    if unstorable_text(intent_key) is not None:
        raise InvalidIntent(_UNSTORABLE.format("intent_key"), field="intent_key")
    if has_dot_segment(intent_key):
        raise InvalidIntent(dot_segment_refusal("intent_key"), field="intent_key")


def _check_agent(intent: Intent) -> None:
    field = "agent" if intent.agent is not None else "requested_by"
    agent = intent.scope
    if not isinstance(agent, str):
        raise InvalidIntent(f"{field} must be a string, not {type(agent).__name__}", field=field)
    if len(agent) > MAX_AGENT_LENGTH:
        raise InvalidIntent(
            f"{field} is {len(agent)} characters; an intent's agent is at most {MAX_AGENT_LENGTH}",
            field=field,
        )


def _canonical_payload(payload: Any) -> bytes:
    if not isinstance(payload, Mapping):
        raise InvalidIntent(
            f"payload must be a JSON object, not {type(payload).__name__}", field="payload"
        )
    try:
        canonical = canonical_json(dict(payload))
    except NotCanonicalizable as exc:
        raise InvalidIntent(f"payload is not canonical JSON: {exc}", field="payload") from exc
    limit = get_settings().max_payload_bytes
    if len(canonical) > limit:
        raise PayloadTooLarge(
            f"payload is {len(canonical)} bytes as canonical JSON; the limit is {limit} "
            "(OUTBOX_MAX_PAYLOAD_BYTES)",
            field="payload",
            size=len(canonical),
            limit=limit,
        )
    return canonical


def _checked_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise InvalidIntent(
            f"metadata must be a JSON object, not {type(metadata).__name__}", field="metadata"
        )
    try:
        return dict(json.loads(canonical_json(dict(metadata))))
    except NotCanonicalizable as exc:
        raise InvalidIntent(f"metadata is not JSON: {exc}", field="metadata") from exc


def _refuse_pruned(pruned: PrunedIntent, *, tool: str, target: str, digest: str) -> None:
    """Raise for a key whose operation was pruned: a conflict, or "already done"."""
    _check_same_intent(pruned, tool=tool, target=target, digest=digest)
    ref = f", remote_ref {pruned.remote_ref!r}" if pruned.remote_ref else ""
    raise IntentAlreadyDone(
        f"intent key {pruned.intent_key!r} was already done: operation {pruned.operation_id} "
        f"ended {pruned.state.value}{ref} at {pruned.resolved_at.isoformat()} and was pruned; "
        "nothing was written",
        intent_key=pruned.intent_key,
        operation_id=pruned.operation_id,
        state=pruned.state,
        remote_ref=pruned.remote_ref,
        resolved_at=pruned.resolved_at,
        intent=pruned,
    )


def _check_same_intent(
    existing: Operation | PrunedIntent,
    *,
    tool: str,
    target: str,
    digest: str,
    canonical: str | None = None,
) -> None:
    """Raise :class:`IntentConflict` unless ``existing`` is this intent; its message names
    the payload's own fields that differ when both payloads are at hand (``canonical``: the
    new one's canonical JSON; a pruned intent kept no payload)."""
    differences = tuple(
        name
        for name, same in (
            ("tool", existing.tool == tool),
            ("target", existing.target == target),
            ("payload", existing.payload_hash == digest),
        )
        if not same
    )
    if differences:
        operation_id = existing.id if isinstance(existing, Operation) else existing.operation_id
        pruned = "" if isinstance(existing, Operation) else " (finished and pruned)"
        fields = _differing_fields(existing, differences, canonical)
        raise IntentConflict(
            f"intent key conflict: {existing.intent_key!r} already names operation "
            f"{operation_id}{pruned} with a different {', '.join(fields)}; "
            "nothing was written",
            intent_key=existing.intent_key,
            agent=existing.agent,
            operation_id=operation_id,
            differences=differences,
            fields=fields,
        )


def _differing_fields(
    existing: Operation | PrunedIntent, differences: tuple[str, ...], canonical: str | None
) -> tuple[str, ...]:
    """``differences`` with ``payload`` replaced by the payload's paths that differ
    (``payload.amount``), when the existing operation's payload and the new one are known."""
    if "payload" not in differences or canonical is None or not isinstance(existing, Operation):
        return differences
    paths = differing_paths(existing.payload, json.loads(canonical))
    return tuple(name for name in differences if name != "payload") + tuple(paths or ["payload"])
