"""Tool calls and reasoning on the OpenAI chat surface, through the real SDK, with the
tiny model forced (by a logits processor) to write tool-call and <think> markup."""

from __future__ import annotations

import json

import openai
import pytest

from tests.clients import forced_scheduler
from tests.conftest import MODEL_NAME, make_client
from tests.forcing import SCRIPTS, THINKING, TOOL_CALL, tool_round_trip_messages

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]


@pytest.fixture(scope="module")
def forced(tiny_model_dir, reference):
    yield from forced_scheduler(tiny_model_dir, reference.tokenizer, SCRIPTS)


def sdk(http_client) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://tandem.test/v1", api_key="x", http_client=http_client
    )


def ask(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Weather please. FORCE:{name}"}]


async def test_tool_call_is_parsed_into_sdk_tool_calls(forced):
    async with make_client(forced) as http:
        reply = await sdk(http).chat.completions.create(
            model=MODEL_NAME, messages=ask("tool"), tools=TOOLS, max_tokens=80, temperature=0
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert reply.speculation["draft_tokens"] >= 0  # extra field passes through the SDK


async def test_streamed_tool_call_deltas_assemble_to_the_same_calls(forced):
    async with make_client(forced) as http:
        client = sdk(http)
        whole = await client.chat.completions.create(
            model=MODEL_NAME, messages=ask("two"), tools=TOOLS, max_tokens=120, temperature=0
        )
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=ask("two"),
            tools=TOOLS,
            max_tokens=120,
            temperature=0,
            stream=True,
        )
        content, calls, finish = "", {}, None
        async for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                entry = calls.setdefault(part.index, {"id": part.id, "name": "", "args": ""})
                entry["name"] += part.function.name or ""
                entry["args"] += part.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert content == whole.choices[0].message.content == "Checking both."
    assembled = [(calls[i]["name"], json.loads(calls[i]["args"])) for i in sorted(calls)]
    expected = [
        (c.function.name, json.loads(c.function.arguments))
        for c in whole.choices[0].message.tool_calls
    ]
    assert (
        assembled == expected == [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
    )


async def test_tool_markup_without_tools_stays_content(forced):
    async with make_client(forced) as http:
        reply = await sdk(http).chat.completions.create(
            model=MODEL_NAME, messages=ask("tool"), max_tokens=80, temperature=0
        )
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == TOOL_CALL


async def test_tool_result_round_trip_renders_through_the_template(forced, reference):
    async with make_client(forced) as http:
        client = sdk(http)
        first = await client.chat.completions.create(
            model=MODEL_NAME, messages=ask("tool"), tools=TOOLS, max_tokens=80, temperature=0
        )
        call = first.choices[0].message.tool_calls[0]
        follow_up = [
            *ask("tool"),
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
            {"role": "user", "content": "Thanks. FORCE:plain"},
        ]
        second = await client.chat.completions.create(
            model=MODEL_NAME, messages=follow_up, tools=TOOLS, max_tokens=20, temperature=0
        )
    assert second.choices[0].message.content == "Just text."
    rendered = reference.tokenizer.apply_chat_template(
        tool_round_trip_messages(ask("tool")[0], call.id),
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in rendered
    ids = reference.tokenizer.encode(rendered, add_special_tokens=False)
    assert second.usage.prompt_tokens == len(ids)


async def test_reasoning_is_split_into_reasoning_content(forced):
    async with make_client(forced) as http:
        client = sdk(http)
        reply = await client.chat.completions.create(
            model=MODEL_NAME, messages=ask("think"), max_tokens=60, temperature=0
        )
        message = reply.choices[0].message
        assert message.content == "Hello there!"
        assert message.reasoning_content == "The user wants a greeting."
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=ask("think"), max_tokens=60, temperature=0, stream=True
        )
        reasoning, content = "", ""
        async for chunk in stream:
            if chunk.choices:
                delta = chunk.choices[0].delta
                reasoning += getattr(delta, "reasoning_content", None) or ""
                content += delta.content or ""
    assert (reasoning, content) == ("The user wants a greeting.", "Hello there!")


async def test_reasoning_parser_none_keeps_think_text(tiny_model_dir, reference, forced):
    async with make_client(forced, reasoning_parser="none") as http:
        reply = await sdk(http).chat.completions.create(
            model=MODEL_NAME, messages=ask("think"), max_tokens=60, temperature=0
        )
    assert reply.choices[0].message.content == THINKING
