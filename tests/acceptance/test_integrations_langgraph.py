"""The LangGraph adapter (outbox.integrations.langgraph) with LangChain's offline fake chat
model and a PostgresSaver on the test database: a run SIGKILLed after its enqueue committed
and before LangGraph checkpointed the step resumes in a new process whose model gives other
tool-call ids, and the reference service sees one effect; unsettled outcomes come back as
answers, not errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Command
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

import outbox
from outbox.contracts import CONTRACTS, ToolContract
from outbox.dev.service import DeployService
from outbox.integrations.langgraph import OutboxTool, outbox_tool
from outbox.states import State
from tests.acceptance.conftest import REPO
from tests.processes import Services, wait_until
from tests.tool_configs import TOOL

EXAMPLE = REPO / "examples" / "langgraph_agent.py"


@pytest.fixture
def broker(rabbitmq_url: str) -> str:
    """RabbitMQ only: the adapter does not depend on the broker."""
    return rabbitmq_url


@pytest.fixture
def saver(database_url: str) -> Iterator[PostgresSaver]:
    """LangGraph's Postgres checkpointer, its tables beside the outbox's in the test database."""
    with PostgresSaver.from_conn_string(database_url) as checkpointer:
        checkpointer.setup()
        yield checkpointer


def _operations(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT id, intent_key FROM outbox.operations")))


def _events(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_a_run_killed_after_its_enqueue_resumes_with_new_tool_call_ids_and_one_effect(
    engine: Engine,
    service: DeployService,
    services: Services,
    stack_env: dict[str, str],
    saver: PostgresSaver,
    tmp_path: Path,
) -> None:
    """The example agent SIGKILLed while its tool waits (the enqueue committed, the step not
    checkpointed) resumes from the checkpoint in a new process, whose model gives the tool
    call another id, and gets the same operation back: one release at the service."""
    thread = f"thread-{uuid.uuid4()}"
    command = [sys.executable, str(EXAMPLE), "--thread", thread, "--version", "2.0.0"]
    first_log = tmp_path / "first.log"
    with first_log.open("wb") as log:
        first = subprocess.Popen(
            [*command, "--wait", "120", "--json"],
            env=stack_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # No worker runs yet: the tool is waiting on an operation that stays planned.
        wait_until(lambda: bool(_operations(engine)), timeout=60, what="the first enqueue")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
    [(op_id, intent_key)] = _operations(engine)
    assert intent_key == f"{thread}:agent@1:{TOOL}:0"
    checkpoint = saver.get_tuple({"configurable": {"thread_id": thread}})
    assert checkpoint is not None
    assert (checkpoint.metadata["step"], checkpoint.pending_writes) == (0, [])
    [asked_first] = _events(first_log.read_text())
    services.start("relay", "relay")
    services.start("worker", "worker", "-c", "1", "-P", "threads")

    second = subprocess.run(
        [*command, "--wait", "60", "--json"],
        env=stack_env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )

    assert second.returncode == 0, second.stderr[-3000:]
    asked_again, done = _events(second.stdout)
    assert asked_again["tool_call_ids"] != asked_first["tool_call_ids"]
    assert done["resumed"] is True
    [report] = done["reports"]
    assert (report["operation_id"], report["outcome"]) == (str(op_id), "confirmed")
    assert _operations(engine) == [(op_id, intent_key)]
    assert service.effects_by_key() == {str(op_id): 1}


def _tools_graph(tool: OutboxTool, saver: PostgresSaver) -> Any:
    graph = StateGraph(MessagesState)
    graph.add_node("tools", ToolNode([tool]))
    graph.add_edge(START, "tools")
    graph.add_edge("tools", END)
    return graph.compile(checkpointer=saver)


def _asks(tool: OutboxTool, *targets: str) -> AIMessage:
    calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:8]}",
            "name": tool.name,
            "args": {"target": t, "payload": {"version": "1.0.0"}},
        }
        for t in targets
    ]
    return AIMessage("", tool_calls=calls)


def test_pending_outcomes_come_back_as_answers_keyed_by_their_place_in_the_message(
    engine: Engine, saver: PostgresSaver
) -> None:
    """Under ToolNode with no worker running, each call answers in progress (not an error,
    saying not to call again with a new key), keyed by the thread, node@step and its place
    among the message's calls of that tool; one needing approval answers awaiting approval."""
    tool = outbox_tool(TOOL, engine=engine, wait_s=0.2)
    thread = f"thread-{uuid.uuid4()}"
    result = _tools_graph(tool, saver).invoke(
        {"messages": [_asks(tool, "web", "api")]}, {"configurable": {"thread_id": thread}}
    )
    answers = [m for m in result["messages"] if isinstance(m, ToolMessage)]
    assert [m.status for m in answers] == ["success", "success"]
    assert [(m.artifact["outcome"], m.artifact["settled"]) for m in answers] == [
        ("in_progress", False)
    ] * 2
    assert all("Do not call this tool again for the same purpose" in m.content for m in answers)
    assert {(m.artifact["target"], m.artifact["intent_key"]) for m in answers} == {
        ("web", f"{thread}:tools@1:{TOOL}:0"),
        ("api", f"{thread}:tools@1:{TOOL}:1"),
    }

    gated = outbox_tool(TOOL, engine=engine, wait_s=0.2, require_approval=True)
    result = _tools_graph(gated, saver).invoke(
        {"messages": [_asks(gated, "db")]}, {"configurable": {"thread_id": f"{thread}-b"}}
    )
    assert result["messages"][-1].artifact["outcome"] == "awaiting_approval"


def test_awaiting_approval_interrupts_the_graph_and_the_resumed_node_finds_the_same_operation(
    engine: Engine, saver: PostgresSaver
) -> None:
    """With interrupt_on_approval, a call awaiting approval pauses the graph with its report;
    approved and resumed, the node runs again and answers with the same operation."""
    tool = outbox_tool(
        TOOL, engine=engine, wait_s=0.2, require_approval=True, interrupt_on_approval=True
    )
    graph = _tools_graph(tool, saver)
    config: Any = {"configurable": {"thread_id": f"thread-{uuid.uuid4()}"}}

    paused = graph.invoke({"messages": [_asks(tool, "web")]}, config)

    [pause] = paused["__interrupt__"]
    assert pause.value["outcome"] == "awaiting_approval"
    with Session(engine) as session, session.begin():
        op = outbox.get(session, pause.value["operation_id"])
        assert op is not None
        outbox.approve(session, op.id, by="alice", payload_hash=op.payload_hash)
    resumed = graph.invoke(Command(resume="approved"), config)
    report = resumed["messages"][-1].artifact
    assert (report["operation_id"], report["state"]) == (str(op.id), State.PLANNED.value)
    assert len(_operations(engine)) == 1


def test_the_tools_input_schema_is_the_payloads_schema_and_a_mismatch_is_an_error_answer(
    engine: Engine, saver: PostgresSaver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model is shown the tool's declared input_schema as the payload's schema; a payload
    that fails it is answered as a tool error naming the field, and nothing is written."""
    schema = {
        "type": "object",
        "properties": {"version": {"type": "string"}},
        "required": ["version"],
    }
    monkeypatch.setitem(CONTRACTS._contracts, TOOL, ToolContract(name=TOOL, input_schema=schema))
    tool = outbox_tool(TOOL, engine=engine, wait_s=0.2, target="web")
    assert tool.tool_call_schema["properties"] == {"payload": schema}  # type: ignore[index]
    call = {"id": "call_1", "name": tool.name, "args": {"payload": {"version": 2}}}
    result = _tools_graph(tool, saver).invoke(
        {"messages": [AIMessage("", tool_calls=[call])]},
        {"configurable": {"thread_id": f"thread-{uuid.uuid4()}"}},
    )
    answer = result["messages"][-1]
    assert answer.status == "error"
    assert "payload.version" in answer.content
    assert _operations(engine) == []


def test_a_rerun_asking_for_other_input_at_the_same_place_is_told_what_exists(
    engine: Engine,
) -> None:
    """A re-run of a node whose model now asks for another payload at the same place gets an
    error answer naming the difference and the operation already recorded, and no second
    operation."""
    tool = outbox_tool(TOOL, engine=engine, wait_s=0)
    # The config LangGraph gives a node's task (its metadata and per-execution scratchpad).
    config: Any = {
        "configurable": {"thread_id": "thread-x", "__pregel_scratchpad": object()},
        "metadata": {"langgraph_step": 3, "langgraph_node": "agent"},
    }
    first = tool.invoke(_call(tool, "1.0.0"), config)
    config["configurable"]["__pregel_scratchpad"] = object()  # the node runs again
    second = tool.invoke(_call(tool, "1.0.1"), config)

    assert (first.status, second.status) == ("success", "error")
    assert "different payload" in second.content
    assert first.artifact["operation_id"] in second.content
    assert len(_operations(engine)) == 1


def _call(tool: OutboxTool, version: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:8]}",
        "name": tool.name,
        "args": {"target": "web", "payload": {"version": version}},
        "type": "tool_call",
    }
