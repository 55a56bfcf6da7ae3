"""Intent keys from a run's durable identity.

A framework replays a step after a crash or an interruption: the same run (thread) id, the
same step, the same tool, the same position among that step's calls. The provider's tool-call
id is none of these: it is minted per model response and differs on the replay, so a key built
from it is a new key and a second effect. :func:`durable_intent_key` builds the key from the
parts that survive.
"""

from __future__ import annotations

import hashlib

from outbox.api import MAX_INTENT_KEY_LENGTH

#: Between the parts of a key. Parts containing it are not escaped: a key only has to be the
#: same on a replay and distinct between different calls, and the ordinal ends every key.
SEPARATOR = ":"


def durable_intent_key(*, run_id: str, step: str, tool: str, ordinal: int) -> str:
    """``run_id:step:tool:ordinal``, the same on every replay of that call.

    ``run_id`` is the run's durable identity (a conversation, thread or workflow id that a
    resumed run keeps), ``step`` the step within it (a node name, a turn number), ``ordinal``
    the call's position among this tool's calls in the step (0 for the first). A key longer
    than the outbox allows keeps a readable prefix and ends with a hash of the whole.
    """
    if not run_id:
        raise ValueError("run_id must not be empty: it is what makes the key durable")
    if ordinal < 0:
        raise ValueError(f"ordinal must not be negative, not {ordinal}")
    key = SEPARATOR.join((run_id, step, tool, str(ordinal)))
    if len(key) <= MAX_INTENT_KEY_LENGTH:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f"{key[: MAX_INTENT_KEY_LENGTH - len(digest) - 1]}#{digest}"
