"""The canonical LangGraph agent in a process of its own, on a slow checkpoint store, that
can SIGKILL itself at a chosen moment of its first tool call.

``python -m tests.acceptance.langgraph_runner --thread T [--async] [--die-at PHASE]
[--resume thread|next]`` loads the tools (``OUTBOX_CONFIG``) and runs one turn of the graph
LangGraph's docs teach: a model node (LangChain's offline ``GenericFakeChatModel``, which asks
for the outbox tool with a fresh tool-call id each time, then answers in words once the tool
has), ``ToolNode([outbox_tool(...)])``, ``tools_condition``, and a ``PostgresSaver`` (or
``AsyncPostgresSaver``) whose every write sleeps ``--checkpoint-delay-s`` before it really
writes, under the default ``durability="async"``. ``--resume thread`` runs the turn with
``invoke_thread``; ``--resume next`` with ``graph.invoke(None if graph.get_state(config).next
else input, config)``, the check the example used to teach. It prints ``RESULT <json>``: the
tool's reports and the model's last words.

``--die-at`` sends the process SIGKILL at one moment of the first turn (:data:`PHASES`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import ChannelVersions, Checkpoint, CheckpointMetadata
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from sqlalchemy import event
from sqlalchemy.orm import Session

from outbox import aio
from outbox.db import create_async_engine, database_url, get_engine
from outbox.integrations.langgraph import ainvoke_thread, invoke_thread, outbox_tool
from outbox.tools import load_tools
from outbox.urls import libpq_url
from tests.tool_configs import TOOL

#: What the runner prints before its JSON answer.
MARKER = "RESULT "

#: The moments ``--die-at`` names, in the order a slow store reaches them.
PHASES = {
    "model-answered": "the model node returned its tool call; none of its writes is saved",
    "intent-committed": "the tool's intent committed; the checkpoints are still being written",
    "writes-saved": "the model node's writes saved; the checkpoint they belong to maybe not",
    "writes-checkpointed": "the checkpoint holding the model's writes as pending writes saved; "
    "the step's own checkpoint not (get_state().next is empty)",
    "waiting": "the tools step's checkpoint saved; the tool waits for the outcome",
}

#: The channel a model node's writes go to when it asks for a tool (tools_condition's route).
_TO_TOOLS = "branch:to:tools"


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Moments:
    """Which of the first turn's writes were saved, to die at :data:`PHASES`' moments."""

    def __init__(self, die_at: str | None) -> None:
        self.die_at = die_at
        self._lock = threading.Lock()
        self._saved: set[str] = set()  # checkpoint ids
        self._model_writes_of: str | None = None  # the checkpoint the model's writes are on

    def reached(self, phase: str) -> None:
        if phase == self.die_at:
            _die()

    def checkpoint_saved(self, parent_id: str | None, checkpoint_id: str) -> None:
        with self._lock:
            self._saved.add(checkpoint_id)
            model_on = self._model_writes_of
        if checkpoint_id == model_on:
            self.reached("writes-checkpointed")
        elif model_on is not None and parent_id == model_on:
            self.reached("waiting")

    def writes_saved(self, checkpoint_id: str, channels: Sequence[str]) -> None:
        if _TO_TOOLS not in channels:
            return
        with self._lock:
            if self._model_writes_of is not None:
                return  # a later turn's model asked again: only the first call counts
            self._model_writes_of = checkpoint_id
            saved = checkpoint_id in self._saved
        self.reached("writes-saved")
        if saved:
            self.reached("writes-checkpointed")


def _ids(config: RunnableConfig, checkpoint: Checkpoint) -> tuple[str | None, str]:
    return (config.get("configurable") or {}).get("checkpoint_id"), checkpoint["id"]


class _SlowSaver(PostgresSaver):
    """A PostgresSaver whose every write takes ``delay_s`` longer: it sleeps, then writes."""

    delay_s: float = 1.0
    moments: _Moments = _Moments(None)

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        time.sleep(self.delay_s)
        saved = super().put(config, checkpoint, metadata, new_versions)
        self.moments.checkpoint_saved(*_ids(config, checkpoint))
        return saved

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        time.sleep(self.delay_s)
        super().put_writes(config, writes, task_id, task_path)
        self.moments.writes_saved(config["configurable"]["checkpoint_id"], [c for c, _ in writes])


class _SlowAsyncSaver(AsyncPostgresSaver):
    """:class:`_SlowSaver` on asyncio: ``aput`` and ``aput_writes`` sleep, then write."""

    delay_s: float = 1.0
    moments: _Moments = _Moments(None)

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        await asyncio.sleep(self.delay_s)
        saved = await super().aput(config, checkpoint, metadata, new_versions)
        self.moments.checkpoint_saved(*_ids(config, checkpoint))
        return saved

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        await asyncio.sleep(self.delay_s)
        await super().aput_writes(config, writes, task_id, task_path)
        self.moments.writes_saved(config["configurable"]["checkpoint_id"], [c for c, _ in writes])


def _reply(messages: Sequence[AnyMessage], tool_name: str, args: argparse.Namespace) -> AIMessage:
    """What the model says: the tool call (with a fresh id, as a provider mints one) until
    the tool has answered, then the answer in words."""
    if isinstance(messages[-1], ToolMessage):
        return AIMessage(f"The outbox answered: {messages[-1].content}")
    call = {
        "id": f"call_{uuid.uuid4().hex[:12]}",
        "name": tool_name,
        "args": {"target": args.target, "payload": {"version": args.version}},
    }
    return AIMessage("", tool_calls=[call])


def _builder(tool: Any, args: argparse.Namespace, moments: _Moments) -> StateGraph[MessagesState]:
    def agent(state: MessagesState, config: RunnableConfig) -> dict[str, Any]:
        reply = _reply(state["messages"], tool.name, args)
        model = GenericFakeChatModel(messages=iter([reply]))
        answer = model.invoke(state["messages"], config)
        if getattr(answer, "tool_calls", None):
            moments.reached("model-answered")
        return {"messages": [answer]}

    builder = StateGraph(MessagesState)
    builder.add_node("agent", agent)
    builder.add_node("tools", ToolNode([tool]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder


def _request(args: argparse.Namespace) -> MessagesState:
    return {"messages": [HumanMessage(f"Release {args.version} of {args.target}.")]}


def _run(args: argparse.Namespace, moments: _Moments) -> dict[str, Any]:
    tool = outbox_tool(TOOL, engine=get_engine(), wait_s=args.wait_s)
    config: RunnableConfig = {"configurable": {"thread_id": args.thread}}
    with _SlowSaver.from_conn_string(libpq_url(database_url())) as saver:
        assert isinstance(saver, _SlowSaver)  # from_conn_string yields cls(...)
        saver.delay_s, saver.moments = args.checkpoint_delay_s, moments
        graph = _builder(tool, args, moments).compile(checkpointer=saver)
        if args.resume == "thread":
            result: dict[str, Any] = invoke_thread(graph, _request(args), config)
            return result
        pending = graph.get_state(config).next
        old: dict[str, Any] = graph.invoke(None if pending else _request(args), config)
        return old


async def _run_async(args: argparse.Namespace, moments: _Moments) -> dict[str, Any]:
    engine = create_async_engine(database_url())
    try:
        tool = outbox_tool(TOOL, engine=engine, wait_s=args.wait_s)
        config: RunnableConfig = {"configurable": {"thread_id": args.thread}}
        async with _SlowAsyncSaver.from_conn_string(libpq_url(database_url())) as saver:
            assert isinstance(saver, _SlowAsyncSaver)
            saver.delay_s, saver.moments = args.checkpoint_delay_s, moments
            graph = _builder(tool, args, moments).compile(checkpointer=saver)
            if args.resume == "thread":
                result: dict[str, Any] = await ainvoke_thread(graph, _request(args), config)
                return result
            pending = (await graph.aget_state(config)).next
            old: dict[str, Any] = await graph.ainvoke(None if pending else _request(args), config)
            return old
    finally:
        await aio.close()
        await engine.dispose()


def main(argv: list[str] | None = None) -> int:
    """Run (or resume) one turn of the thread and print its answer."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--thread", required=True)
    parser.add_argument("--target", default="web")
    parser.add_argument("--version", default="1.0.0")
    parser.add_argument("--wait-s", type=float, default=60.0)
    parser.add_argument("--checkpoint-delay-s", type=float, default=1.0)
    parser.add_argument("--async", dest="asynchronous", action="store_true")
    parser.add_argument("--resume", choices=["thread", "next"], default="thread")
    parser.add_argument("--die-at", choices=sorted(PHASES))
    args = parser.parse_args(argv)
    load_tools()
    moments = _Moments(args.die_at)
    if args.die_at == "intent-committed":
        # The first commit of an ORM session in this process is the tool's enqueue (the
        # checkpointer writes through psycopg, not through a Session).
        event.listen(Session, "after_commit", lambda _session: moments.reached(args.die_at))
    final = asyncio.run(_run_async(args, moments)) if args.asynchronous else _run(args, moments)
    messages = final["messages"]
    output = {
        "reports": [m.artifact for m in messages if isinstance(m, ToolMessage)],
        "tool_call_ids": [
            c["id"] for m in messages if isinstance(m, AIMessage) for c in m.tool_calls
        ],
        "answer": messages[-1].content,
    }
    sys.stdout.write(MARKER + json.dumps(output) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
