"""The outbox tables, in their own PostgreSQL schema ``outbox``.

These SQLAlchemy Core tables are the canonical shape: the Alembic migrations must produce
exactly them (``tests/integration/test_migrations.py`` compares the two). Invariants live here
as CHECK constraints (the operation row's in a function of migration 0009, each rule named),
so a bug in any component cannot store an impossible row; triggers (migrations 0010, 0011)
keep an operation's identity unchanged, its events as long as it lives, and its intent
remembered in ``pruned_intents`` once it is deleted.
Every timestamp defaults to ``clock_timestamp()``: the database clock decides, never a host's.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Double,
    ForeignKey,
    ForeignKeyConstraint,
    Identity,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TIMESTAMP, UUID

from outbox.states import LIVE_STATES, State

SCHEMA = "outbox"

metadata = MetaData(
    schema=SCHEMA,
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    },
)

NOW = text("clock_timestamp()")


def _timestamp(name: str, *, nullable: bool = True, now: bool = False) -> Column[object]:
    return Column(
        name,
        TIMESTAMP(timezone=True),
        nullable=nullable,
        server_default=NOW if now else None,
    )


operations = Table(
    "operations",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("outbox.uuid_v7()")),
    Column("intent_key", Text, nullable=False),
    Column("tool", Text, nullable=False),
    Column("target", Text, nullable=False),
    Column("payload", JSONB, nullable=False),
    Column("payload_hash", Text, nullable=False),
    Column("state", Text, nullable=False, server_default=State.PLANNED.value),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("checks", Integer, nullable=False, server_default="0"),
    Column("maybe_applied", Boolean, nullable=False, server_default=text("false")),
    Column("remote_ref", Text),
    Column("result", JSONB),
    Column("last_error", Text),
    Column("metadata", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("requested_by", Text),
    _timestamp("created_at", nullable=False, now=True),
    _timestamp("updated_at", nullable=False, now=True),
    _timestamp("available_at", nullable=False, now=True),
    _timestamp("published_at"),
    _timestamp("first_sent_at"),
    _timestamp("sent_at"),
    _timestamp("next_check_at"),
    _timestamp("replay_deadline"),
    _timestamp("resolved_at"),
    # Attempts before this count no more against max_attempts: set by an operator's replay.
    Column("attempt_budget_base", Integer, nullable=False, server_default="0"),
    # sha256 of (tool, target, payload_hash), written at enqueue: the dispatcher checks it
    # before every send (outbox.canonical.intent_hash; migration 0010).
    Column("intent_hash", Text, nullable=False),
    # Approval before send (migration 0012): required by the tool or the call at enqueue; the
    # approval expires at the database clock's enqueue time plus the tool's TTL; a decision
    # records who and when, and an approval the payload hash the approver saw.
    Column("approval_required", Boolean, nullable=False, server_default=text("false")),
    _timestamp("approval_expires_at"),
    Column("decided_by", Text),
    _timestamp("decided_at"),
    Column("approved_payload_hash", Text),
    # The agent the intent key belongs to (migration 0023; ``''``: the deployment's shared
    # scope): the same key from two agents names two operations. Key first in the unique
    # rule, so a search by key alone (an operator's) reads the same index.
    Column("agent", Text, nullable=False, server_default=text("''")),
    UniqueConstraint("intent_key", "agent"),
    # The caller's W3C trace context at enqueue (migration 0026; NULL without a caller's
    # trace): later stages' spans join that trace. Immutable like the payload.
    Column("traceparent", Text),
    Column("tracestate", Text),
    # The operation's advisory-lock key, written at enqueue (migration 0027; NULL on older
    # rows): a worker's take claims and locks the row in one statement (issue 35).
    Column("lock_key", BigInteger),
    # The row's fifteen invariants (the state machine's, the key's and the hash's shapes), in
    # one PL/pgSQL function that names the rule a bad row breaks (ck_operations_state_known,
    # ck_operations_sent_has_attempt, ...): PostgreSQL prepares every CHECK expression again
    # for each statement, and twelve of them doubled the cost of a move (migration 0009).
    CheckConstraint(
        "outbox.operation_invariants_hold(state, intent_key, tool, target, payload_hash,"
        " attempts, checks, attempt_budget_base, maybe_applied, remote_ref, first_sent_at,"
        " sent_at, resolved_at, approval_required, approval_expires_at, decided_by, decided_at,"
        " approved_payload_hash)",
        name="invariants",
    ),
    # The live queues each component scans: partial, so terminal rows cost nothing.
    Index("ix_operations_planned_due", "available_at", postgresql_where=text("state = 'planned'")),
    # The relay's claim, in two halves (migration 0022): rows never published, by due time;
    # then published rows, by publish time, so rows published recently (waiting for a worker)
    # are outside the scanned range rather than stepped over one heap fetch each.
    Index(
        "ix_operations_planned_unpublished",
        "available_at",
        postgresql_where=text("state = 'planned' AND published_at IS NULL"),
    ),
    Index(
        "ix_operations_planned_published",
        "published_at",
        postgresql_where=text("state = 'planned' AND published_at IS NOT NULL"),
    ),
    Index("ix_operations_sent_since", "sent_at", postgresql_where=text("state = 'sent'")),
    Index(
        "ix_operations_unknown_next_check",
        "next_check_at",
        postgresql_where=text("state = 'unknown'"),
    ),
    Index(
        "ix_operations_needs_human_since",
        "updated_at",
        postgresql_where=text("state = 'needs_human'"),
    ),
    # The sweep's expiry of approvals nobody gave in time.
    Index(
        "ix_operations_awaiting_approval_expires",
        "approval_expires_at",
        postgresql_where=text("state = 'awaiting_approval'"),
    ),
    # Retention (`outbox db prune`): terminal rows by age, so a prune reads only what it deletes.
    Index(
        "ix_operations_resolved_at",
        "resolved_at",
        postgresql_where=text("resolved_at IS NOT NULL"),
    ),
)

events = Table(
    "events",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column(
        "operation_id",
        UUID(as_uuid=True),
        ForeignKey("outbox.operations.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("from_state", Text),
    Column("to_state", Text, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("actor", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("detail", JSONB),
    _timestamp("at", nullable=False, now=True),
    Index("ix_events_operation_id_id", "operation_id", "id"),
)

#: The states in which some component still has work to do; used by monitoring queries.
LIVE_STATE_VALUES = tuple(sorted(state.value for state in LIVE_STATES))

#: What identifies each deleted (pruned) operation, written by a trigger in the statement that
#: deletes it (migration 0011): ``enqueue`` of its key returns "already done" instead of a
#: second operation. Never the payload: the hash identifies it.
pruned_intents = Table(
    "pruned_intents",
    metadata,
    Column("intent_key", Text, primary_key=True),
    Column("operation_id", UUID(as_uuid=True), nullable=False),
    Column("tool", Text, nullable=False),
    Column("target", Text, nullable=False),
    Column("payload_hash", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("remote_ref", Text),
    Column("attempts", Integer, nullable=False),
    _timestamp("created_at", nullable=False),
    _timestamp("first_sent_at"),
    _timestamp("resolved_at", nullable=False),
    _timestamp("pruned_at", nullable=False, now=True),
    # The operation's agent (migration 0023): its key is done for that agent only; a row
    # pruned before agents were recorded has ``all_agents``, its key done for every agent.
    Column("agent", Text, primary_key=True, server_default=text("''")),
    Column("all_agents", Boolean, nullable=False, server_default=text("false")),
    # Their own retention (`outbox db prune --forget-intents-older-than`).
    Index("ix_pruned_intents_resolved_at", "resolved_at"),
)

#: Each tool's approval policy (migration 0012) and payload schema (0024), upserted by every
#: process that loads the tools (workers, relay, beat) and by ``outbox tools publish``:
#: ``enqueue`` reads the policy in its INSERT, since an agent process usually loads no tools,
#: and refuses a tool not found here, or a payload its ``input_schema`` refuses, once any tool
#: is (outbox/published.py). A tool not found here requires no approval (unless the call asks).
tool_policies = Table(
    "tool_policies",
    metadata,
    Column("tool", Text, primary_key=True),
    Column("approval_required", Boolean, nullable=False),
    Column("approval_ttl_s", Double, nullable=False),
    _timestamp("updated_at", nullable=False, now=True),
    # The JSON Schema every payload must match; NULL: the tool declares none.
    Column("input_schema", JSONB),
    CheckConstraint("approval_ttl_s > 0", name="ttl_positive"),
)

#: Running relays. ``idle`` says one sleeps on LISTEN, so ``enqueue`` rings the bell only then.
relays = Table(
    "relays",
    metadata,
    Column("name", Text, primary_key=True),
    Column("pid", Integer, nullable=False),
    Column("host", Text, nullable=False),
    Column("idle", Boolean, nullable=False, server_default=text("false")),
    _timestamp("started_at", nullable=False, now=True),
    _timestamp("heartbeat_at", nullable=False, now=True),
    # The session that wrote the flag (migration 0028): once it is gone the flag no longer
    # counts, whatever its heartbeat's age (NULL: written before 0028, the heartbeat decides).
    Column("backend_pid", Integer),
)

#: Callers of ``outbox.wait`` listening for an operation to settle, one row per waiting
#: session: a move into a settled state NOTIFYs only for an operation found here. (A NOTIFY
#: holds a cluster-wide lock from before its commit until the commit is flushed, so a
#: NOTIFY on every settled move made the workers' outcome commits wait for one another.)
waiters = Table(
    "waiters",
    metadata,
    Column("operation_id", UUID(as_uuid=True), primary_key=True),
    Column("backend_pid", Integer, primary_key=True),
    _timestamp("since", nullable=False, now=True),
)

#: Escalation webhooks waiting to be delivered, delivered, or given up on (docs/webhooks.md).
#: A row is written in the same transaction as the move it reports, so no committed move can
#: lose its webhook; its ``id`` is the ``webhook-id`` header, the same on every retry, so
#: receivers can deduplicate. ``payload`` is the message body, fixed when the row is written.
webhook_deliveries = Table(
    "webhook_deliveries",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("outbox.uuid_v7()")),
    Column(
        "operation_id",
        UUID(as_uuid=True),
        ForeignKey("outbox.operations.id", ondelete="CASCADE"),
    ),
    Column("event", Text, nullable=False),
    Column("payload", JSONB, nullable=False),
    Column("status", Text, nullable=False, server_default="pending"),
    Column("attempts", Integer, nullable=False, server_default="0"),
    _timestamp("next_attempt_at", nullable=False, now=True),
    Column("last_status", Integer),
    Column("last_error", Text),
    _timestamp("created_at", nullable=False, now=True),
    _timestamp("delivered_at"),
    #: What a delivery without an operation is about: a guard or budget key (migration 0016).
    Column("subject", Text),
    CheckConstraint(
        "event IN ('approval_expired', 'approval_requested', 'budget_exhausted',"
        " 'circuit_closed', 'circuit_opened', 'confirmed', 'failed', 'needs_human', 'resolved',"
        " 'saga_compensated', 'saga_needs_human')",
        name="event_known",
    ),
    CheckConstraint("operation_id IS NOT NULL OR subject IS NOT NULL", name="about_something"),
    CheckConstraint("status IN ('abandoned', 'delivered', 'pending')", name="status_known"),
    CheckConstraint("attempts >= 0", name="attempts_not_negative"),
    CheckConstraint(
        "(status = 'delivered') = (delivered_at IS NOT NULL)", name="delivered_iff_delivered_at"
    ),
    # The deliverer's queue: partial, so delivered and abandoned rows cost nothing.
    Index(
        "ix_webhook_deliveries_pending_due",
        "next_attempt_at",
        postgresql_where=text("status = 'pending'"),
    ),
    Index("ix_webhook_deliveries_operation_id", "operation_id"),
)

#: Bearer tokens of the HTTP API (migration 0013; ``outbox tokens create|list|revoke``). A
#: token's ``name`` is the identity the API records (``requested_by``, the decider), so it is
#: unique for good, even once revoked: a name in the audit trail names one token's holder.
#: Only the sha256 of the token is stored: a token is 256 random bits, so a fast hash is as
#: hard to reverse as a slow one (argon2 is for passwords, which are guessable), and a fast
#: hash lets each request find its token with one index probe.
api_tokens = Table(
    "api_tokens",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("outbox.uuid_v7()")),
    Column("name", Text, nullable=False),
    Column("scope", Text, nullable=False),
    Column("token_hash", Text, nullable=False),
    _timestamp("created_at", nullable=False, now=True),
    _timestamp("last_used_at"),
    _timestamp("revoked_at"),
    # The agent this token speaks for (migration 0023): its intent keys' scope. Its own name
    # unless made with ``--agent``, so another token of one agent (a rotation) keeps the scope.
    Column("agent", Text, nullable=False),
    UniqueConstraint("name"),
    UniqueConstraint("token_hash"),
    CheckConstraint("scope IN ('agent', 'operator')", name="scope_known"),
    CheckConstraint("char_length(name) BETWEEN 1 AND 128", name="name_length"),
    CheckConstraint("char_length(agent) BETWEEN 1 AND 128", name="agent_length"),
    CheckConstraint(
        "octet_length(token_hash) = 64 AND ltrim(token_hash, '0123456789abcdef') = ''",
        name="token_hash_sha256",
    ),
)

#: Operator accounts of the console (migration 0014; ``outbox operators add|list|remove``). A
#: name is the identity recorded as the decider of what its operator decides in the console,
#: so it is unique for good, even once removed. The password is kept as its argon2id hash: a
#: person's password is guessable, so a slow, salted hash, unlike an API token's sha256.
operators = Table(
    "operators",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("outbox.uuid_v7()")),
    Column("name", Text, nullable=False),
    Column("password_hash", Text, nullable=False),
    _timestamp("created_at", nullable=False, now=True),
    _timestamp("removed_at"),
    UniqueConstraint("name"),
    CheckConstraint("char_length(name) BETWEEN 1 AND 128", name="name_length"),
    CheckConstraint("password_hash LIKE '$argon2id$%'", name="password_hash_argon2id"),
)

#: Failed sign-ins at the console (migration 0015), one row per failure and per key it counts
#: against: the name tried and the client's address. The sign-in throttle
#: (:mod:`outbox.signins`) counts the recent ones; every ``outbox api`` worker process shares
#: them. Rows older than the throttle's window are deleted as new failures come in.
signin_failures = Table(
    "signin_failures",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("kind", Text, nullable=False),
    Column("value", Text, nullable=False),
    _timestamp("failed_at", nullable=False, now=True),
    CheckConstraint("kind IN ('name', 'address')", name="kind_known"),
    CheckConstraint("char_length(value) <= 128", name="value_length"),
    Index("ix_signin_failures_kind_value_failed_at", "kind", "value", "failed_at"),
    Index("ix_signin_failures_failed_at", "failed_at"),
)

#: The console's signed-in sessions (migration 0025): the session cookie carries the id, and
#: every console request reads the row with its account. Sign-out, ``outbox operators
#: sign-out-all``, a password change and a removal delete rows: those sessions end at once.
#: Rows older than a session's longest life are deleted as new sessions start.
console_sessions = Table(
    "console_sessions",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True, server_default=text("gen_random_uuid()")),
    Column(
        "operator_id",
        UUID(as_uuid=True),
        ForeignKey("outbox.operators.id", ondelete="CASCADE"),
        nullable=False,
    ),
    _timestamp("started_at", nullable=False, now=True),
    Index("ix_console_sessions_operator_id", "operator_id"),
    Index("ix_console_sessions_started_at", "started_at"),
)

#: The circuit breakers (:mod:`outbox.guards`): one row per scope (``dispatch`` or ``lookup``),
#: tool and target (``''``: the whole tool), written by the first outcome that counts; no row
#: means closed. Shared by every process; judged by the database's clock.
guard_breakers = Table(
    "guard_breakers",
    metadata,
    Column("scope", Text, primary_key=True),
    Column("tool", Text, primary_key=True),
    Column("target", Text, primary_key=True),
    Column("state", Text, nullable=False, server_default=text("'closed'")),
    Column("failures", Integer, nullable=False, server_default=text("0")),
    _timestamp("window_started_at"),
    Column("window_calls", Integer, nullable=False, server_default=text("0")),
    Column("window_failures", Integer, nullable=False, server_default=text("0")),
    _timestamp("opened_at"),
    _timestamp("open_until"),
    Column("probe_operation_id", UUID(as_uuid=True)),
    _timestamp("probe_until"),
    _timestamp("updated_at", nullable=False, now=True),
    CheckConstraint("scope IN ('dispatch', 'lookup')", name="scope_known"),
    CheckConstraint("state IN ('closed', 'open', 'half_open')", name="state_known"),
    CheckConstraint("state = 'closed' OR open_until IS NOT NULL", name="open_has_until"),
)

#: The rate limits' buckets (GCRA): the theoretical arrival time per tool and target.
guard_buckets = Table(
    "guard_buckets",
    metadata,
    Column("tool", Text, primary_key=True),
    Column("target", Text, primary_key=True),
    _timestamp("tat", nullable=False),
)

#: Who reset a guard, when and why (`outbox guards reset`): append-only.
guard_resets = Table(
    "guard_resets",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("guard", Text, nullable=False),
    Column("tool", Text, nullable=False),
    Column("target", Text, nullable=False),
    Column("reset_by", Text, nullable=False),
    Column("note", Text, nullable=False),
    _timestamp("reset_at", nullable=False, now=True),
    CheckConstraint("guard IN ('breaker', 'lookup_breaker', 'rate')", name="guard_known"),
)

#: Declared budgets (migration 0018), upserted by every worker at start from its loaded
#: declarations (``[budgets."name"]`` in ``OUTBOX_CONFIG``, ``outbox.tools.budget``):
#: ``enqueue`` reads them, since an agent process usually loads no configuration.
budgets = Table(
    "budgets",
    metadata,
    Column("name", Text, primary_key=True),
    Column("tools", ARRAY(Text), nullable=False),
    # ``requested_by`` or ``metadata.<key>``: what one budget key is.
    Column("counted_by", Text, nullable=False),
    Column("window_s", Double, nullable=False),
    Column("max_operations", BigInteger),
    # ``payload.<path>``: where each operation's cost is read, with ``max_cost``.
    Column("cost_path", Text),
    Column("max_cost", Double),
    _timestamp("updated_at", nullable=False, now=True),
    CheckConstraint("window_s > 0", name="window_positive"),
    CheckConstraint("max_operations > 0", name="max_operations_positive"),
    CheckConstraint("max_cost > 0", name="max_cost_positive"),
    CheckConstraint("max_operations IS NOT NULL OR max_cost IS NOT NULL", name="has_limit"),
    CheckConstraint("(cost_path IS NULL) = (max_cost IS NULL)", name="cost_with_max"),
)

#: What each budgeted operation used (migration 0018): one row per (budget, operation),
#: written by the INSERT that records the operation. ``enqueue`` counts a key's rows inside the
#: window and deletes the rows older than it. A ``cancelled`` operation's rows are deleted by
#: the trigger ``operations_return_budget_share`` (migration 0021) as it is cancelled: its
#: share is given back. No foreign key: a pruned operation still counted when it ran.
budget_usage = Table(
    "budget_usage",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("budget", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("operation_id", UUID(as_uuid=True), nullable=False),
    Column("cost", Double, nullable=False, server_default="0"),
    _timestamp("used_at", nullable=False, now=True),
    CheckConstraint("cost >= 0", name="cost_not_negative"),
    # A key's count inside its window: an index-only scan (``cost`` carried, migration 0021).
    Index(
        "ix_budget_usage_budget_key_used_at_cost",
        "budget",
        "key",
        "used_at",
        postgresql_include=["cost"],
    ),
    # A cancelled operation's rows, deleted by its trigger.
    Index("ix_budget_usage_operation_id", "operation_id"),
    # The expired rows of keys never counted again, dropped a few at a time by other keys.
    Index("ix_budget_usage_budget_used_at", "budget", "used_at"),
)

#: When each budget key was last found exhausted (migration 0018): the ``budget_exhausted``
#: webhook is recorded once per key and window, not per refused call; ``refusals`` counts
#: every refused enqueue (the metrics' counter).
budget_alerts = Table(
    "budget_alerts",
    metadata,
    Column("budget", Text, primary_key=True),
    Column("key", Text, primary_key=True),
    _timestamp("exhausted_at", nullable=False, now=True),
    Column("refusals", BigInteger, nullable=False, server_default="0"),
)

#: Sagas (migration 0019; docs/sagas.md): several operations that succeed together or are
#: undone together. ``state`` is the saga's, moved only by :mod:`outbox.sagas`;
#: ``cancelled_by`` says an agent or operator asked to cancel it (``outbox.cancel_saga``);
#: ``next_check_at`` is when the periodic pass looks at a live saga again.
SAGA_STATE_VALUES = (
    "running",
    "compensating",
    "completed",
    "compensated",
    "needs_human",
    "cancelled",
)
sagas = Table(
    "sagas",
    metadata,
    Column("key", Text, primary_key=True),
    # The agent whose saga key it is (migration 0023; ``''``: the shared scope): another
    # agent's same key is another saga.
    Column("agent", Text, primary_key=True, server_default=text("''")),
    Column("state", Text, nullable=False, server_default="running"),
    Column("reason", Text),
    Column("requested_by", Text),
    Column("cancelled_by", Text),
    _timestamp("created_at", nullable=False, now=True),
    _timestamp("updated_at", nullable=False, now=True),
    _timestamp("next_check_at", nullable=False, now=True),
    CheckConstraint(
        "state IN ('cancelled', 'compensated', 'compensating', 'completed', 'needs_human',"
        " 'running')",
        name="state_known",
    ),
    CheckConstraint("char_length(key) BETWEEN 1 AND 160", name="key_length"),
    # The periodic pass's queue: partial, so finished sagas cost nothing.
    Index(
        "ix_sagas_live_next_check_at",
        "next_check_at",
        postgresql_where=text("state IN ('compensating', 'needs_human', 'running')"),
    ),
)

#: A saga's steps in order (``position`` from 0); consecutive steps with one ``grp`` run in
#: parallel. Each step is one operation; its declared compensation (tool, target, payload,
#: or none) becomes ``compensation_operation_id`` once the saga undoes it. A held step's
#: operation waits with ``available_at`` far in the future (:data:`outbox.sagas.HELD_UNTIL`);
#: ``approval_ttl_s`` keeps its approval's TTL, restarted when it is released. The
#: operations' foreign keys are SET NULL: retention never prunes a live saga's operations.
saga_steps = Table(
    "saga_steps",
    metadata,
    Column("saga_key", Text, nullable=False),
    Column("agent", Text, nullable=False, server_default=text("''")),
    Column("position", Integer, nullable=False),
    Column("name", Text, nullable=False),
    # Its operation's intent key, as recorded (migration 0023: older sagas keep their form).
    Column("intent_key", Text, nullable=False),
    Column("grp", Text),
    Column("pivot", Boolean, nullable=False, server_default=text("false")),
    Column(
        "operation_id",
        UUID(as_uuid=True),
        ForeignKey("outbox.operations.id", ondelete="SET NULL"),
    ),
    Column("compensate_tool", Text),
    Column("compensate_target", Text),
    Column("compensate_payload", JSONB),
    Column(
        "compensation_operation_id",
        UUID(as_uuid=True),
        ForeignKey("outbox.operations.id", ondelete="SET NULL"),
    ),
    Column("approval_ttl_s", Double),
    _timestamp("released_at"),
    _timestamp("created_at", nullable=False, now=True),
    PrimaryKeyConstraint("saga_key", "agent", "position"),
    ForeignKeyConstraint(
        ["saga_key", "agent"], ["outbox.sagas.key", "outbox.sagas.agent"], ondelete="CASCADE"
    ),
    UniqueConstraint("saga_key", "agent", "name"),
    CheckConstraint("position >= 0", name="position_not_negative"),
    CheckConstraint(
        "(compensate_tool IS NULL) = (compensate_target IS NULL)"
        " AND (compensate_tool IS NULL) = (compensate_payload IS NULL)",
        name="compensation_whole",
    ),
    CheckConstraint("NOT (pivot AND compensate_tool IS NOT NULL)", name="pivot_not_compensated"),
    Index("ix_saga_steps_operation_id", "operation_id"),
    Index("ix_saga_steps_compensation_operation_id", "compensation_operation_id"),
)

#: Every move of a saga (its audit trail), oldest first: who, why, and what it did.
saga_events = Table(
    "saga_events",
    metadata,
    Column("id", BigInteger, Identity(always=True), primary_key=True),
    Column("saga_key", Text, nullable=False),
    Column("agent", Text, nullable=False, server_default=text("''")),
    _timestamp("at", nullable=False, now=True),
    Column("from_state", Text),
    Column("to_state", Text, nullable=False),
    Column("actor", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("detail", JSONB),
    ForeignKeyConstraint(
        ["saga_key", "agent"], ["outbox.sagas.key", "outbox.sagas.agent"], ondelete="CASCADE"
    ),
    Index("ix_saga_events_saga_key_agent_id", "saga_key", "agent", "id"),
)
