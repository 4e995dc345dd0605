"""Untagged tool calls (issue 17) on every surface, through the real SDKs, with the tiny
model forced to write the call's JSON without its <tool_call> tags."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.clients import forced_scheduler, openai_sdk, streamed_chat
from tests.conftest import MODEL_NAME, make_client
from tests.test_anthropic import sdk as anthropic_sdk
from tests.test_anthropic import sdk_http

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
SCRIPTS = {
    "bare": CALL,
    "fenced": f"```json\n{CALL}\n```",
    "answer": '{"city": "Paris", "days": 2}',
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def forced(tiny_model_dir, reference):
    yield from forced_scheduler(tiny_model_dir, reference.tokenizer, SCRIPTS)


def ask(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Weather in Paris? FORCE:{name}"}]


async def chat(scheduler, script: str, **config):
    async with make_client(scheduler, **config) as http:
        return await openai_sdk(http).chat.completions.create(
            model=MODEL_NAME, messages=ask(script), tools=TOOLS, max_tokens=80, temperature=0
        )


async def test_a_fenced_untagged_call_is_a_chat_tool_call(forced):
    choice = (await chat(forced, "fenced")).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


async def test_a_streamed_untagged_call_arrives_as_a_tool_call_delta(forced):
    async with make_client(forced) as http:
        content, parts, finish = await streamed_chat(
            http, model=MODEL_NAME, messages=ask("bare"), tools=TOOLS, max_tokens=80, temperature=0
        )
    assert (content, finish) == ("", "tool_calls")
    (part,) = parts
    assert (part.index, part.function.name) == (0, "get_weather")
    assert json.loads(part.function.arguments) == {"city": "Paris", "days": 2}


async def test_json_that_is_not_a_call_stays_chat_content(forced):
    choice = (await chat(forced, "answer")).choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("stop", None)
    assert choice.message.content == SCRIPTS["answer"]


async def test_strict_tool_calls_leaves_the_untagged_call_as_content(forced):
    choice = (await chat(forced, "fenced", strict_tool_calls=True)).choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("stop", None)
    assert choice.message.content == SCRIPTS["fenced"]


async def test_an_untagged_call_is_a_responses_function_call(forced):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    async with make_client(forced) as http:
        response = await openai_sdk(http).responses.create(
            model=MODEL_NAME, input="Weather? FORCE:bare", tools=tools, temperature=0
        )
    (item,) = response.output
    assert (item.type, item.name, item.status) == ("function_call", "get_weather", "completed")
    assert json.loads(item.arguments) == {"city": "Paris", "days": 2}


async def test_an_untagged_call_is_an_anthropic_tool_use_block(forced):
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    async with sdk_http(forced) as http:
        message = await anthropic_sdk(http).messages.create(
            model=MODEL_NAME,
            max_tokens=80,
            messages=ask("fenced"),
            tools=tools,
            extra_body={"temperature": 0},
        )
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert isinstance(block, anthropic.types.ToolUseBlock)
    assert (block.name, block.input) == ("get_weather", {"city": "Paris", "days": 2})
