"""How outbox.integrations.langgraph names a call: the parts of its intent key."""

from __future__ import annotations

import pytest

from outbox.integrations.langgraph import CallIdentity, _namespace, _push_path, default_intent_key


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
