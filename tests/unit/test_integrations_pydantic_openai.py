"""The adapters' durable keys and argument checks, without a database or a model."""

from __future__ import annotations

import pytest
from pydantic_ai import RunContext
from pydantic_ai.messages import ModelRequest, ModelResponse, ToolCallPart, UserPromptPart
from pydantic_ai.models.test import TestModel
from pydantic_ai.usage import RunUsage

from outbox.contracts import CONTRACTS, ToolContract
from outbox.integrations._calls import (
    BadArguments,
    arguments_of,
    description_of,
    parameters_schema,
)
from outbox.integrations.keys import durable_intent_key
from outbox.integrations.openai_agents import OutboxRun
from outbox.integrations.pydantic_ai import call_ordinal, call_step

TOOL = "deploy.create_release"


def _key(run: OutboxRun, call_id: str) -> str:
    return run.key_for(TOOL, call_id, durable_intent_key)


def test_a_replayed_sdk_turn_gets_the_same_keys_whatever_the_call_ids() -> None:
    """A fresh OutboxRun for the same run and turn gives the calls the same keys in the same
    order although their call ids differ; another turn gives other keys."""
    first = OutboxRun("conv-1", turn=2)
    keys = [_key(first, "call_a"), _key(first, "call_b")]
    assert keys == [
        "conv-1:turn-2:deploy.create_release:0",
        "conv-1:turn-2:deploy.create_release:1",
    ]
    replay = OutboxRun("conv-1", turn=2)
    assert [_key(replay, "call_x"), _key(replay, "call_y")] == keys
    assert _key(OutboxRun("conv-1", turn=3), "call_a") != keys[0]


def test_an_sdk_call_asked_about_twice_keeps_its_key_through_json() -> None:
    """A call id seen before keeps its key, also in an OutboxRun rebuilt from its dict."""
    run = OutboxRun("conv-1")
    key = _key(run, "call_a")
    assert _key(run, "call_a") == key
    restored = OutboxRun.from_dict(run.to_dict())
    assert _key(restored, "call_a") == key
    assert _key(restored, "call_b").endswith(":1")


def _context(messages: list[object], call_id: str) -> RunContext[None]:
    return RunContext(
        deps=None,
        model=TestModel(),
        usage=RunUsage(),
        messages=messages,  # type: ignore[arg-type]
        tool_call_id=call_id,
        tool_name="deploy_create_release",
    )


def test_pydantic_ai_steps_count_model_responses_and_ordinals_count_the_tools_calls() -> None:
    """The step is the position of the response that made the call, the ordinal the call's
    position among the same tool's calls in it; the tool-call id only finds the call."""
    prompt = ModelRequest(parts=[UserPromptPart("deploy")])
    earlier = ModelResponse(parts=[ToolCallPart("deploy_create_release", {}, tool_call_id="c1")])
    latest = ModelResponse(
        parts=[
            ToolCallPart("other_tool", {}, tool_call_id="o1"),
            ToolCallPart("deploy_create_release", {}, tool_call_id="c1"),
            ToolCallPart("deploy_create_release", {}, tool_call_id="c2"),
        ]
    )
    messages: list[object] = [prompt, earlier, prompt, latest]
    assert call_step(_context(messages, "c2")) == "response-1"
    assert call_ordinal(_context(messages, "c2")) == 1
    # An id reused by the provider is the latest response's call.
    assert call_step(_context(messages, "c1")) == "response-1"
    assert call_ordinal(_context(messages, "c1")) == 0


def test_the_parameters_are_target_and_the_tools_payload_schema() -> None:
    """The model is shown target and payload (the tool's schema, or any object), never a key."""
    schema = {"type": "object", "properties": {"version": {"type": "string"}}}
    shown = parameters_schema(schema)
    assert shown["required"] == ["target", "payload"]
    assert shown["properties"]["payload"]["properties"] == schema["properties"]
    assert "intent_key" not in shown["properties"]
    assert parameters_schema(None)["properties"]["payload"]["type"] == "object"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"payload": {}}, "target"),
        ({"target": "", "payload": {}}, "target"),
        ({"target": "a", "payload": [1]}, "payload"),
        ({"target": "a", "payload": {}, "intent_key": "k"}, "intent_key"),
    ],
)
def test_malformed_arguments_name_the_argument(raw: dict[str, object], field: str) -> None:
    """A missing or malformed argument, or one the model must not give, is refused by name."""
    with pytest.raises(BadArguments) as refused:
        arguments_of(raw)
    assert refused.value.field == field


def test_a_pydantic_ai_call_missing_from_the_messages_is_refused_not_guessed() -> None:
    """A context that does not hold the call's response cannot name the call: no guessed key."""
    with pytest.raises(LookupError, match="pass step= and ordinal="):
        call_step(_context([ModelRequest(parts=[UserPromptPart("deploy")])], "c9"))
    with pytest.raises(LookupError):
        call_ordinal(_context([], "c9"))


def test_the_tools_own_description_comes_first() -> None:
    """A loaded contract's description leads the description the model reads."""
    CONTRACTS.register(ToolContract(name=TOOL, description="Ships a release to production."))
    try:
        assert description_of(TOOL, None).startswith("Ships a release to production. Request")
        assert description_of(TOOL, "mine") == "mine"
    finally:
        CONTRACTS.clear()
