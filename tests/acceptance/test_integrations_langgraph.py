"""The LangGraph adapter (outbox.integrations.langgraph) with LangChain's offline fake chat
model and a PostgresSaver on the test database: a run SIGKILLed after its enqueue committed
and before LangGraph checkpointed the step resumes in a new process whose model gives other
tool-call ids, and the reference service sees one effect; unsettled outcomes come back as
answers, not errors. The same on asyncio: ``ainvoke``, an AsyncPostgresSaver, ``outbox.aio``.

The canonical graph (model node, ToolNode, tools_condition) on a checkpoint store that takes
a second per write (``tests/acceptance/langgraph_runner.py``), SIGKILLed at each moment of its
first tool call and resumed with ``invoke_thread``: one effect per thread; resumed with the
``get_state().next`` check instead, a second one (issue 31)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.orm import Session

import outbox
from outbox import aio
from outbox.contracts import CONTRACTS, ToolContract
from outbox.db import create_async_engine
from outbox.dev.service import DeployService
from outbox.integrations import langgraph as adapter
from outbox.integrations.langgraph import OutboxTool, outbox_tool
from outbox.states import State
from outbox.urls import libpq_url
from tests.acceptance.conftest import REPO
from tests.acceptance.langgraph_runner import MARKER, PHASES
from tests.processes import Service, Services, wait_until
from tests.tool_configs import TOOL

EXAMPLE = REPO / "examples" / "langgraph_agent.py"
RUNNER = "tests.acceptance.langgraph_runner"


@pytest.fixture
def broker(rabbitmq_url: str) -> str:
    """RabbitMQ only: the adapter does not depend on the broker."""
    return rabbitmq_url


@pytest.fixture
def saver(database_url: str) -> Iterator[PostgresSaver]:
    """LangGraph's Postgres checkpointer, its tables beside the outbox's in the test database."""
    with PostgresSaver.from_conn_string(libpq_url(database_url)) as checkpointer:
        checkpointer.setup()
        yield checkpointer


def _operations(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT id, intent_key FROM outbox.operations")))


def _events(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["sync", "async"])
def test_a_run_killed_after_its_enqueue_resumes_with_new_tool_call_ids_and_one_effect(
    engine: Engine,
    service: DeployService,
    services: Services,
    stack_env: dict[str, str],
    saver: PostgresSaver,
    tmp_path: Path,
    mode: list[str],
) -> None:
    """The example agent SIGKILLed while its tool waits (the enqueue committed, the step not
    checkpointed) resumes from the checkpoint in a new process, whose model gives the tool
    call another id, and gets the same operation back: one release at the service. Both with
    graph.invoke and with --async (graph.ainvoke, AsyncPostgresSaver, outbox.aio)."""
    thread = f"thread-{uuid.uuid4()}"
    command = [sys.executable, str(EXAMPLE), "--thread", thread, "--version", "2.0.0", *mode]
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


#: What each phase leaves in the checkpointer: the latest checkpoint's step and the channels
#: of its pending writes (``None``: no checkpoint yet). "writes-saved" is left out: whether
#: the first checkpoint was saved before the kill is a race of two one-second writes.
LEFT_BEHIND: dict[str, tuple[int, set[str]] | None] = {
    "model-answered": None,
    "intent-committed": None,
    # The red team's state: the model's answer is in pending writes, get_state().next is ().
    "writes-checkpointed": (0, {"messages", "branch:to:tools"}),
    "waiting": (1, set()),
}


def _agent(services: Services, name: str, *args: str) -> Service:
    """Start the canonical graph (``langgraph_runner``) as ``name``."""
    env = {
        **services.env,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    agent = Service(name, args, env, services.log_dir, module=RUNNER)
    services.started.append(agent)
    return agent


def _killed_at(services: Services, runs: dict[str, list[str]]) -> None:
    """Run each thread's first turn (``--die-at PHASE`` among its arguments) until it
    SIGKILLs itself, all at once."""
    agents = [
        _agent(services, f"first-{thread}", "--thread", thread, "--target", thread, *args)
        for thread, args in runs.items()
    ]
    for agent in agents:
        assert agent.process.wait(90) == -signal.SIGKILL, agent.output()[-3000:]


def _resumed(services: Services, runs: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Each thread run again in a process of its own, all at once: what each answered."""
    agents = {
        thread: _agent(services, f"again-{thread}", "--thread", thread, "--target", thread, *args)
        for thread, args in runs.items()
    }
    results: dict[str, dict[str, Any]] = {}
    for thread, agent in agents.items():
        assert agent.process.wait(90) == 0, agent.output()[-3000:]
        [line] = [x for x in agent.output().splitlines() if x.startswith(MARKER)]
        results[thread] = json.loads(line.removeprefix(MARKER))
    return results


def _left_behind(saver: PostgresSaver, thread: str) -> tuple[int, set[str]] | None:
    saved = saver.get_tuple({"configurable": {"thread_id": thread}})
    if saved is None:
        return None
    return saved.metadata["step"], {channel for _, channel, _ in saved.pending_writes or []}


def _operations_of(engine: Engine, thread: str) -> list[Any]:
    with engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT id, intent_key FROM outbox.operations WHERE intent_key LIKE :p"),
                {"p": f"{thread}:%"},
            )
        )


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--async"]], ids=["invoke_thread", "ainvoke_thread"])
def test_a_graph_on_a_slow_checkpoint_store_killed_at_any_phase_resumes_to_one_effect(
    engine: Engine,
    service: DeployService,
    services: Services,
    saver: PostgresSaver,
    mode: list[str],
) -> None:
    """The canonical graph (model node, ToolNode, PostgresSaver or AsyncPostgresSaver taking a
    second per write, durability "async") SIGKILLed before its model's writes are saved, when
    its intent commits, after the writes are saved, once they sit in a saved checkpoint's
    pending writes, and while it waits for the outcome, then run again in a new process with
    invoke_thread and the same input, gets its one operation back: one effect per thread."""
    phases = {phase: f"{phase}-{uuid.uuid4().hex[:8]}" for phase in PHASES}
    _killed_at(services, {thread: ["--die-at", phase, *mode] for phase, thread in phases.items()})
    for phase, thread in phases.items():
        assert len(_operations_of(engine, thread)) == (phase != "model-answered"), phase
        if phase in LEFT_BEHIND:
            assert _left_behind(saver, thread) == LEFT_BEHIND[phase], phase
    services.start("relay", "relay")
    services.start("worker", "worker", "-c", "1", "-P", "threads")

    results = _resumed(services, dict.fromkeys(phases.values(), mode))

    for phase, thread in phases.items():
        operations = _operations_of(engine, thread)
        assert [key for _, key in operations] == [f"{thread}:tools@2:{TOOL}:0"], phase
        [(op_id, _)] = operations
        [report] = results[thread]["reports"]
        assert (report["operation_id"], report["outcome"]) == (str(op_id), "confirmed"), phase
        assert [e.key for e in service.ledger() if e.target == thread] == [str(op_id)], phase


@pytest.mark.slow
def test_the_next_check_starts_a_new_turn_over_saved_writes_and_acts_twice(
    engine: Engine, service: DeployService, services: Services, saver: PostgresSaver
) -> None:
    """The check the example used to teach (invoke(None) only if get_state().next) on a thread
    killed while its model's answer sat in a saved checkpoint's pending writes starts a new
    turn with the first input: its call comes two steps later, under a new key, and the
    service releases twice (sync and async alike)."""
    modes = {f"sync-{uuid.uuid4().hex[:8]}": [], f"async-{uuid.uuid4().hex[:8]}": ["--async"]}
    _killed_at(services, {t: ["--die-at", "writes-checkpointed", *m] for t, m in modes.items()})
    services.start("relay", "relay")
    services.start("worker", "worker", "-c", "1", "-P", "threads")

    _resumed(services, {thread: ["--resume", "next", *mode] for thread, mode in modes.items()})

    for thread in modes:
        keys = sorted(key for _, key in _operations_of(engine, thread))
        assert keys == [f"{thread}:tools@2:{TOOL}:0", f"{thread}:tools@4:{TOOL}:0"]

    def released_twice() -> bool:
        return all(len([e for e in service.ledger() if e.target == t]) == 2 for t in modes)

    wait_until(released_twice, timeout=30, what="both threads' two releases")


def _tools_graph(tool: OutboxTool, saver: BaseCheckpointSaver[Any]) -> Any:
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


@contextlib.asynccontextmanager
async def _async_saver(database_url: str) -> AsyncIterator[AsyncPostgresSaver]:
    """LangGraph's async Postgres checkpointer on the test database (per event loop)."""
    async with AsyncPostgresSaver.from_conn_string(libpq_url(database_url)) as checkpointer:
        await checkpointer.setup()
        yield checkpointer


@contextlib.asynccontextmanager
async def _async_engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """An AsyncEngine on the test database, and the waits' listener closed after it."""
    async_engine = create_async_engine(database_url)
    try:
        yield async_engine
    finally:
        await aio.close()
        await async_engine.dispose()


def _tool_calls(*call_ids: str, target: str = "web") -> list[AIMessage]:
    """A model's replies: one call of the outbox tool per id (as if asked again each time)."""
    name = outbox_tool(TOOL).name
    args = {"target": target, "payload": {"version": "3.0.0"}}
    return [AIMessage("", tool_calls=[{"id": i, "name": name, "args": args}]) for i in call_ids]


@pytest.mark.slow
def test_an_async_run_makes_its_tool_call_through_the_outbox_with_the_derived_key(
    engine: Engine, service: DeployService, services: Services, database_url: str
) -> None:
    """graph.ainvoke with an AsyncPostgresSaver, a model node and ToolNode: the call is
    recorded under thread:tools@step:tool:0 (not the model's tool-call id), carried out once
    by the relay and a worker, and answered confirmed within wait_s."""
    services.start("relay", "relay")
    services.start("worker", "worker", "-c", "1", "-P", "threads")
    thread = f"thread-{uuid.uuid4()}"
    [asks] = _tool_calls("call_first")
    model = GenericFakeChatModel(messages=iter([asks, AIMessage("Released.")]))

    async def agent(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"], config)]}

    async def scenario() -> dict[str, Any]:
        async with _async_engine(database_url) as async_engine, _async_saver(database_url) as s:
            builder = StateGraph(MessagesState)
            builder.add_node("agent", agent)
            builder.add_node("tools", ToolNode([outbox_tool(TOOL, engine=async_engine, wait_s=60)]))
            builder.add_edge(START, "agent")
            builder.add_conditional_edges("agent", tools_condition)
            builder.add_edge("tools", "agent")
            graph = builder.compile(checkpointer=s)
            inputs: MessagesState = {"messages": [HumanMessage("release 3.0.0 of web")]}
            result: dict[str, Any] = await graph.ainvoke(
                inputs, {"configurable": {"thread_id": thread}}
            )
            return result

    result = asyncio.run(scenario())

    [answer] = [m for m in result["messages"] if isinstance(m, ToolMessage)]
    report = answer.artifact
    assert (answer.status, answer.tool_call_id) == ("success", "call_first")
    assert (report["outcome"], report["intent_key"]) == ("confirmed", f"{thread}:tools@2:{TOOL}:0")
    assert _operations(engine) == [(uuid.UUID(report["operation_id"]), report["intent_key"])]
    assert service.effects_by_key() == {report["operation_id"]: 1}
    assert result["messages"][-1].content == "Released."


def test_an_async_node_run_again_after_its_enqueue_asks_for_the_same_operation(
    engine: Engine, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node of your own (await model.ainvoke, await tool.ainvoke) dies after its enqueue
    committed, before its step is checkpointed; the thread resumed on another event loop asks
    the model again, which gives the call another id, and the tool answers with the operation
    the first run recorded: pending, as an answer saying not to call again, never a second
    operation. The tool has no engine: the configured database, through outbox.aio."""
    monkeypatch.setattr(adapter, "database_url", lambda: database_url)
    tool = outbox_tool(TOOL, wait_s=0.2)
    model = GenericFakeChatModel(messages=iter(_tool_calls("call_before", "call_after")))
    died: list[bool] = []

    async def agent(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        reply = await model.ainvoke(state["messages"], config)
        results = [
            await tool.ainvoke({**call, "type": "tool_call"}, config)
            for call in getattr(reply, "tool_calls", [])
        ]
        if not died:
            died.append(True)
            raise RuntimeError("the process dies after the enqueue")
        return {"messages": [reply, *results]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_edge(START, "agent")
    builder.add_edge("agent", END)
    config: Any = {"configurable": {"thread_id": f"thread-{uuid.uuid4()}"}}

    async def run(inputs: Any) -> dict[str, Any]:
        async with _async_saver(database_url) as saver:
            try:
                result: dict[str, Any] = await builder.compile(checkpointer=saver).ainvoke(
                    inputs, config
                )
            finally:
                await aio.close()
            return result

    with pytest.raises(RuntimeError, match="dies after the enqueue"):
        asyncio.run(run({"messages": [HumanMessage("release 3.0.0 of web")]}))
    [(op_id, intent_key)] = _operations(engine)
    assert intent_key == f"{config['configurable']['thread_id']}:agent@1:{TOOL}:0"

    resumed = asyncio.run(run(None))

    answer = resumed["messages"][-1]
    assert isinstance(answer, ToolMessage)
    assert (answer.status, answer.tool_call_id) == ("success", "call_after")
    assert (answer.artifact["operation_id"], answer.artifact["outcome"]) == (
        str(op_id),
        "in_progress",
    )
    assert "Do not call this tool again for the same purpose" in answer.content
    assert _operations(engine) == [(op_id, intent_key)]


@pytest.mark.parametrize("engine_kind", ["async", "sync"])
def test_an_async_graph_pauses_for_approval_and_its_resumed_node_finds_the_same_operation(
    engine: Engine, database_url: str, engine_kind: str
) -> None:
    """Under graph.ainvoke and ToolNode, interrupt_on_approval pauses the graph with the
    report; approved and resumed with Command(resume=...), the node finds the same operation.
    On an AsyncEngine (outbox.aio) and on a sync Engine (the sync call in a worker thread)."""
    config: Any = {"configurable": {"thread_id": f"thread-{uuid.uuid4()}"}}

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        async with _async_engine(database_url) as async_engine, _async_saver(database_url) as s:
            tool = outbox_tool(
                TOOL,
                engine=async_engine if engine_kind == "async" else engine,
                wait_s=0.2,
                require_approval=True,
                interrupt_on_approval=True,
            )
            graph = _tools_graph(tool, s)
            paused = await graph.ainvoke({"messages": [_asks(tool, "web")]}, config)
            with Session(engine) as session, session.begin():
                op = outbox.get(session, paused["__interrupt__"][0].value["operation_id"])
                assert op is not None
                outbox.approve(session, op.id, by="alice", payload_hash=op.payload_hash)
            resumed = await graph.ainvoke(Command(resume="approved"), config)
            return paused, resumed

    paused, resumed = asyncio.run(scenario())

    [pause] = paused["__interrupt__"]
    assert pause.value["outcome"] == "awaiting_approval"
    report = resumed["messages"][-1].artifact
    assert (report["operation_id"], report["state"]) == (
        pause.value["operation_id"],
        State.PLANNED.value,
    )
    assert report["intent_key"] == f"{config['configurable']['thread_id']}:tools@1:{TOOL}:0"
    assert len(_operations(engine)) == 1
