"""An agent run in a process of its own, driven by its framework's offline test model.

``python -m tests.acceptance.agent_runner FRAMEWORK --run-id R --call-id C --target T
--version V`` loads the tools (``OUTBOX_CONFIG``), runs one agent turn in which the scripted
model calls the outbox tool once with tool-call id ``C`` and then answers with the tool's
result, and prints ``RESULT <json>`` with that answer. FRAMEWORK is ``pydantic-sync``
(``run_sync``, a sync engine), ``pydantic-async`` (``run``, an async engine) or ``openai``
(the Agents SDK's ``Runner.run``).

``--history FILE`` keeps the conversation as the docs teach: the turn runs on the messages
saved in FILE (PydanticAI's ``message_history``; the SDK's input list, with
``OutboxRun(run_id, turn=--turn)``), and FILE is written when the turn has ended, not before.
``--prompt hello`` is a turn in which the model answers in words and calls no tool.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from outbox.db import create_async_engine, database_url, get_engine
from outbox.tools import load_tools
from tests.tool_configs import TOOL

#: What the runner prints before its JSON answer.
MARKER = "RESULT "
#: The prompt of a turn in which the model asks for the outbox tool (any other: it chats).
DEPLOY = "deploy"


def _saved(history: str | None) -> bytes | None:
    """The conversation saved at the end of the last turn, if any."""
    path = Path(history) if history else None
    return path.read_bytes() if path is not None and path.exists() else None


def _save(history: str | None, data: bytes) -> None:
    """Save the conversation once the turn has ended (replaced whole, never half-written)."""
    if history:
        partial = Path(f"{history}.partial")
        partial.write_bytes(data)
        partial.replace(history)


def _pydantic(args: argparse.Namespace, *, asynchronous: bool) -> str:
    from pydantic_ai import Agent  # noqa: PLC0415 -- only the chosen framework is imported
    from pydantic_ai.messages import (  # noqa: PLC0415
        ModelMessage,
        ModelMessagesTypeAdapter,
        ModelResponse,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )
    from pydantic_ai.models.function import AgentInfo, FunctionModel  # noqa: PLC0415

    from outbox.integrations.pydantic_ai import outbox_tool  # noqa: PLC0415

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returned = [p for p in messages[-1].parts if isinstance(p, ToolReturnPart)]
        if returned:
            return ModelResponse(parts=[TextPart(json.dumps(returned[0].content, default=str))])
        prompts = [p.content for p in messages[-1].parts if isinstance(p, UserPromptPart)]
        if prompts != [DEPLOY]:
            return ModelResponse(parts=[TextPart("Hello.")])
        arguments = {"target": args.target, "payload": {"version": args.version}}
        name = info.function_tools[0].name
        return ModelResponse(parts=[ToolCallPart(name, arguments, tool_call_id=args.call_id)])

    saved = _saved(args.history)
    history = ModelMessagesTypeAdapter.validate_json(saved) if saved is not None else None
    if not asynchronous:
        agent = Agent(
            FunctionModel(respond),
            tools=[outbox_tool(TOOL, engine=get_engine(), wait_s=args.wait_s)],
        )
        result = agent.run_sync(args.prompt, message_history=history, conversation_id=args.run_id)
        _save(args.history, result.all_messages_json())
        return result.output

    async def run() -> str:
        from outbox import aio  # noqa: PLC0415 -- the async path only

        engine = create_async_engine(database_url())
        try:
            agent = Agent(
                FunctionModel(respond),
                tools=[outbox_tool(TOOL, engine=engine, wait_s=args.wait_s)],
            )
            ran = await agent.run(args.prompt, message_history=history, conversation_id=args.run_id)
            _save(args.history, ran.all_messages_json())
            return ran.output
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

    steps: list[Any] = [[assistant_message("Hello.")]]
    if args.prompt == DEPLOY:
        arguments = {"target": args.target, "payload": {"version": args.version}}
        steps = [
            [function_call(tool.name, arguments, call_id=args.call_id)],
            ModelStep.respond(answer),
        ]
    agent = Agent(name="deployer", model=ScriptedModel(steps), tools=[tool])
    if args.session:
        return asyncio.run(_openai_session_turn(args, agent))
    saved = _saved(args.history)
    said: list[Any] = [{"role": "user", "content": args.prompt}]
    turn_input: Any = json.loads(saved) + said if saved is not None else args.prompt
    run = OutboxRun(args.run_id, turn=args.turn)
    result = asyncio.run(Runner.run(agent, turn_input, context=run))
    _save(args.history, json.dumps(result.to_input_list()).encode())
    return str(result.final_output)


async def _openai_session_turn(args: argparse.Namespace, agent: Any) -> str:
    """The turn on an SDK ``SQLiteSession`` in ``--session``, numbered by the user messages
    the session holds before the run: the count the docs used to suggest, which a crash
    moves (the SDK saves the user's message when the run starts)."""
    from agents import Runner, SQLiteSession  # noqa: PLC0415 -- the openai path only

    from outbox.integrations.openai_agents import OutboxRun  # noqa: PLC0415

    session = SQLiteSession(args.run_id, args.session)
    try:
        items = await session.get_items()
        turn = len([i for i in items if isinstance(i, dict) and i.get("role") == "user"])
        run = OutboxRun(args.run_id, turn=turn)
        result = await Runner.run(agent, args.prompt, context=run, session=session)
        return str(result.final_output)
    finally:
        session.close()


def main(argv: list[str] | None = None) -> int:
    """Run one agent turn and print its answer."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("framework", choices=["pydantic-sync", "pydantic-async", "openai"])
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--call-id", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--version", default="1.0.0")
    parser.add_argument("--wait-s", type=float, default=60.0)
    parser.add_argument("--prompt", default=DEPLOY)
    parser.add_argument("--history", help="the conversation's file (saved at each turn's end)")
    parser.add_argument("--turn", type=int, default=0, help="the SDK's OutboxRun turn")
    parser.add_argument("--session", help="an SDK SQLiteSession's file, which numbers the turn")
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
