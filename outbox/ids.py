"""Operation ids, made where the intent is enqueued: UUIDv7 as ``outbox.uuid_v7()`` makes them.

An operation's id used to come from the database's ``outbox.uuid_v7()`` in the INSERT. Its
advisory-lock key (:func:`outbox.locks.operation_lock_key`: BLAKE2b of the id) cannot be
computed in SQL, and a worker's take needs it in the row to claim and lock an operation in
one statement (migration 0027): so enqueue makes the id, and the key with it.

The layout is the SQL function's (RFC 9562 version 7): 48 bits of Unix milliseconds, the
version and variant bits, the rest random. Hand-written because Python's ``uuid.uuid7``
arrives only in 3.14. The time part is the enqueuing host's clock: it orders ids (the
index's right edge, lists newest first) and decides nothing.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

_VERSION_7 = 0x7 << 76
_VARIANT_RFC = 0x2 << 62
_RANDOM_BITS = (1 << 74) - 1


_LOW_BITS = (1 << 62) - 1
#: The last id this process made, so that the next sorts after it even within a millisecond
#: (RFC 9562's monotonic random: the next is the last plus one) or after the clock stepped
#: back.
_last = 0
_last_lock = threading.Lock()


def new_operation_id() -> uuid.UUID:
    """A new time-ordered operation id (UUIDv7), after every id this process made before."""
    global _last  # noqa: PLW0603 -- the process's sequence
    millis = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big") & _RANDOM_BITS
    # 12 random bits after the version, 62 after the variant.
    value = (
        (millis & 0xFFFF_FFFF_FFFF) << 80
        | _VERSION_7
        | (rand >> 62) << 64
        | _VARIANT_RFC
        | (rand & _LOW_BITS)
    )
    with _last_lock:
        if value <= _last:
            # One more than the last, in its low random bits (their carry, at 1 in 2**62 an
            # id, would only spend one of the 12 bits above them).
            value = _last + 1 if _last & _LOW_BITS != _LOW_BITS else _last + (1 << 64) - _LOW_BITS
        _last = value
    return uuid.UUID(int=value)
