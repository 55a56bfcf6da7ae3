"""The PydanticAI and OpenAI Agents SDK adapters, driven by each framework's offline test
model against a real relay, a real worker and the reference service.

The crash tests run the agent in a process of its own (``tests/acceptance/agent_runner.py``)
while no relay runs, so the committed intent cannot be carried out before the test SIGKILLs
the agent (after the intent's commit, before the framework has a result); the run then
resumes in a new process with the same run identity while the scripted model mints another
tool-call id, and the reference service's ledger must hold one effect; a conversation's later
turn killed before its messages were saved is run again as the docs teach, to one effect.
One stack (a worker,
the reference service) serves the whole module; each test uses its own target.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from agents import Agent as SdkAgent
from agents import Runner, RunState, set_tracing_disabled
from agents.testing.model import (
    ModelCall,
    ModelStep,
    ScriptedModel,
    assistant_message,
    function_call,
)
from pydantic_ai import Agent
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

import outbox
from outbox import aio
from outbox.contracts import CONTRACTS, ToolContract
from outbox.db import create_async_engine
from outbox.dev.service import DeployService
from outbox.dev.tool_config import http_tool_toml
from outbox.integrations import openai_agents
from outbox.integrations.openai_agents import (
    OutboxRun,
    outbox_function_tool,
    outbox_status_tool,
)
from outbox.integrations.pydantic_ai import outbox_tool, outbox_toolset
from outbox.reports import DO_NOT_RETRY_DERIVED_KEY
from tests.acceptance.agent_runner import MARKER
from tests.acceptance.conftest import REPO, clean_environment
from tests.processes import Service, Services, wait_until
from tests.tool_configs import TOOL

pytestmark = pytest.mark.slow

set_tracing_disabled(True)  # the SDK would export traces to OpenAI: no network here

#: A tool of the same service whose every operation waits for a person's approval.
APPROVED_TOOL = "deploy.approved_release"
#: The payload schema of TOOL, as the TOML declares it.
INPUT_SCHEMA = {
    "type": "object",
    "required": ["version"],
    "additionalProperties": False,
    "properties": {"version": {"type": "string"}},
}
PENDING_WORDS = DO_NOT_RETRY_DERIVED_KEY


@dataclass
class Stack:
    """The module's processes, its reference service and database."""

    services: Services
    service: DeployService
    engine: Engine
    database_url: str
    env: dict[str, str]
    log_dir: Path
    relay: Service | None = None
    agents: list[Service] = field(default_factory=list)

    def start_relay(self) -> None:
        """Start the relay unless it runs."""
        if self.relay is None:
            self.relay = self.services.start("relay", "relay")

    def stop_relay(self) -> None:
        """Stop the relay if it runs: committed intents then stay `planned`."""
        if self.relay is not None:
            self.relay.stop()
            self.relay = None

    def agent(self, framework: str, **options: str) -> Service:
        """Start ``agent_runner`` for ``framework`` with ``--name value`` options."""
        args = [framework]
        for name, value in options.items():
            args += [f"--{name.replace('_', '-')}", value]
        name = f"agent-{len(self.agents)}"
        agent = Service(name, args, self.env, self.log_dir, module="tests.acceptance.agent_runner")
        self.services.started.append(agent)
        self.agents.append(agent)
        return agent

    def effects(self, target: str) -> list[Any]:
        """The reference service's effects on ``target``."""
        return [effect for effect in self.service.ledger() if effect.target == target]

    def operations(self, run_id: str) -> list[dict[str, Any]]:
        """The operations whose intent keys start with ``run_id``."""
        with self.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, intent_key, state FROM outbox.operations "
                    "WHERE intent_key LIKE :prefix"
                ),
                {"prefix": f"{run_id}:%"},
            )
            return [dict(row._mapping) for row in rows]


def _tools_toml(url: str) -> str:
    schema = "\n".join(
        [
            f'[tools."{TOOL}".input_schema]',
            'type = "object"',
            'required = ["version"]',
            "additionalProperties = false",
            'properties = { version = { type = "string" } }',
        ]
    )
    settings: dict[str, Any] = {"timeout_s": 5.0, "send_deadline_s": 2.0, "inflight_horizon_s": 60}
    return (
        http_tool_toml(url, TOOL, **settings)
        + schema
        + "\n"
        + http_tool_toml(url, APPROVED_TOOL, approval="required", **settings)
    )


@pytest.fixture(scope="module")
def stack(
    database_url: str, rabbitmq_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A worker (the relay is started by the tests that want one) and the reference service."""
    log_dir = tmp_path_factory.mktemp("integrations")
    engine = create_engine(database_url)
    with engine.begin() as conn:  # what earlier modules left must not reach this service
        conn.execute(
            text(
                "TRUNCATE outbox.operations, outbox.events, outbox.webhook_deliveries, "
                "outbox.waiters, outbox.tool_policies, outbox.sagas, outbox.saga_steps, "
                "outbox.saga_events"
            )
        )
    with DeployService(port=0) as service:
        config = log_dir / "tools.toml"
        config.write_text(_tools_toml(service.url), encoding="utf-8")
        env = clean_environment(
            OUTBOX_DATABASE_URL=database_url,
            OUTBOX_BROKER_URL=rabbitmq_url,
            # Every operation through the relay's message: stopping the relay holds a new
            # intent `planned` while its agent dies (a worker taking directly would run it).
            OUTBOX_BROKER_DIRECT_TAKE="false",
            OUTBOX_CONFIG=str(config),
            OUTBOX_HOME=str(log_dir / "home"),
            OUTBOX_REPUBLISH_AFTER="2",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        )
        services = Services(env, log_dir)
        services.start("worker", "worker", "-c", "1", "-P", "solo")
        running = Stack(services, service, engine, database_url, env, log_dir)
        try:
            wait_until(
                lambda: _policy_published(engine), timeout=60, what="the worker's tool policies"
            )
            yield running
        finally:
            services.stop_all()
            for name, output in services.logs():
                print(f"----- {name} -----\n{output[-3000:]}")  # noqa: T201
            engine.dispose()


def _policy_published(engine: Engine) -> bool:
    with engine.connect() as conn:
        return bool(
            conn.execute(
                text("SELECT count(*) FROM outbox.tool_policies WHERE tool = :t"),
                {"t": APPROVED_TOOL},
            ).scalar()
        )


def _answer(agent: Service) -> dict[str, Any]:
    lines = [line for line in agent.output().splitlines() if line.startswith(MARKER)]
    assert lines, agent.output()[-3000:]
    answer: dict[str, Any] = json.loads(lines[-1][len(MARKER) :])
    return answer


def _crash_and_resume(stack: Stack, framework: str) -> None:
    """Kill the agent after its intent committed, resume with another tool-call id: one effect."""
    run_id, target = f"conv-{uuid.uuid4().hex[:8]}", f"project-{uuid.uuid4().hex[:8]}"
    stack.stop_relay()
    first = stack.agent(framework, run_id=run_id, call_id="call-first", target=target)
    wait_until(
        lambda: bool(stack.operations(run_id)) or not first.alive(),
        timeout=60,
        what="the committed intent",
    )
    assert first.alive(), first.output()[-3000:]  # still waiting for the outcome: no result yet
    first.kill()
    [planned] = stack.operations(run_id)
    assert planned["state"] == "planned"
    assert stack.effects(target) == []

    stack.start_relay()
    resumed = stack.agent(framework, run_id=run_id, call_id="call-second", target=target)
    assert resumed.process.wait(90) == 0, resumed.output()[-3000:]
    answer = _answer(resumed)
    assert answer["outcome"] == "confirmed"
    assert answer["operation_id"] == str(planned["id"])
    assert [op["id"] for op in stack.operations(run_id)] == [planned["id"]]
    [effect] = stack.effects(target)
    assert answer["remote_ref"] == effect.id
    assert effect.key == str(planned["id"])


@pytest.mark.parametrize("framework", ["pydantic-sync", "pydantic-async"])
def test_pydantic_ai_run_killed_after_its_intent_commits_resumes_to_one_effect(
    stack: Stack, framework: str
) -> None:
    """A PydanticAI run (run_sync on an Engine, or run on an AsyncEngine) killed after the
    tool's intent committed, resumed in a new process whose model uses another tool-call id,
    ends with one effect and names the same operation."""
    _crash_and_resume(stack, framework)


def test_openai_agents_run_killed_after_its_intent_commits_resumes_to_one_effect(
    stack: Stack,
) -> None:
    """An OpenAI Agents SDK run killed after the tool's intent committed, resumed in a new
    process whose model uses another tool-call id, ends with one effect and names the same
    operation."""
    _crash_and_resume(stack, "openai")


def _a_later_turn_killed_and_resumed(stack: Stack, framework: str) -> str:
    """A conversation kept as the docs teach (its messages saved when a turn ends) has a first
    turn; its second turn is killed after the model's answer, once the tool's intent committed
    and before the turn ended and was saved; the turn is run again exactly as before (the
    same saved messages, prompt, conversation and turn). The operation's intent key."""
    run_id, target = f"conv-{uuid.uuid4().hex[:8]}", f"project-{uuid.uuid4().hex[:8]}"
    history = stack.log_dir / f"{run_id}.json"
    common = {"run_id": run_id, "target": target, "history": str(history)}
    first_turn = stack.agent(framework, call_id="unused", prompt="hello", turn="0", **common)
    assert first_turn.process.wait(90) == 0, first_turn.output()[-3000:]
    after_first_turn = history.read_bytes()
    stack.stop_relay()
    killed = stack.agent(framework, call_id="call-first", turn="1", **common)
    wait_until(
        lambda: bool(stack.operations(run_id)) or not killed.alive(),
        timeout=60,
        what="the committed intent",
    )
    assert killed.alive(), killed.output()[-3000:]
    killed.kill()
    assert history.read_bytes() == after_first_turn  # the killed turn was not saved
    [planned] = stack.operations(run_id)

    stack.start_relay()
    resumed = stack.agent(framework, call_id="call-second", turn="1", **common)
    assert resumed.process.wait(90) == 0, resumed.output()[-3000:]
    answer = _answer(resumed)
    assert (answer["outcome"], answer["operation_id"]) == ("confirmed", str(planned["id"]))
    assert [op["id"] for op in stack.operations(run_id)] == [planned["id"]]
    assert [effect.key for effect in stack.effects(target)] == [str(planned["id"])]
    return str(planned["intent_key"])


@pytest.mark.parametrize("framework", ["pydantic-sync", "pydantic-async"])
def test_pydantic_ai_later_turn_killed_before_its_history_is_saved_resumes_to_one_effect(
    stack: Stack, framework: str
) -> None:
    """A PydanticAI conversation whose history is saved at each turn's end, killed in its
    second turn between the model's tool call and the save, run again with the saved history
    and the same prompt: the model's response has the same position (response-1), so the call
    finds its operation, and the service sees one effect."""
    key = _a_later_turn_killed_and_resumed(stack, framework)
    assert key.split(":")[1:] == ["response-1", TOOL, "0"]


def test_openai_agents_later_turn_killed_before_its_input_list_is_saved_resumes_to_one_effect(
    stack: Stack,
) -> None:
    """An OpenAI Agents SDK conversation whose input list is saved at each turn's end, killed in
    its second turn between the model's tool call and the save, run again with the saved list,
    the same message and the same turn (a fresh OutboxRun): the call finds its operation, and
    the service sees one effect."""
    key = _a_later_turn_killed_and_resumed(stack, "openai")
    assert key.split(":")[1:] == ["turn-1", TOOL, "0"]


def test_openai_agents_turns_counted_from_a_session_number_a_killed_turn_again_and_act_twice(
    stack: Stack,
) -> None:
    """Turns numbered by the user messages in an SDK Session (what the docs used to suggest):
    the SDK saves the message when the run starts, so a second turn killed after its intent
    committed is numbered anew when run again, under a new key, and the service acts twice."""
    run_id, target = f"conv-{uuid.uuid4().hex[:8]}", f"project-{uuid.uuid4().hex[:8]}"
    common = {"run_id": run_id, "target": target, "session": str(stack.log_dir / f"{run_id}.db")}
    first_turn = stack.agent("openai", call_id="unused", prompt="hello", **common)
    assert first_turn.process.wait(90) == 0, first_turn.output()[-3000:]
    stack.stop_relay()
    killed = stack.agent("openai", call_id="call-first", **common)
    wait_until(lambda: bool(stack.operations(run_id)), timeout=60, what="the committed intent")
    killed.kill()

    stack.start_relay()
    again = stack.agent("openai", call_id="call-second", **common)
    assert again.process.wait(90) == 0, again.output()[-3000:]

    keys = sorted(str(op["intent_key"]).split(":")[1] for op in stack.operations(run_id))
    assert keys == ["turn-1", "turn-2"]
    wait_until(lambda: len(stack.effects(target)) == 2, timeout=30, what="both effects")


def _echo(call: ModelCall) -> Any:
    """The SDK model's last step: answer with the tool's output."""
    outputs = [
        i for i in call.input if isinstance(i, dict) and i.get("type") == "function_call_output"
    ]
    return [assistant_message(str(outputs[-1]["output"]))]


def _pydantic_model(target: str, call_id: str, payloads: list[dict[str, Any]]) -> FunctionModel:
    """Calls the tool with each payload in turn (after a retry prompt, the next), then answers
    with the tool's result as JSON."""
    sent: list[str] = []

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        parts = messages[-1].parts
        # PydanticAI 2 answers a ModelRetry with a tool return whose outcome is "retried".
        retry = [
            p
            for p in parts
            if isinstance(p, RetryPromptPart)
            or (isinstance(p, ToolReturnPart) and p.outcome == "retried")
        ]
        returned = [p for p in parts if isinstance(p, ToolReturnPart) and p not in retry]
        if returned:
            return ModelResponse(parts=[TextPart(json.dumps(returned[0].content, default=str))])
        sent.extend(str(p.content) for p in retry)
        payload = payloads[len(sent)]
        name = info.function_tools[0].name
        arguments = {"target": target, "payload": payload}
        return ModelResponse(parts=[ToolCallPart(name, arguments, tool_call_id=call_id)])

    model = FunctionModel(respond)
    model.retries_seen = sent  # type: ignore[attr-defined]
    return model


def test_pydantic_ai_async_run_answers_pending_as_a_result_then_the_same_operation(
    stack: Stack,
) -> None:
    """An async PydanticAI run that cannot wait gets "in progress, do not call again for the same
    purpose" as the tool's result, and a resumed run with another tool-call id gets that same
    operation, confirmed, with one effect."""
    stack.start_relay()
    run_id, target = f"conv-{uuid.uuid4().hex[:8]}", f"project-{uuid.uuid4().hex[:8]}"

    async def run(call_id: str, wait_s: float) -> dict[str, Any]:
        engine = create_async_engine(stack.database_url)
        try:
            model = _pydantic_model(target, call_id, [{"version": "2.0.0"}])
            agent = Agent(model, tools=[outbox_tool(TOOL, engine=engine, wait_s=wait_s)])
            result = await agent.run("deploy", conversation_id=run_id)
            answer: dict[str, Any] = json.loads(result.output)
            return answer
        finally:
            await aio.close()
            await engine.dispose()

    pending = asyncio.run(run("call-a", 0))
    assert pending["outcome"] == "in_progress"
    assert pending["settled"] is False
    assert PENDING_WORDS in pending["message"]
    done = asyncio.run(run("call-b", 60))
    assert done["outcome"] == "confirmed"
    assert done["operation_id"] == pending["operation_id"]
    assert len(stack.effects(target)) == 1


@pytest.fixture
def schema_contract() -> Iterator[None]:
    """This process knows TOOL's payload schema (as an agent that loaded its tools does)."""
    CONTRACTS.register(ToolContract(name=TOOL, input_schema=INPUT_SCHEMA))
    yield
    CONTRACTS.clear()


@pytest.mark.usefixtures("schema_contract")
def test_pydantic_ai_payload_refused_by_the_schema_asks_the_model_to_fix_that_field(
    stack: Stack,
) -> None:
    """A payload that does not match the tool's input_schema comes back to the PydanticAI model
    as a retry naming the field; the corrected call goes through, and the model was shown the
    schema."""
    stack.start_relay()
    run_id, target = f"conv-{uuid.uuid4().hex[:8]}", f"project-{uuid.uuid4().hex[:8]}"
    model = _pydantic_model(target, "call-1", [{"version": 3}, {"version": "3.0.0"}])
    tool = outbox_tool(TOOL, engine=stack.engine, wait_s=60)
    assert tool.tool_def.parameters_json_schema["properties"]["payload"]["required"] == ["version"]
    # run(), not run_sync(): run_sync leaves its event loop to the process (the sync path
    # runs in the crash test's own process).
    result = asyncio.run(Agent(model, tools=[tool]).run("deploy", conversation_id=run_id))
    [retry] = model.retries_seen  # type: ignore[attr-defined]
    assert "payload.version" in retry
    assert json.loads(result.output)["outcome"] == "confirmed"
    assert len(stack.effects(target)) == 1


def test_openai_agents_approval_is_an_outbox_approval_and_then_one_effect(stack: Stack) -> None:
    """A tool that requires approval interrupts the SDK run with nothing sent; approving the
    interruption of the state restored from JSON records the approver in the outbox, bound to
    the payload, and the resumed run ends with one effect."""
    stack.start_relay()
    run = OutboxRun(f"conv-{uuid.uuid4().hex[:8]}", turn=1)
    target = f"project-{uuid.uuid4().hex[:8]}"
    tool = outbox_function_tool(APPROVED_TOOL, engine=stack.engine, wait_s=60, approval=True)

    model = ScriptedModel(
        [
            [
                function_call(
                    tool.name, {"target": target, "payload": {"version": "4.0.0"}}, call_id="c-1"
                )
            ],
            ModelStep.respond(_echo),
        ]
    )
    agent = SdkAgent(name="deployer", model=model, tools=[tool])

    async def scenario() -> tuple[Any, Any]:
        interrupted = await Runner.run(agent, "deploy", context=run)
        assert len(interrupted.interruptions) == 1
        [waiting] = stack.operations(run.run_id)
        assert waiting["state"] == "awaiting_approval"
        assert stack.effects(target) == []
        # Kept as JSON, as an application that asks a person later does, and restored.
        saved = interrupted.to_state().to_json(context_serializer=OutboxRun.to_dict)
        state = await RunState.from_json(agent, saved, context_deserializer=OutboxRun.from_dict)
        [item] = state.get_interruptions()
        with Session(stack.engine) as session, session.begin():
            approved = openai_agents.approve(session, state, item, by="alice")
        return approved, await Runner.run(agent, state)

    approved, resumed = asyncio.run(scenario())
    assert approved.decided_by == "alice"
    assert approved.approved_payload_hash == approved.payload_hash
    final = json.loads(str(resumed.final_output))
    assert final["outcome"] == "confirmed"
    assert final["operation_id"] == str(approved.id)
    [effect] = stack.effects(target)
    assert effect.key == str(approved.id)
    with Session(stack.engine) as session:
        assert outbox.get(session, approved.id).state is outbox.State.CONFIRMED  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("example", "options"),
    [
        ("pydantic_ai_agent.py", []),
        ("pydantic_ai_agent.py", ["--async"]),
        ("openai_agents_agent.py", ["--tool", APPROVED_TOOL, "--approve-as", "alice"]),
    ],
)
def test_each_example_runs_its_agent_to_one_release(
    stack: Stack, example: str, options: list[str]
) -> None:
    """Each example in examples/ runs its agent against the reference service to a confirmed
    release (the OpenAI one through its approval)."""
    stack.start_relay()
    target = f"project-{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / example),
            *("--target", target, "--conversation", f"ticket-{uuid.uuid4().hex[:8]}"),
            *options,
        ],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("confirmed: Done:"), done.stdout
    assert len(stack.effects(target)) == 1


def test_an_operation_awaiting_approval_is_a_pending_result_in_both_frameworks(
    stack: Stack,
) -> None:
    """Where the framework is not asked to interrupt, a tool whose operations need approval
    answers "awaiting approval, do not call again for the same purpose" as a normal result, and
    nothing is sent."""
    run_id, target = f"conv-{uuid.uuid4().hex[:8]}", f"project-{uuid.uuid4().hex[:8]}"
    model = _pydantic_model(target, "call-1", [{"version": "5.0.0"}])
    tool = outbox_tool(APPROVED_TOOL, engine=stack.engine, wait_s=60)
    result = asyncio.run(Agent(model, tools=[tool]).run("deploy", conversation_id=run_id))
    from_pydantic = json.loads(result.output)

    sdk_tool = outbox_function_tool(APPROVED_TOOL, engine=stack.engine, approval=False)
    arguments = {"target": target, "payload": {"version": "5.0.1"}}
    sdk_model = ScriptedModel(
        [[function_call(sdk_tool.name, arguments, call_id="c-1")], ModelStep.respond(_echo)]
    )
    sdk_agent = SdkAgent(name="deployer", model=sdk_model, tools=[sdk_tool])
    sdk_run = OutboxRun(f"{run_id}-sdk")
    from_sdk = json.loads(
        str(asyncio.run(Runner.run(sdk_agent, "deploy", context=sdk_run)).final_output)
    )

    for answer in (from_pydantic, from_sdk):
        assert answer["outcome"] == "awaiting_approval"
        assert answer["settled"] is True
        assert PENDING_WORDS in answer["message"]
    assert stack.effects(target) == []


def test_a_pending_answer_is_followed_up_with_the_status_tool_not_a_second_request(
    stack: Stack,
) -> None:
    """A PydanticAI model told "in progress" checks with outbox_status (in the toolset) and gets
    the confirmed outcome of the same operation; an unknown id is not_found, in the SDK too."""
    stack.start_relay()
    run_id, target = f"conv-{uuid.uuid4().hex[:8]}", f"project-{uuid.uuid4().hex[:8]}"
    calls: list[str] = []

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returned = [p for p in messages[-1].parts if isinstance(p, ToolReturnPart)]
        if not returned:
            calls.append("deploy_create_release")
            arguments = {"target": target, "payload": {"version": "6.0.0"}}
            return ModelResponse(parts=[ToolCallPart(calls[-1], arguments, tool_call_id="c1")])
        content: dict[str, Any] = json.loads(json.dumps(returned[0].content))
        if returned[0].tool_name == "outbox_status":
            return ModelResponse(parts=[TextPart(json.dumps(content))])
        assert content["outcome"] == "in_progress"
        calls.append("outbox_status")
        arguments = {"operation_id": content["operation_id"]}
        return ModelResponse(parts=[ToolCallPart(calls[-1], arguments, tool_call_id="c2")])

    toolset = outbox_toolset(TOOL, engine=stack.engine, wait_s=0)
    agent = Agent(FunctionModel(respond), toolsets=[toolset])
    result = asyncio.run(agent.run("deploy", conversation_id=run_id))
    status = json.loads(result.output)
    assert calls == ["deploy_create_release", "outbox_status"]
    assert status["outcome"] == "confirmed"
    [op] = stack.operations(run_id)
    assert status["operation_id"] == str(op["id"])
    assert len(stack.effects(target)) == 1

    sdk_status = outbox_status_tool(engine=stack.engine)
    missing = str(uuid.uuid4())
    sdk_model = ScriptedModel(
        [
            [function_call(sdk_status.name, {"operation_id": missing}, call_id="s-1")],
            ModelStep.respond(_echo),
        ]
    )
    sdk_agent = SdkAgent(name="checker", model=sdk_model, tools=[sdk_status])
    answer = asyncio.run(Runner.run(sdk_agent, "check", context=OutboxRun(run_id)))
    assert json.loads(str(answer.final_output))["outcome"] == "not_found"


@pytest.fixture
def approval_contract() -> Iterator[None]:
    """This process knows that APPROVED_TOOL requires approval (its loaded contract says so)."""
    CONTRACTS.register(ToolContract(name=APPROVED_TOOL, approval_required=True))
    yield
    CONTRACTS.clear()


@pytest.mark.usefixtures("approval_contract")
def test_openai_agents_rejection_cancels_the_operation_and_tells_the_model_why(
    stack: Stack,
) -> None:
    """A tool whose loaded contract requires approval interrupts the SDK run; rejecting the
    interruption cancels the operation in the outbox with the rejecter recorded, the model is
    given the reason, and nothing is sent."""
    stack.start_relay()
    run = OutboxRun(f"conv-{uuid.uuid4().hex[:8]}", turn=1)
    target = f"project-{uuid.uuid4().hex[:8]}"
    tool = outbox_function_tool(APPROVED_TOOL, engine=stack.engine, wait_s=60)
    assert tool.needs_approval is not False
    arguments = {"target": target, "payload": {"version": "7.0.0"}}
    model = ScriptedModel(
        [[function_call(tool.name, arguments, call_id="c-1")], ModelStep.respond(_echo)]
    )
    agent = SdkAgent(name="deployer", model=model, tools=[tool])

    async def scenario() -> tuple[Any, Any]:
        interrupted = await Runner.run(agent, "deploy", context=run)
        [item] = interrupted.interruptions
        state = interrupted.to_state()
        with Session(stack.engine) as session, session.begin():
            rejected = openai_agents.reject(
                session, state, item, by="bob", reason="not on a Friday"
            )
        return rejected, await Runner.run(agent, state)

    rejected, resumed = asyncio.run(scenario())
    assert rejected.state is outbox.State.CANCELLED
    assert rejected.decided_by == "bob"
    assert "not on a Friday" in str(resumed.final_output)
    [op] = stack.operations(run.run_id)
    assert op["state"] == "cancelled"
    assert stack.effects(target) == []
