"""An agent run in a process of its own, driven by its framework's offline test model.

``python -m tests.acceptance.agent_runner FRAMEWORK --run-id R --call-id C --target T
--version V`` loads the tools (``OUTBOX_CONFIG``), runs one agent turn in which the scripted
model calls the outbox tool once with tool-call id ``C`` and then answers with the tool's
result, and prints ``RESULT <json>`` with that answer. FRAMEWORK is ``pydantic-sync``
(``run_sync``, a sync engine), ``pydantic-async`` (``run``, an async engine) or ``openai``
(the Agents SDK's ``Runner.run``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from outbox.db import create_async_engine, database_url, get_engine
from outbox.tools import load_tools
from tests.tool_configs import TOOL

#: What the runner prints before its JSON answer.
MARKER = "RESULT "


def _pydantic(args: argparse.Namespace, *, asynchronous: bool) -> str:
    from pydantic_ai import Agent  # noqa: PLC0415 -- only the chosen framework is imported
    from pydantic_ai.messages import (  # noqa: PLC0415
        ModelMessage,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel  # noqa: PLC0415

    from outbox.integrations.pydantic_ai import outbox_tool  # noqa: PLC0415

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returned = [p for p in messages[-1].parts if isinstance(p, ToolReturnPart)]
        if returned:
            return ModelResponse(parts=[TextPart(json.dumps(returned[0].content, default=str))])
        arguments = {"target": args.target, "payload": {"version": args.version}}
        name = info.function_tools[0].name
        return ModelResponse(parts=[ToolCallPart(name, arguments, tool_call_id=args.call_id)])

    if not asynchronous:
        agent = Agent(
            FunctionModel(respond),
            tools=[outbox_tool(TOOL, engine=get_engine(), wait_s=args.wait_s)],
        )
        return agent.run_sync("deploy", conversation_id=args.run_id).output

    async def run() -> str:
        from outbox import aio  # noqa: PLC0415 -- the async path only

        engine = create_async_engine(database_url())
        try:
            agent = Agent(
                FunctionModel(respond),
                tools=[outbox_tool(TOOL, engine=engine, wait_s=args.wait_s)],
            )
            return (await agent.run("deploy", conversation_id=args.run_id)).output
        finally:
            await aio.close()
            await engine.dispose()

    return asyncio.run(run())


def _openai(args: argparse.Namespace) -> str:
    from agents import (  # noqa: PLC0415 -- only the chosen framework is imported
        Agent,
        Runner,
        set_tracing_disabled,
    )
    from agents.testing.model import (  # noqa: PLC0415
        ModelCall,
        ModelStep,
        ScriptedModel,
        assistant_message,
        function_call,
    )

    from outbox.integrations.openai_agents import OutboxRun, outbox_function_tool  # noqa: PLC0415

    set_tracing_disabled(True)  # no network: traces would go to OpenAI
    tool = outbox_function_tool(TOOL, engine=get_engine(), wait_s=args.wait_s)

    def answer(call: ModelCall) -> Any:
        outputs = [
            i for i in call.input if isinstance(i, dict) and i.get("type") == "function_call_output"
        ]
        return [assistant_message(str(outputs[-1]["output"]))]

    model = ScriptedModel(
        [
            [
                function_call(
                    tool.name,
                    {"target": args.target, "payload": {"version": args.version}},
                    call_id=args.call_id,
                )
            ],
            ModelStep.respond(answer),
        ]
    )
    agent = Agent(name="deployer", model=model, tools=[tool])
    result = asyncio.run(Runner.run(agent, "deploy", context=OutboxRun(args.run_id, turn=0)))
    return str(result.final_output)


def main(argv: list[str] | None = None) -> int:
    """Run one agent turn and print its answer."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("framework", choices=["pydantic-sync", "pydantic-async", "openai"])
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--call-id", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--version", default="1.0.0")
    parser.add_argument("--wait-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    load_tools()
    if args.framework == "openai":
        output = _openai(args)
    else:
        output = _pydantic(args, asynchronous=args.framework == "pydantic-async")
    sys.stdout.write(MARKER + output + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
