"""Run a LangGraph thread so that a crash never turns a pending turn into a new one.

The intent key of an outbox call made in a graph holds the step's number
(:mod:`outbox.integrations.langgraph`), and a thread's steps go on across its turns. A thread
resumed from its checkpoint (``invoke(None)``) runs its pending tasks again at the steps they
had, so their calls get their keys back. A thread given its first input again instead starts a
new turn on top of what the crash left: later steps, new keys, a second effect. Which of the
two a restarted process must do is decided here, from what the checkpointer saved.

LangGraph's ``get_state(config).next`` is not that test. It lists only the tasks of the
latest checkpoint's step that have no saved writes: a task that finished, and whose writes
were saved while the checkpoint of its step was not (``durability="async"`` writes that
checkpoint while the next step already runs), is not in it, although the steps it leads to
have not been checkpointed and may have acted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.pregel import Pregel
from langgraph.types import Command, StateSnapshot

__all__ = ["ainvoke_thread", "athread_pending", "invoke_thread", "thread_pending"]

# LangGraph's names in config["configurable"] (langgraph._internal._constants).
_THREAD_ID, _CHECKPOINT_ID = "thread_id", "checkpoint_id"

Graph = Pregel[Any, Any, Any, Any]


def invoke_thread(graph: Graph, input: Any, config: RunnableConfig, **kwargs: Any) -> Any:
    """``graph.invoke`` that resumes the thread whenever anything of it is pending.

    The thread is resumed (``graph.invoke(None, config, **kwargs)``) when its latest
    checkpoint has a step that did not end (:func:`thread_pending`): tasks still to run,
    tasks whose writes were saved but whose step was not checkpointed, a task that failed,
    or an interrupt waiting for an answer (resumed without one, the node asks again and the
    result holds the same ``__interrupt__``). Only a thread with nothing pending is given
    ``input``, which starts its next turn (or its first). A :class:`~langgraph.types.Command`
    (``Command(resume=...)`` answering an interrupt) is given to the graph as it is.

    So a process restarted after a crash calls this with the input it was given before: the
    pending turn goes on at the steps it had, and its outbox calls find their operations
    again; if the crash left nothing of the turn, the turn starts again from the same
    checkpoint with the same input, at the same steps. Returns what ``graph.invoke`` returns.
    ``config`` must name the thread (``thread_id``) and not a checkpoint (``checkpoint_id``
    replays history: call ``graph.invoke`` for that).
    """
    if isinstance(input, Command):
        return graph.invoke(input, config, **kwargs)
    pending = thread_pending(graph, config)
    return graph.invoke(None if pending else input, config, **kwargs)


async def ainvoke_thread(graph: Graph, input: Any, config: RunnableConfig, **kwargs: Any) -> Any:
    """:func:`invoke_thread` with ``graph.ainvoke`` and ``graph.aget_state`` (an async
    checkpointer such as ``AsyncPostgresSaver``): the same rule, the same result."""
    if isinstance(input, Command):
        return await graph.ainvoke(input, config, **kwargs)
    pending = await athread_pending(graph, config)
    return await graph.ainvoke(None if pending else input, config, **kwargs)


def thread_pending(graph: Graph, config: RunnableConfig) -> bool:
    """Whether the thread's latest checkpoint has a step that did not end (see
    :func:`invoke_thread`): what ``graph.stream`` callers test to choose ``None`` or input."""
    return _pending(graph.get_state(_checked(graph, config)))


async def athread_pending(graph: Graph, config: RunnableConfig) -> bool:
    """:func:`thread_pending` with ``graph.aget_state`` (an async checkpointer)."""
    return _pending(await graph.aget_state(_checked(graph, config)))


def _pending(snapshot: StateSnapshot) -> bool:
    """``tasks`` holds every task of the step after the latest checkpoint, with the writes
    saved for it: whether it finished, failed or was interrupted. ``next`` (those without
    writes) and ``interrupts`` are in it; they are named too, so that the rule does not rest
    on how one LangGraph release fills ``tasks``. A thread that ended its turn has none."""
    return bool(snapshot.next or snapshot.tasks or snapshot.interrupts)


def _checked(graph: Graph, config: RunnableConfig) -> RunnableConfig:
    configurable: Mapping[str, Any] = {
        **((graph.config or {}).get("configurable") or {}),
        **(config.get("configurable") or {}),
    }
    if configurable.get(_THREAD_ID) is None:
        raise ValueError(
            "no thread_id in config['configurable']: a thread is what is resumed; give "
            "config={'configurable': {'thread_id': ...}} and compile with a checkpointer"
        )
    if configurable.get(_CHECKPOINT_ID) is not None:
        raise ValueError(
            "config names a checkpoint_id: the thread is resumed from its latest checkpoint; "
            "to replay from an earlier one, call graph.invoke with that config"
        )
    return config
