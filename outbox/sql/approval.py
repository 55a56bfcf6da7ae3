"""The statements of approval before send: the tools' policies, the expired approvals the sweep
cancels, and the relay's doorbell an approval rings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from uuid import UUID

from sqlalchemy import text

from outbox.models import Executor


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """One tool's approval policy, as ``outbox.tool_policies`` holds it."""

    tool: str
    approval_required: bool
    approval_ttl_s: float


_UPSERT_POLICIES = text(
    """
    INSERT INTO outbox.tool_policies (tool, approval_required, approval_ttl_s)
    SELECT * FROM unnest(CAST(:tools AS text[]), CAST(:required AS boolean[]),
                         CAST(:ttls AS double precision[]))
    ON CONFLICT (tool) DO UPDATE
      SET approval_required = excluded.approval_required,
          approval_ttl_s = excluded.approval_ttl_s,
          updated_at = clock_timestamp()
      -- Unchanged policies are left alone: every worker start writes them all.
      WHERE (tool_policies.approval_required, tool_policies.approval_ttl_s)
            IS DISTINCT FROM (excluded.approval_required, excluded.approval_ttl_s)
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
            "ttls": [p.approval_ttl_s for p in policies],
        },
    )


_GET_POLICY = text(
    "SELECT tool, approval_required, approval_ttl_s FROM outbox.tool_policies WHERE tool = :tool"
)


def get_policy(executor: Executor, tool: str) -> ToolPolicy | None:
    """The policy recorded for ``tool``, or ``None``."""
    row = executor.execute(_GET_POLICY, {"tool": tool}).mappings().one_or_none()
    return ToolPolicy(**row) if row is not None else None


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
