"""A PydanticAI agent whose release tool goes through the outbox.

The model is PydanticAI's offline FunctionModel (no provider, no key): it asks for one release
and then repeats the tool's answer. Swap in a real model and nothing else changes.

Before running it, start the reference service and the outbox with the same tools file:

    outbox dev deploy-service &
    OUTBOX_CONFIG=examples/tools.toml outbox up &
    OUTBOX_CONFIG=examples/tools.toml python examples/pydantic_ai_agent.py --conversation ticket-1

Run it again with the same --conversation (as a restarted agent would): the model's tool-call
id is new, but the intent key comes from the conversation, the model response and the call's
position, so the answer names the same operation and the service holds one release.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from outbox.db import create_async_engine, database_url, get_engine
from outbox.integrations.pydantic_ai import outbox_status_tool, outbox_tool
from outbox.tools import load_tools


def scripted_model(target: str, version: str) -> FunctionModel:
    """Calls the outbox tool once, then answers with what the tool returned."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        for part in messages[-1].parts:
            if part.part_kind == "tool-return":
                return ModelResponse(parts=[TextPart(json.dumps(part.content, default=str))])
        call = ToolCallPart(
            info.function_tools[0].name,
            {"target": target, "payload": {"version": version}},
            tool_call_id=f"call-{uuid.uuid4().hex[:8]}",  # new on every run, like a provider's
        )
        return ModelResponse(parts=[call])

    return FunctionModel(respond)


def main() -> None:
    """Run one agent turn and print its answer."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversation", default="ticket-1", help="the run's durable identity")
    parser.add_argument("--target", default="project-a", help="the project to release")
    parser.add_argument("--version", default="1.2.3", help="the version to release")
    parser.add_argument("--tool", default="deploy.create_release", help="the outbox tool")
    parser.add_argument("--wait-s", type=float, default=30.0, help="how long a call waits")
    parser.add_argument(
        "--async", dest="asynchronous", action="store_true", help="agent.run on an AsyncEngine"
    )
    args = parser.parse_args()
    load_tools()  # OUTBOX_CONFIG: the tool's payload schema and approval policy
    model = scripted_model(args.target, args.version)
    if args.asynchronous:
        answer = asyncio.run(_run_async(args, model))
    else:
        engine = get_engine()
        tool = outbox_tool(args.tool, engine=engine, wait_s=args.wait_s)
        # outbox_status: what a model told "pending" should call instead of asking again.
        agent = Agent(model, tools=[tool, outbox_status_tool(engine=engine)])
        answer = agent.run_sync(_prompt(args), conversation_id=args.conversation).output
    report: dict[str, Any] = json.loads(answer)
    print(f"{report['outcome']}: {report['message']}")  # noqa: T201


def _prompt(args: argparse.Namespace) -> str:
    return f"Release {args.version} of {args.target}"


async def _run_async(args: argparse.Namespace, model: FunctionModel) -> str:
    from outbox import aio  # noqa: PLC0415 -- the async path only

    engine = create_async_engine(database_url())
    try:
        tool = outbox_tool(args.tool, engine=engine, wait_s=args.wait_s)
        status = outbox_status_tool(engine=engine)
        result = await Agent(model, tools=[tool, status]).run(
            _prompt(args), conversation_id=args.conversation
        )
        return result.output
    finally:
        await aio.close()
        await engine.dispose()


if __name__ == "__main__":
    main()
