"""The statements of approval before send: the tools' published policies and payload schemas,
the expired approvals the sweep cancels, and the relay's doorbell an approval rings."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from sqlalchemy import text

from outbox.models import Executor


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """One tool's published contract, as ``outbox.tool_policies`` holds it: its approval
    policy and the JSON Schema of its payload."""

    tool: str
    approval_required: bool
    approval_ttl_s: float
    #: The payload's JSON Schema, or ``None``: the tool declares none.
    input_schema: Mapping[str, Any] | None = field(default=None, compare=False)


_UPSERT_POLICIES = text(
    """
    INSERT INTO outbox.tool_policies (tool, approval_required, approval_ttl_s, input_schema)
    SELECT tool, required, ttl, CAST(schema AS jsonb)
    FROM unnest(CAST(:tools AS text[]), CAST(:required AS boolean[]),
                CAST(:ttls AS double precision[]), CAST(:schemas AS text[]))
           AS given (tool, required, ttl, schema)
    ON CONFLICT (tool) DO UPDATE
      SET approval_required = excluded.approval_required,
          approval_ttl_s = excluded.approval_ttl_s,
          input_schema = excluded.input_schema,
          updated_at = clock_timestamp()
      -- Unchanged policies are left alone: every worker start writes them all.
      WHERE (tool_policies.approval_required, tool_policies.approval_ttl_s,
             tool_policies.input_schema)
            IS DISTINCT FROM (excluded.approval_required, excluded.approval_ttl_s,
                              excluded.input_schema)
    """
)


def upsert_policies(executor: Executor, policies: Sequence[ToolPolicy]) -> None:
    """Write each tool's policy (insert, or update one that changed)."""
    if not policies:
        return
    executor.execute(
        _UPSERT_POLICIES,
        {
            "tools": [p.tool for p in policies],
            "required": [p.approval_required for p in policies],
            "ttls": [float(p.approval_ttl_s) for p in policies],
            "schemas": [
                json.dumps(p.input_schema) if p.input_schema is not None else None for p in policies
            ],
        },
    )


_GET_POLICY = text(
    """
    SELECT tool, approval_required, approval_ttl_s, input_schema
    FROM outbox.tool_policies WHERE tool = :tool
    """
)


def get_policy(executor: Executor, tool: str) -> ToolPolicy | None:
    """The policy recorded for ``tool``, or ``None``."""
    row = executor.execute(_GET_POLICY, {"tool": tool}).mappings().one_or_none()
    return ToolPolicy(**row) if row is not None else None


_PUBLISHED = text(
    # The schema read through the row's JSON, not by name: on a database not yet upgraded to
    # 0024 an agent's enqueue still checks the tool names (no schema: NULL) instead of
    # failing with SchemaNotReady before the operator has run `outbox db upgrade`.
    """
    SELECT tool, approval_required, approval_ttl_s, to_jsonb(p) -> 'input_schema' AS input_schema
    FROM outbox.tool_policies AS p
    """
)


def published_policies(executor: Executor) -> list[ToolPolicy]:
    """Every tool's published contract (one row a tool: the table is as small as the
    deployment's list of tools)."""
    return [ToolPolicy(**row) for row in executor.execute(_PUBLISHED).mappings()]


_EXPIRED = text(
    """
    SELECT id FROM outbox.operations
    WHERE state = 'awaiting_approval' AND approval_expires_at <= statement_timestamp()
    ORDER BY approval_expires_at
    LIMIT :limit
    """
)


def expired_approvals(executor: Executor, *, limit: int) -> list[UUID]:
    """Operations still awaiting an approval whose expiry has passed (database clock),
    the longest expired first."""
    return [row[0] for row in executor.execute(_EXPIRED, {"limit": limit})]


_RING_RELAY = text(
    "SELECT pg_notify('outbox_planned', '') WHERE EXISTS (SELECT FROM outbox.relays WHERE idle)"
)


def ring_relay(executor: Executor) -> None:
    """Wake an idle relay at the caller's commit (as ``enqueue`` does), only if one sleeps."""
    executor.execute(_RING_RELAY)
