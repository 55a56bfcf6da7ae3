"""The guards' admission as one function, so that it and the `sent` move are one statement.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-02

A concurrency cap counts the key's ``sent`` rows under the key's transaction-scoped advisory
lock, held until the `sent` move commits. A statement's own snapshot is taken before any lock
it asks for, so the count needed a statement of its own after the lock, and the lock, the
count and the move a transaction of their own (BEGIN, lock, admission, move, COMMIT: five
round trips, the lock held through all but the first). A VOLATILE function's queries take
fresh snapshots (READ COMMITTED), after the lock was granted (as 0007's
``operation_if_locked``): called from the `sent` move's statement, it makes the lock, the
count, the breaker's read, the GCRA step and the move one autocommit statement. No table
changes; nothing calls it before the workers that do are deployed.
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Every guard's input may be NULL (not declared): nothing read or written for it.
# * The dispatch breaker's row, no lock: a closed one is all most calls see.
# * With a cap (`cap`), the key's advisory lock (the key written `tool` or `tool:target`, as
#   outbox.guards.GuardKey), then the count of the key's `sent` rows (the partial index of
#   `sent` rows: only the rows in flight), on a snapshot that sees the last holder's move.
# * With the breaker closed and under the cap, one GCRA step: the row lock of ON CONFLICT
#   makes it exact (its WHERE is judged on the newest `tat`); a refusal by the breaker or the
#   cap takes no token. The instant is read after the lock, not the statement's start.
# The count reads the index in a plain index scan (bitmap scans off, for this function only):
# each row that left `sent` leaves a dead entry in that partial index until a vacuum, and a
# bitmap scan (the planner's choice for a few rows) visits the heap for every one of them, on
# every count, under the key's lock (0.5 ms after 2,700 attempts in bench/guards.py, growing);
# an index scan marks the dead ones it meets, and later scans step over them (0.1 ms).
# `admitted`: every declared guard lets the attempt through. `wait_s`: seconds to the
# bucket's next slot (0 when a token was taken or there is no rate).
GUARD_ADMIT = """
CREATE FUNCTION outbox.guard_admit(
    b_tool text, b_target text, cap integer, c_tool text, c_target text,
    r_tool text, r_target text, interval_s double precision, burst integer,
    OUT in_flight bigint, OUT token boolean, OUT wait_s double precision,
    OUT breaker_state text, OUT open_until timestamptz, OUT quiet boolean,
    OUT now timestamptz, OUT admitted boolean)
  LANGUAGE plpgsql VOLATILE SET enable_bitmapscan = off AS $$
DECLARE
  failures integer;
  closed boolean;
  t_now timestamptz;
  t_step interval;
BEGIN
  IF b_tool IS NOT NULL THEN
    SELECT b.state, b.open_until, b.failures INTO breaker_state, open_until, failures
    FROM outbox.guard_breakers AS b
    WHERE b.scope = 'dispatch' AND b.tool = b_tool AND b.target = b_target;
  END IF;
  closed := coalesce(breaker_state, 'closed') = 'closed';
  quiet := coalesce(breaker_state = 'closed' AND failures = 0, true);
  IF cap IS NOT NULL THEN
    PERFORM pg_advisory_xact_lock(hashtextextended('outbox.guards.concurrency:'
      || CASE WHEN c_target = '' THEN c_tool ELSE c_tool || ':' || c_target END, 0));
    SELECT count(*) INTO in_flight FROM outbox.operations AS o
    WHERE o.state = 'sent' AND o.tool = c_tool AND (c_target = '' OR o.target = c_target);
  END IF;
  wait_s := 0;
  IF interval_s IS NOT NULL THEN
    token := false;
    t_now := clock_timestamp();
    t_step := make_interval(secs => interval_s);
    IF closed AND (cap IS NULL OR in_flight < cap) THEN
      INSERT INTO outbox.guard_buckets AS g (tool, target, tat)
      VALUES (r_tool, r_target, t_now + t_step)
      ON CONFLICT (tool, target) DO UPDATE SET tat = greatest(g.tat, t_now) + t_step
      WHERE greatest(g.tat, t_now) + t_step <= t_now + t_step * burst
      RETURNING true INTO token;
      token := coalesce(token, false);
    END IF;
    IF NOT token THEN
      SELECT greatest(extract(epoch FROM g.tat - t_step * (burst - 1) - t_now)::float8, 0)
      INTO wait_s FROM outbox.guard_buckets AS g
      WHERE g.tool = r_tool AND g.target = r_target;
      wait_s := coalesce(wait_s, 0);
    END IF;
  END IF;
  now := clock_timestamp();
  admitted := closed AND (cap IS NULL OR in_flight < cap) AND (interval_s IS NULL OR token);
END
$$
"""


def upgrade() -> None:
    op.execute(GUARD_ADMIT)


def downgrade() -> None:
    op.execute(
        "DROP FUNCTION outbox.guard_admit(text, text, integer, text, text, text, text, "
        "double precision, integer)"
    )
