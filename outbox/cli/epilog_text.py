"""A copy of the root help's epilog, written by ``python -m outbox.cli.epilog``; do not edit."""

# ruff: noqa: E501

#: The SHA-256 of outbox/config.py the copy was made from.
CONFIG_SHA256 = "10d78b9033b34be5724d4907360eb86b7c26e09635e9dc2044d7d4bdfb8911e2"

#: :func:`outbox.cli.output.environment_help` as it was then.
TEXT = "\n\n".join(
    [
        "**Environment** (every setting; unset means the default):",
        "`OUTBOX_DATABASE_URL` (default: unset): PostgreSQL URL; unset: an embedded PostgreSQL under OUTBOX_HOME.",
        "`OUTBOX_HOME` (default: .outbox): Directory for local state (the embedded PostgreSQL's data).",
        "`OUTBOX_BROKER_URL` (default: unset): Celery broker URL; unset: the database itself (kombu's SQLAlchemy transport).",
        "`OUTBOX_DEPLOYMENT` (default: unset): Name of this deployment in its broker queues and exchanges; unset: derived from the database's identity. Set it alike on every process of a deployment.",
        "`OUTBOX_CONFIG` (default: unset): TOML file declaring HTTP tools.",
        "`OUTBOX_TOOLS` (default: none): Comma-separated modules that register tools.",
        "`OUTBOX_SENT_TIMEOUT` (default: 60): A `sent` row older than this is checked by the sweep.",
        "`OUTBOX_SENT_MAX_AGE` (default: 3600): A `sent` row still locked by its dispatcher after this goes to a human.",
        "`OUTBOX_SWEEP_INTERVAL` (default: 15): Seconds between sweeps.",
        "`OUTBOX_BROKER_POLL_INTERVAL` (default: 5): On the database broker: seconds between a worker's polls of its empty queues; a publish wakes it at once (LISTEN/NOTIFY), the poll only covers a lost notification.",
        "`OUTBOX_BROKER_DIRECT_TAKE` (default: true): Workers take due operations from the outbox themselves, without the relay's message in between: on the database broker in the outbox's own database always (the relay stands by), on RabbitMQ too (a worker waiting for work is left a fresh row for 0.2 s; one carrying a backlog, several per message, and the relay stands by); false: every operation goes through the relay's message (the worker says so in outbox.relays, and a relay standing by for others publishes what they left for 0.2 s).",
        "`OUTBOX_LOOKUP_LEASE` (default: 60): An `unknown` row the sweep sent to a lookup is not routed again for this long; on the database broker (no redelivery) a lost lookup message delays that operation by up to this.",
        "`OUTBOX_REPUBLISH_AFTER` (default: 30): A published `planned` row is published again after this.",
        "`OUTBOX_OPS_PER_MESSAGE` (default: 8): Operations one dispatch message may name (each still gets its own lock and attempt); a batch is still spread over at least 16 messages when it can be.",
        "`OUTBOX_TASK_EVENTS` (default: true): Send Celery's task events on RabbitMQ (the tasks Flower shows; the database broker carries none); off, no message costs event publishes: a little less latency and broker load (docs/performance.md).",
        "`OUTBOX_TASK_TIME_LIMIT_SLACK` (default: 30): A dispatch message's hard time limit is the slowest tool's send deadline + timeout plus this; an operation that would not end inside it waits for a new message instead of being started.",
        "`OUTBOX_MAX_PAYLOAD_BYTES` (default: 262144): Largest canonical payload accepted by enqueue.",
        "`OUTBOX_ALLOW_ASYNC_REPLICAS` (default: false): Let dispatch workers start on a primary whose streaming standbys are all asynchronous: a failover to one may roll back a committed `sent` and send the operation again (docs/deploy.md).",
        "`OUTBOX_LOG_FORMAT` (default: logfmt): Log lines on stderr: logfmt, or json (one object per line).",
        "`OUTBOX_FLOWER_BASIC_AUTH` (default: unset): Credentials `outbox flower` (and `outbox up --flower`) asks for: user:password, comma-separated for several.",
        "`OUTBOX_WEBHOOK_URL` (default: unset): Where escalations are POSTed (http or https).",
        "`OUTBOX_WEBHOOK_SECRET` (default: unset): Standard Webhooks signing secret (whsec_...).",
        "`OUTBOX_WEBHOOK_EVENTS` (default: needs_human,resolved,approval_requested,approval_expired,circuit_opened,circuit_closed,budget_exhausted,saga_compensated,saga_needs_human): Comma-separated events to deliver: needs_human, resolved, approval_requested, approval_expired, circuit_opened, circuit_closed, budget_exhausted, saga_compensated, saga_needs_human, confirmed, failed.",
        "`OUTBOX_API_HOST` (default: 127.0.0.1): Address `outbox api` binds; a non-loopback one needs OUTBOX_API_TLS_CERT and OUTBOX_API_TLS_KEY, or OUTBOX_API_BEHIND_PROXY.",
        "`OUTBOX_API_PORT` (default: 8600): Port `outbox api` binds.",
        "`OUTBOX_API_BEHIND_PROXY` (default: false): A reverse proxy terminates TLS in front of `outbox api`: it may bind a non-loopback address without TLS of its own, and trusts X-Forwarded-* headers from OUTBOX_API_FORWARDED_ALLOW_IPS.",
        "`OUTBOX_API_FORWARDED_ALLOW_IPS` (default: 127.0.0.1): Comma-separated proxy addresses whose X-Forwarded-* headers are trusted.",
        "`OUTBOX_API_TLS_CERT` (default: unset): PEM certificate `outbox api` serves HTTPS with.",
        "`OUTBOX_API_TLS_KEY` (default: unset): PEM private key of OUTBOX_API_TLS_CERT.",
        "`OUTBOX_API_MAX_BODY_BYTES` (default: 524288): Largest request body `outbox api` reads (413 above it); a payload is also held to OUTBOX_MAX_PAYLOAD_BYTES.",
        "`OUTBOX_API_TOKEN_CACHE` (default: 5): Seconds `outbox api` trusts a token it checked before checking it again: a revoked token is refused within this (0: check on every request).",
        "`OUTBOX_API_MAX_WAIT` (default: 60): Longest long-poll `GET /v1/operations/{id}?wait=S` holds (S is capped to it).",
        "`OUTBOX_API_WORKERS` (default: 1): Worker processes `outbox api` serves with, on one socket (each its own interpreter: about one per core).",
        "`OUTBOX_MCP_AGENT` (default: mcp): The name `outbox mcp` (stdio) records as requested_by of what it enqueues; over HTTP the bearer token's name is.",
        "`OUTBOX_DB_START_TIMEOUT` (default: 120): How long the relay, workers, beat, `outbox api` and `outbox mcp` wait at start-up for an unreachable (or starting) database, trying again with backoff, before they exit 1 (0: try once).",
        "`OUTBOX_MCP_WAIT_S` (default: 20): How long an MCP tool call waits for its operation's outcome before answering that it is still in progress.",
        "`OUTBOX_MCP_HOST` (default: 127.0.0.1): Address `outbox mcp --http` binds; a non-loopback one needs OUTBOX_API_TLS_CERT and OUTBOX_API_TLS_KEY (--tls-cert/--tls-key), or --behind-proxy.",
        "`OUTBOX_MCP_PORT` (default: 8700): Port `outbox mcp --http` binds.",
        "`OUTBOX_CONSOLE_SECRET` (default: unset): Key that signs the console's session cookies (at least 32 random characters); unset, each `outbox api` makes one (shared by its --workers), so sessions end when it restarts and are not shared between replicas.",
        "`OUTBOX_CONSOLE_URL` (default: unset): The console's public address (e.g. https://outbox.example.com): escalation webhooks then link to the operation's page (data.console_url).",
        "`OUTBOX_CONSOLE_FLOWER_URL` (default: unset): Flower's address, linked from the console's overview.",
        "`OUTBOX_CONSOLE_SIGNIN_LIMIT` (default: 5): Failed console sign-ins, per name and per client address, within OUTBOX_CONSOLE_SIGNIN_WINDOW that lock that name or address.",
        "`OUTBOX_CONSOLE_SIGNIN_WINDOW` (default: 900): Seconds a failed console sign-in counts against the limit.",
        "`OUTBOX_CONSOLE_SIGNIN_LOCKOUT` (default: 60): Seconds a locked name or address is refused after its last failed sign-in (then one more password is checked per lockout).",
        "`OUTBOX_CONSOLE_HASH_THREADS` (default: 1): Threads of each `outbox api` process that check console passwords (argon2id), at a lower CPU priority than the agents' requests.",
        "`OUTBOX_CONSOLE_HASH_QUEUE` (default: 8): Console sign-ins that may wait for a password-checking thread, per process; beyond them a sign-in is refused at once (503, Retry-After).",
        "`OUTBOX_CONSOLE_HASH_RATE` (default: 0.25): Console passwords checked per second at most, per process: each check (about a tenth of a second of a core and 64 MiB) starts no sooner than 1/rate after the previous one, so a burst of sign-ins cannot take the agents' CPU.",
        "`OUTBOX_CONSOLE_METRICS_URL` (default: unset): A metrics dashboard's (or the exporter's) address, linked from the overview.",
    ]
)
