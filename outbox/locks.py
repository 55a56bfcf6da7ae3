"""Advisory-lock keys: one 64-bit key space, namespaced so our locks never collide.

PostgreSQL advisory locks take a signed 64-bit integer. Keys are the first 8 bytes of a
BLAKE2b digest of ``namespace:name``, so an operation's lock key is the same in every
process and on every host, and different namespaces (operations, migrations) cannot clash
with each other or, in practice, with an application's own advisory locks.
"""

from __future__ import annotations

import hashlib

#: Serialises concurrent ``outbox db upgrade`` runs.
MIGRATION_NAMESPACE = "outbox.migrate"
#: One lock per operation: whoever holds it owns the operation's next move.
OPERATION_NAMESPACE = "outbox.operation"
#: Locks of the reconciler's periodic runs (one run of a kind at a time).
RECONCILER_NAMESPACE = "outbox.reconciler"


def advisory_key(namespace: str, name: str) -> int:
    """The signed 64-bit advisory-lock key for ``name`` within ``namespace``."""
    digest = hashlib.blake2b(f"{namespace}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


MIGRATION_LOCK_KEY = advisory_key(MIGRATION_NAMESPACE, "schema")
#: Held for the whole of one sweep: a second sweep that finds it taken returns at once.
SWEEP_LOCK_KEY = advisory_key(RECONCILER_NAMESPACE, "sweep")

#: Set in a pooled connection's ``info`` before a session-level advisory lock is asked for on
#: it, removed once ``pg_advisory_unlock_all()`` ran there: while it is set, the pool's reset
#: runs the unlock itself (``outbox.db``), so no lock outlives the checkout that took it.
SESSION_LOCKS_INFO = "outbox.session_locks"


def operation_lock_key(operation_id: object) -> int:
    """The advisory-lock key owning one operation's next move (dispatch, sweep, resolve)."""
    return advisory_key(OPERATION_NAMESPACE, str(operation_id))
