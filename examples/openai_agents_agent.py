"""An OpenAI Agents SDK agent whose release tool goes through the outbox.

The model is the SDK's offline ScriptedModel (no provider, no key): it asks for one release
and then repeats the tool's answer. Swap in a real model and nothing else changes.

Before running it, start the reference service and the outbox with the same tools file:

    outbox dev deploy-service &
    OUTBOX_CONFIG=examples/tools.toml outbox up &
    OUTBOX_CONFIG=examples/tools.toml python examples/openai_agents_agent.py --conversation t-1

Run it again with the same --conversation and --turn (as a restarted agent would): the tool-call
id is new, but the intent key comes from the conversation, the turn and the call's position, so
the answer names the same operation and the service holds one release.

With --tool deploy.approved_release the tool requires approval: the run stops at the SDK's
approval interruption with the operation waiting in the outbox, and --approve-as NAME approves
it in both (the outbox records NAME and the payload's hash) and resumes the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from typing import Any

from agents import Agent, Runner, set_tracing_disabled
from agents.testing.model import (
    ModelCall,
    ModelStep,
    ScriptedModel,
    assistant_message,
    function_call,
)
from sqlalchemy.orm import Session

from outbox.db import get_engine
from outbox.integrations import openai_agents
from outbox.integrations.openai_agents import (
    OutboxRun,
    outbox_function_tool,
    outbox_status_tool,
)
from outbox.tools import load_tools


def scripted_model(tool_name: str, target: str, version: str) -> ScriptedModel:
    """Calls the outbox tool once, then answers with what the tool returned."""

    def answer(call: ModelCall) -> Any:
        outputs = [
            item["output"]
            for item in call.input
            if isinstance(item, dict) and item.get("type") == "function_call_output"
        ]
        return [assistant_message(str(outputs[-1]))]

    arguments = {"target": target, "payload": {"version": version}}
    call_id = f"call-{uuid.uuid4().hex[:8]}"  # new on every run, like a provider's
    return ScriptedModel(
        [[function_call(tool_name, arguments, call_id=call_id)], ModelStep.respond(answer)]
    )


async def run(args: argparse.Namespace) -> str:
    """One turn of the conversation; approves on the way if told to."""
    engine = get_engine()
    tool = outbox_function_tool(args.tool, engine=engine, wait_s=args.wait_s)
    agent = Agent(
        name="deployer",
        model=scripted_model(tool.name, args.target, args.version),
        # outbox_status: what a model told "pending" should call instead of asking again.
        tools=[tool, outbox_status_tool(engine=engine)],
    )
    identity = OutboxRun(args.conversation, turn=args.turn)
    result = await Runner.run(agent, f"Release {args.version}", context=identity)
    if result.interruptions:
        if not args.approve_as:
            return json.dumps(
                {"outcome": "awaiting_approval", "message": "approve with --approve-as NAME"}
            )
        state = result.to_state()
        with Session(engine) as session, session.begin():
            for item in result.interruptions:
                openai_agents.approve(session, state, item, by=args.approve_as)
        result = await Runner.run(agent, state)
    return str(result.final_output)


def main() -> None:
    """Run one agent turn and print its answer."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversation", default="ticket-1", help="the run's durable identity")
    parser.add_argument("--turn", type=int, default=1, help="the user turn this run serves")
    parser.add_argument("--target", default="project-a", help="the project to release")
    parser.add_argument("--version", default="1.2.3", help="the version to release")
    parser.add_argument("--tool", default="deploy.create_release", help="the outbox tool")
    parser.add_argument("--wait-s", type=float, default=30.0, help="how long a call waits")
    parser.add_argument("--approve-as", help="approve an interrupted call as this person")
    args = parser.parse_args()
    set_tracing_disabled(True)  # the SDK would export traces to OpenAI
    load_tools()  # OUTBOX_CONFIG: the tool's payload schema and approval policy
    report = json.loads(asyncio.run(run(args)))
    print(f"{report['outcome']}: {report['message']}")  # noqa: T201


if __name__ == "__main__":
    main()
