"""How outbox.integrations.langgraph names a call: the parts of its intent key."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import create_engine

from outbox.db import create_async_engine
from outbox.integrations.langgraph import (
    CallIdentity,
    _namespace,
    _push_path,
    default_intent_key,
    outbox_tool,
)


def _identity(**changes: object) -> CallIdentity:
    parts: dict[str, object] = {
        "thread_id": "t-1",
        "namespace": "",
        "step": 4,
        "node": "tools",
        "path": "",
        "tool": "deploy.create_release",
        "ordinal": 1,
    }
    parts.update(changes)
    return CallIdentity(**parts)  # type: ignore[arg-type]


def test_the_key_is_the_thread_the_node_at_its_step_the_tool_and_the_ordinal() -> None:
    """A root node's call is keyed thread:node@step:tool:ordinal."""
    assert default_intent_key(_identity()) == "t-1:tools@4:deploy.create_release:1"


def test_a_subgraph_and_a_send_task_are_named_in_the_step() -> None:
    """The enclosing nodes prefix the step and a Send task's index follows it."""
    key = default_intent_key(_identity(namespace="outer:1f0e", path="[2]"))
    assert key == "t-1:outer:1f0e/tools@4[2]:deploy.create_release:1"


def test_the_namespace_is_the_enclosing_tasks_without_the_node_itself() -> None:
    """A root node has none; a subgraph's node is named after its enclosing tasks, ids and
    all (a subgraph's steps start again at each invocation), not after its own task."""
    assert _namespace("tools:1f0e-aa") == ""
    assert _namespace("outer:1f0e-aa|inner:77b2|tools:9c") == "outer:1f0e-aa|inner:77b2"


def test_only_push_tasks_have_a_path() -> None:
    """A pull task's path is its node (already in the key); a push task's is its index."""
    assert _push_path(("__pregel_pull", "tools")) == ""
    assert _push_path(("__pregel_push", 2)) == "[2]"
    assert _push_path(("__pregel_push", ("__pregel_pull", "a"), 3)) == "[3]"
    assert _push_path(None) == ""


def test_without_a_thread_there_is_no_durable_key() -> None:
    """No checkpointer thread: the default key refuses, saying what to configure."""
    with pytest.raises(ValueError, match="thread_id"):
        default_intent_key(_identity(thread_id=None))


def test_a_tool_on_an_async_engine_has_a_coroutine_and_refuses_the_sync_call() -> None:
    """The tool has a coroutine (so ainvoke takes the outbox.aio path, not invoke in a
    thread); given an AsyncEngine, invoke refuses, saying to use ainvoke; given a sync Engine,
    ainvoke checks the call as invoke does. Nothing connects: no database is needed."""
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none"
    on_async = outbox_tool("deploy.create_release", engine=create_async_engine(url))
    assert on_async.coroutine is not None
    with pytest.raises(TypeError, match="ainvoke"):
        on_async.invoke({"target": "web", "payload": {}})

    on_sync = outbox_tool("deploy.create_release", engine=create_engine(url))
    with pytest.raises(ValueError, match="outside a LangGraph node"):
        asyncio.run(on_sync.ainvoke({"target": "web", "payload": {}}))
    with pytest.raises(ValueError, match="outside a LangGraph node"):
        asyncio.run(on_async.ainvoke({"target": "web", "payload": {}}))
