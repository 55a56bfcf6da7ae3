"""When outbox.integrations.langgraph.invoke_thread resumes a thread and when it starts a
turn, on LangGraph's in-memory checkpointer (no outbox call is made: nothing else is needed)."""

from __future__ import annotations

import asyncio
import operator
from collections import Counter
from typing import Annotated, Any, TypedDict

import pytest
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import ChannelVersions, Checkpoint, CheckpointMetadata
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt

from outbox.integrations.langgraph import (
    ainvoke_thread,
    athread_pending,
    invoke_thread,
    thread_pending,
)


class Turns(TypedDict):
    said: Annotated[list[str], operator.add]


class LosesACheckpoint(InMemorySaver):
    """Fails to write the checkpoint of ``step`` (the process died while writing it); the
    writes of that step's tasks, saved before, are kept."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        if metadata.get("step") == self.step:
            raise ConnectionError("the checkpoint store went away")
        return super().put(config, checkpoint, metadata, new_versions)


def _two_nodes(saver: InMemorySaver, runs: Counter[str]) -> Any:
    def ask(state: Turns) -> dict[str, Any]:
        runs["ask"] += 1
        return {"said": ["asked"]}

    def act(state: Turns) -> dict[str, Any]:
        runs["act"] += 1
        return {"said": ["acted"]}

    builder = StateGraph(Turns)
    builder.add_node("ask", ask)
    builder.add_node("act", act)
    builder.add_edge(START, "ask")
    builder.add_edge("ask", "act")
    builder.add_edge("act", END)
    return builder.compile(checkpointer=saver)


def test_a_step_whose_writes_were_saved_but_not_its_checkpoint_is_resumed() -> None:
    """A thread whose first node's writes were saved and whose step's checkpoint was lost
    has an empty get_state().next but is pending: invoke_thread resumes it (the node is not
    run again, the input is not given twice), where the next check would start a new turn."""
    runs: Counter[str] = Counter()
    saver = LosesACheckpoint(step=1)
    graph = _two_nodes(saver, runs)
    config: RunnableConfig = {"configurable": {"thread_id": "t"}}
    with pytest.raises(ConnectionError):
        graph.invoke({"said": ["release"]}, config, durability="sync")
    assert graph.get_state(config).next == ()
    assert thread_pending(graph, config)
    saver.step = -2  # the store is back

    result = invoke_thread(graph, {"said": ["release"]}, config)

    assert result["said"] == ["release", "asked", "acted"]
    assert runs == Counter(ask=1, act=1)
    assert not thread_pending(graph, config)


def test_a_thread_with_nothing_pending_starts_a_turn_with_the_input() -> None:
    """A new thread and a thread whose turn ended are given the input (a new turn)."""
    runs: Counter[str] = Counter()
    graph = _two_nodes(InMemorySaver(), runs)
    config: RunnableConfig = {"configurable": {"thread_id": "t"}}
    assert not thread_pending(graph, config)

    invoke_thread(graph, {"said": ["one"]}, config)
    result = invoke_thread(graph, {"said": ["two"]}, config)

    assert result["said"] == ["one", "asked", "acted", "two", "asked", "acted"]
    assert runs == Counter(ask=2, act=2)


def test_an_interrupted_thread_is_resumed_and_a_command_is_passed_as_it_is() -> None:
    """A thread paused at an interrupt is resumed, not restarted, when given its input again
    (the node asks again: the same interrupt); Command(resume=...) answers it."""
    asked: list[str] = []

    def approve(state: Turns) -> dict[str, Any]:
        answer = interrupt("approve?")
        asked.append(answer)
        return {"said": [f"approved by {answer}"]}

    builder = StateGraph(Turns)
    builder.add_node("approve", approve)
    builder.add_edge(START, "approve")
    graph = builder.compile(checkpointer=InMemorySaver())
    config: RunnableConfig = {"configurable": {"thread_id": "t"}}

    paused = invoke_thread(graph, {"said": ["release"]}, config)
    again = invoke_thread(graph, {"said": ["release"]}, config)
    done = invoke_thread(graph, Command(resume="alice"), config)

    assert [i.value for i in paused["__interrupt__"]] == ["approve?"]
    assert [i.value for i in again["__interrupt__"]] == ["approve?"]
    assert again["said"] == ["release"]
    assert done["said"] == ["release", "approved by alice"]
    assert asked == ["alice"]


def test_a_step_that_raised_is_run_again_not_replaced_by_a_new_turn() -> None:
    """A node that raised leaves its thread pending: given its input again, the thread runs
    the failed node again instead of starting a turn with the input a second time."""
    runs: Counter[str] = Counter()

    def flaky(state: Turns) -> dict[str, Any]:
        runs["flaky"] += 1
        if runs["flaky"] == 1:
            raise RuntimeError("the model provider timed out")
        return {"said": ["answered"]}

    builder = StateGraph(Turns)
    builder.add_node("flaky", flaky)
    builder.add_edge(START, "flaky")
    graph = builder.compile(checkpointer=InMemorySaver())
    config: RunnableConfig = {"configurable": {"thread_id": "t"}}
    with pytest.raises(RuntimeError, match="timed out"):
        invoke_thread(graph, {"said": ["release"]}, config)
    assert thread_pending(graph, config)

    result = invoke_thread(graph, {"said": ["release"]}, config)

    assert result["said"] == ["release", "answered"]
    assert runs["flaky"] == 2


def test_the_async_helpers_follow_the_same_rule() -> None:
    """ainvoke_thread resumes a step whose checkpoint was lost and athread_pending says so."""
    runs: Counter[str] = Counter()
    saver = LosesACheckpoint(step=1)
    graph = _two_nodes(saver, runs)
    config: RunnableConfig = {"configurable": {"thread_id": "t"}}

    async def scenario() -> tuple[bool, dict[str, Any]]:
        with pytest.raises(ConnectionError):
            await graph.ainvoke({"said": ["release"]}, config, durability="sync")
        pending = await athread_pending(graph, config)
        saver.step = -2
        result: dict[str, Any] = await ainvoke_thread(graph, {"said": ["release"]}, config)
        return pending, result

    pending, result = asyncio.run(scenario())

    assert pending
    assert result["said"] == ["release", "asked", "acted"]
    assert runs == Counter(ask=1, act=1)


def test_a_config_without_a_thread_or_naming_a_checkpoint_is_refused() -> None:
    """No thread_id: nothing to resume; a checkpoint_id: that is a replay, not a resume."""
    graph = _two_nodes(InMemorySaver(), Counter())
    with pytest.raises(ValueError, match="no thread_id"):
        invoke_thread(graph, {"said": []}, {})
    with pytest.raises(ValueError, match="checkpoint_id"):
        thread_pending(graph, {"configurable": {"thread_id": "t", "checkpoint_id": "1"}})
