"""A LangGraph agent whose release goes through the outbox, and survives a crash.

One node asks a model, then makes the tool calls the model asked for through an outbox tool
(``outbox.integrations.langgraph.outbox_tool``); a ``PostgresSaver`` on the outbox's own
PostgreSQL checkpoints the thread. The model is LangChain's offline ``GenericFakeChatModel``:
no provider, no key, and new tool-call ids every time it is asked, as a real model's are.

Kill it while it waits for the release (Ctrl-C, or ``kill -9``) and run it again with the same
``--thread`` and the same request: ``invoke_thread`` sees that the thread has a step that did
not end and resumes it from its last checkpoint instead of starting a new turn, the node runs
again, the model is asked again and gives its tool call another id, and the outbox answers
with the operation the first run recorded. The reference service sees one release.
(``graph.invoke(None if graph.get_state(config).next else request, config)``, which this
example used to do, misses a step whose writes were saved and whose checkpoint was not, and
starts a new turn there: a second release.)

Run it against the reference service and a stack:

    outbox dev deploy-service --port 8900 &
    cat > tools.toml <<'EOF'
    [tools."deploy.create_release"]
    kind = "http"
    method = "POST"
    url = "http://127.0.0.1:8900/projects/{target}/releases"
    idempotency_header = "Idempotency-Key"
    remote_ref = "id"
    EOF
    export OUTBOX_CONFIG=$PWD/tools.toml   # and OUTBOX_DATABASE_URL, unless embedded
    outbox up &
    python examples/langgraph_agent.py --thread demo-1 --target web --version 1.4.0

With ``--async`` the same graph runs on asyncio: an async node, ``graph.ainvoke``, an
``AsyncPostgresSaver``, and the tool on an ``AsyncEngine`` (``outbox.aio``: its waits block no
event loop). Same keys, same answers: a thread may be started one way and resumed the other.

Needs ``pip install 'agent-outbox[langgraph,worker]'`` (``worker`` to load the TOML tool, so
the model is given its payload schema and the payload is checked before it is recorded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from collections.abc import Iterator
from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import END, START, MessagesState, StateGraph

from outbox import aio
from outbox.db import create_async_engine, database_url
from outbox.integrations.langgraph import (
    ainvoke_thread,
    athread_pending,
    invoke_thread,
    outbox_tool,
    thread_pending,
)
from outbox.urls import libpq_url

TOOL = "deploy.create_release"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _load_tools()
    url = database_url()
    final, pending = asyncio.run(_run_async(args, url)) if args.asynchronous else _run(args, url)
    # A report per call (the artifact); a refused call (bad input) has only its words.
    reports = [m.artifact or m.content for m in final["messages"] if isinstance(m, ToolMessage)]
    answer = final["messages"][-1].content
    if args.json:
        _emit(
            {
                "event": "done",
                "thread_id": args.thread,
                "resumed": bool(pending),
                "reports": reports,
                "answer": answer,
            }
        )
    else:
        for report in reports:
            print(report["message"] if isinstance(report, dict) else report)  # noqa: T201
        print(f"agent: {answer}")  # noqa: T201
    return 0


def _run(args: argparse.Namespace, url: str) -> tuple[dict[str, Any], bool]:
    """The thread run or resumed with ``invoke_thread``: its final state, and whether it was
    resumed."""
    tool = outbox_tool(TOOL, wait_s=args.wait)
    config: RunnableConfig = {"configurable": {"thread_id": args.thread}}
    with PostgresSaver.from_conn_string(libpq_url(url)) as saver:
        saver.setup()
        script = _script(tool.name, args.target, args.version, args.json)
        graph = _graph(tool, script).compile(checkpointer=saver)
        pending = thread_pending(graph, config)  # only to say so: invoke_thread decides
        # Resumed if a step of the thread did not end (this process was killed in a turn),
        # else a new turn with the request, which must be the one the killed run was given.
        final: dict[str, Any] = invoke_thread(graph, _request(args), config)
    return final, pending


async def _run_async(args: argparse.Namespace, url: str) -> tuple[dict[str, Any], bool]:
    """:func:`_run` on asyncio: ``ainvoke_thread``, ``AsyncPostgresSaver``, ``outbox.aio``."""
    engine = create_async_engine(url)
    try:
        tool = outbox_tool(TOOL, wait_s=args.wait, engine=engine)
        config: RunnableConfig = {"configurable": {"thread_id": args.thread}}
        async with AsyncPostgresSaver.from_conn_string(libpq_url(url)) as saver:
            await saver.setup()
            script = _script(tool.name, args.target, args.version, args.json)
            graph = _graph(tool, script, asynchronous=True).compile(checkpointer=saver)
            pending = await athread_pending(graph, config)
            final: dict[str, Any] = await ainvoke_thread(graph, _request(args), config)
    finally:
        await aio.close()  # the waits' shared listener, before the loop ends
        await engine.dispose()
    return final, pending


def _request(args: argparse.Namespace) -> MessagesState:
    return {"messages": [HumanMessage(f"Release {args.version} of {args.target}.")]}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Environment: OUTBOX_DATABASE_URL (unset: the embedded PostgreSQL), the\n"
        "database of the outbox and of the checkpoints; OUTBOX_CONFIG or OUTBOX_TOOLS, the\n"
        "deployment's tools (to know the payload's schema).",
    )
    parser.add_argument(
        "--thread",
        default=str(uuid.uuid4()),
        help="the LangGraph thread id; reuse it to resume (default: a new one)",
    )
    parser.add_argument("--target", default="web", help="the project to release (default web)")
    parser.add_argument("--version", default="1.0.0", help="the version to release")
    parser.add_argument(
        "--wait",
        type=float,
        default=30.0,
        help="seconds the tool waits for the outcome before it answers 'in progress' (default 30)",
    )
    parser.add_argument(
        "--async",
        dest="asynchronous",
        action="store_true",
        help="run the graph with ainvoke, an AsyncPostgresSaver and outbox.aio",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON line per event (what the model asked, the end)",
    )
    return parser


def _load_tools() -> None:
    """Load the deployment's tools when configured, so the adapter knows the payload schema."""
    if not (os.environ.get("OUTBOX_CONFIG") or os.environ.get("OUTBOX_TOOLS")):
        return
    try:
        from outbox.tools import load_tools  # noqa: PLC0415 - needs the [worker] extra
    except ImportError:
        return
    load_tools()


def _script(tool_name: str, target: str, version: str, json_lines: bool) -> Iterator[AIMessage]:
    """The model's answers: one tool call (a fresh id, as a provider mints one), then prose."""
    call_id = f"call_{uuid.uuid4().hex[:12]}"
    if json_lines:
        _emit({"event": "model", "tool_call_ids": [call_id]})
    args = {"target": target, "payload": {"version": version}}
    yield AIMessage("", tool_calls=[{"id": call_id, "name": tool_name, "args": args}])
    yield AIMessage(f"Asked for release {version} of {target}; the outbox's answer is above.")


def _graph(
    tool: BaseTool, script: Iterator[AIMessage], *, asynchronous: bool = False
) -> StateGraph[MessagesState]:
    model = GenericFakeChatModel(messages=script)

    def agent(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        """Ask the model, then make its tool calls (in its order, one at a time)."""
        reply = model.invoke(state["messages"], config)
        results = [
            tool.invoke({**call, "type": "tool_call"}, config)
            for call in getattr(reply, "tool_calls", [])
        ]
        return {"messages": [reply, *results]}

    async def agent_async(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        """The same node on asyncio: its calls still one at a time, in the model's order."""
        reply = await model.ainvoke(state["messages"], config)
        results = [
            await tool.ainvoke({**call, "type": "tool_call"}, config)
            for call in getattr(reply, "tool_calls", [])
        ]
        return {"messages": [reply, *results]}

    def route(state: MessagesState) -> str:
        return "agent" if isinstance(state["messages"][-1], ToolMessage) else END

    graph = StateGraph(MessagesState)
    if asynchronous:
        graph.add_node("agent", agent_async)
    else:
        graph.add_node("agent", agent)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", route, ["agent", END])
    return graph


def _emit(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)  # noqa: T201 - the example's output


if __name__ == "__main__":
    sys.exit(main())
