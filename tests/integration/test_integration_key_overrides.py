"""Each framework adapter's intent key is overridable: the user's own function replaces the
derived one, gets the run's durable parts (never the provider's tool-call id), and two runs
whose models give the call other ids still ask for one operation. Each framework's offline
test model drives the calls; no worker runs, so every call answers "in progress"."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from agents import Agent as SdkAgent
from agents import RunContextWrapper, Runner, set_tracing_disabled
from agents.testing.model import (
    ModelCall,
    ModelStep,
    ScriptedModel,
    assistant_message,
    function_call,
)
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from sqlalchemy import Engine, text

from outbox.integrations import langgraph, openai_agents, pydantic_ai
from outbox.integrations.langgraph import CallIdentity
from outbox.integrations.openai_agents import OutboxRun

set_tracing_disabled(True)  # the SDK would export traces to OpenAI: no network here

TOOL = "deploy.create_release"
ARGUMENTS = {"target": "web", "payload": {"version": "1.0.0"}}


def _keys(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.execute(text("SELECT intent_key FROM outbox.operations")).scalars())


def test_pydantic_ai_uses_a_run_id_and_a_key_function_of_ones_own(engine: Engine) -> None:
    """outbox_tool(run_id=, intent_key=): the key is the user's, built from the run's parts;
    a second run whose model gives the call another id is the same operation."""
    parts_seen: list[dict[str, Any]] = []

    def key(**parts: Any) -> str:
        parts_seen.append(parts)
        return f"mine/{parts['run_id']}/{parts['step']}/{parts['tool']}/{parts['ordinal']}"

    tool = pydantic_ai.outbox_tool(
        TOOL, engine=engine, wait_s=0, run_id=lambda _ctx: "ticket-4711", intent_key=key
    )

    def run(call_id: str) -> dict[str, Any]:
        def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            returned = [p for p in messages[-1].parts if isinstance(p, ToolReturnPart)]
            if returned:
                return ModelResponse(parts=[TextPart(json.dumps(returned[0].content))])
            name = info.function_tools[0].name
            return ModelResponse(parts=[ToolCallPart(name, ARGUMENTS, tool_call_id=call_id)])

        result = asyncio.run(Agent(FunctionModel(respond), tools=[tool]).run("deploy"))
        answer: dict[str, Any] = json.loads(result.output)
        return answer

    first, second = run("call-first"), run("call-second")

    assert _keys(engine) == [f"mine/ticket-4711/response-0/{TOOL}/0"]
    assert first["operation_id"] == second["operation_id"]
    assert first["outcome"] == "in_progress"
    assert sorted(parts_seen[0]) == ["ordinal", "run_id", "step", "tool"]
    assert not any("call-" in str(value) for parts in parts_seen for value in parts.values())


def test_openai_agents_uses_an_identity_and_a_key_function_of_ones_own(engine: Engine) -> None:
    """outbox_function_tool(identity=, intent_key=): the OutboxRun found in the user's own
    context and the user's key; a replay of the turn with other call ids is one operation."""

    def key(**parts: Any) -> str:
        return f"mine/{parts['run_id']}/{parts['step']}/{parts['ordinal']}"

    def identity(wrapper: RunContextWrapper[Any]) -> OutboxRun:
        found: OutboxRun = wrapper.context["outbox"]
        return found

    tool = openai_agents.outbox_function_tool(
        TOOL, engine=engine, wait_s=0, identity=identity, intent_key=key
    )

    def echo(call: ModelCall) -> Any:
        outputs = [
            i for i in call.input if isinstance(i, dict) and i.get("type") == "function_call_output"
        ]
        return [assistant_message(str(outputs[-1]["output"]))]

    def run(call_id: str) -> dict[str, Any]:
        model = ScriptedModel(
            [[function_call(tool.name, ARGUMENTS, call_id=call_id)], ModelStep.respond(echo)]
        )
        agent = SdkAgent(name="deployer", model=model, tools=[tool])
        context = {"outbox": OutboxRun("ticket-9", turn=1)}  # a fresh one: a replayed turn
        result = asyncio.run(Runner.run(agent, "deploy", context=context))
        answer: dict[str, Any] = json.loads(str(result.final_output))
        return answer

    first, second = run("call-first"), run("call-second")

    assert _keys(engine) == ["mine/ticket-9/turn-1/0"]
    assert first["operation_id"] == second["operation_id"]
    assert first["outcome"] == "in_progress"


def test_langgraph_uses_a_key_function_of_ones_own(engine: Engine) -> None:
    """outbox_tool(intent_key=): the user's function gets the call's CallIdentity (thread,
    node, step, tool, ordinal: no tool-call id) and its key is the operation's; the node run
    again with another tool-call id is the same operation."""
    identities: list[CallIdentity] = []

    def key(identity: CallIdentity) -> str:
        identities.append(identity)
        return f"mine/{identity.thread_id}/{identity.node}/{identity.tool}/{identity.ordinal}"

    tool = langgraph.outbox_tool(TOOL, engine=engine, wait_s=0, intent_key=key)
    graph = StateGraph(MessagesState)
    graph.add_node("tools", ToolNode([tool]))
    graph.add_edge(START, "tools")
    graph.add_edge("tools", END)
    compiled = graph.compile()
    thread = f"thread-{uuid.uuid4().hex[:8]}"

    def run(call_id: str) -> dict[str, Any]:
        asked = AIMessage("", tool_calls=[{"id": call_id, "name": tool.name, "args": ARGUMENTS}])
        result = compiled.invoke({"messages": [asked]}, {"configurable": {"thread_id": thread}})
        [answer] = [m for m in result["messages"] if isinstance(m, ToolMessage)]
        assert answer.status == "success", answer.content
        artifact: dict[str, Any] = answer.artifact
        return artifact

    first, second = run("call_first"), run("call_second")

    assert _keys(engine) == [f"mine/{thread}/tools/{TOOL}/0"]
    assert first["operation_id"] == second["operation_id"]
    assert first["outcome"] == "in_progress"
    assert {(i.node, i.step, i.ordinal) for i in identities} == {("tools", 1, 0)}
    assert "call_" not in repr(identities)


def _agents_and_ids(engine: Engine) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT agent, intent_key FROM outbox.operations ORDER BY agent"))
        return [(row.agent, row.intent_key) for row in rows]


def test_pydantic_ai_tools_of_two_agents_with_one_run_id_are_two_operations(
    engine: Engine,
) -> None:
    """outbox_tool(agent=): two agents' runs under one run id ask for one key each in their
    own scope, so two operations; neither answer names the other's."""

    def run(agent: str) -> dict[str, Any]:
        tool = pydantic_ai.outbox_tool(
            TOOL, engine=engine, wait_s=0, run_id=lambda _ctx: "ticket-1", agent=agent
        )

        def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            returned = [p for p in messages[-1].parts if isinstance(p, ToolReturnPart)]
            if returned:
                return ModelResponse(parts=[TextPart(json.dumps(returned[0].content))])
            name = info.function_tools[0].name
            return ModelResponse(parts=[ToolCallPart(name, ARGUMENTS, tool_call_id="c-1")])

        result = asyncio.run(Agent(FunctionModel(respond), tools=[tool]).run("deploy"))
        answer: dict[str, Any] = json.loads(result.output)
        return answer

    a, b = run("agent-a"), run("agent-b")
    assert a["operation_id"] != b["operation_id"]
    assert a["operation_id"] not in json.dumps(b)
    key = f"ticket-1:response-0:{TOOL}:0"
    assert _agents_and_ids(engine) == [("agent-a", key), ("agent-b", key)]


def test_openai_agents_runs_of_two_agents_with_one_run_id_are_two_operations(
    engine: Engine,
) -> None:
    """OutboxRun(agent=): two agents' turns under one run id are two operations."""
    tool = openai_agents.outbox_function_tool(TOOL, engine=engine, wait_s=0)

    def echo(call: ModelCall) -> Any:
        outputs = [
            i for i in call.input if isinstance(i, dict) and i.get("type") == "function_call_output"
        ]
        return [assistant_message(str(outputs[-1]["output"]))]

    def run(agent: str) -> dict[str, Any]:
        model = ScriptedModel(
            [[function_call(tool.name, ARGUMENTS, call_id="c-1")], ModelStep.respond(echo)]
        )
        sdk_agent = SdkAgent(name="deployer", model=model, tools=[tool])
        context = OutboxRun("ticket-2", turn=0, agent=agent)
        result = asyncio.run(Runner.run(sdk_agent, "deploy", context=context))
        answer: dict[str, Any] = json.loads(str(result.final_output))
        return answer

    a, b = run("agent-a"), run("agent-b")
    assert a["operation_id"] != b["operation_id"]
    assert [agent for agent, _key in _agents_and_ids(engine)] == ["agent-a", "agent-b"]
