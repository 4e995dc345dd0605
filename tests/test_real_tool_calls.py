"""Issue 17 on the real model: Qwen2.5-Coder-0.5B-Instruct, asked by its own chat template
to wrap calls in <tool_call> tags, answers a weather question with the bare JSON of the
call. Every surface must still return a tool call. Slow (a float32 0.5B model on CPU):
few requests, short outputs, one scheduler for the module."""

from __future__ import annotations

import json

import anthropic
import pytest

from engines.model.gguf_import import import_gguf
from engines.model.packaged_models import QWEN_CODER_05B, packaged_gguf
from tests.clients import openai_sdk, streamed_chat
from tests.conftest import MODEL_NAME, make_client, start_scheduler
from tests.test_anthropic import sdk as anthropic_sdk
from tests.test_anthropic import sdk_http

pytestmark = pytest.mark.slow

QUESTION = "What's the weather in Paris right now? Use the tool."
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
DESCRIPTION = "Get the current weather in a city"
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": WEATHER},
    }
]
PARIS = {"city": "Paris"}


@pytest.fixture(scope="module")
def qwen():
    scheduler = start_scheduler(import_gguf(packaged_gguf(QWEN_CODER_05B)))
    yield scheduler
    scheduler.stop()


async def ask_chat(scheduler, messages: list[dict], **config):
    async with make_client(scheduler, **config) as http:
        return await openai_sdk(http).chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=40, temperature=0
        )


def question() -> list[dict]:
    return [{"role": "user", "content": QUESTION}]


async def test_chat_returns_the_untagged_call_as_a_tool_call(qwen):
    choice = (await ask_chat(qwen, question())).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", PARIS)


async def test_streamed_chat_sends_the_call_as_a_tool_call_delta(qwen):
    async with make_client(qwen) as http:
        content, parts, finish = await streamed_chat(
            http, model=MODEL_NAME, messages=question(), tools=TOOLS, max_tokens=40, temperature=0
        )
    assert (content, finish) == ("", "tool_calls")
    (part,) = parts
    assert (part.index, part.function.name) == (0, "get_weather")
    assert json.loads(part.function.arguments) == PARIS


async def test_a_tool_round_trip_ends_in_a_text_answer(qwen):
    first = (await ask_chat(qwen, question())).choices[0].message
    (call,) = first.tool_calls
    follow_up = [
        *question(),
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
        # Without this turn the 0.5B model only repeats its call after a tool result.
        {"role": "user", "content": "Summarise the tool result for me in words."},
    ]
    choice = (await ask_chat(qwen, follow_up)).choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("stop", None)
    assert "21" in choice.message.content and "Paris" in choice.message.content


async def test_responses_returns_a_function_call_item(qwen):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": DESCRIPTION,
            "parameters": WEATHER,
        }
    ]
    async with make_client(qwen) as http:
        response = await openai_sdk(http).responses.create(
            model=MODEL_NAME, input=QUESTION, tools=tools, max_output_tokens=40, temperature=0
        )
    (item,) = response.output
    assert (item.type, item.name, item.status) == ("function_call", "get_weather", "completed")
    assert json.loads(item.arguments) == PARIS


async def test_anthropic_messages_return_a_tool_use_block(qwen):
    tools = [{"name": "get_weather", "description": DESCRIPTION, "input_schema": WEATHER}]
    async with sdk_http(qwen) as http:
        message = await anthropic_sdk(http).messages.create(
            model=MODEL_NAME,
            max_tokens=40,
            messages=question(),
            tools=tools,
            extra_body={"temperature": 0},
        )
    assert message.stop_reason == "tool_use", message.content
    (block,) = message.content
    assert isinstance(block, anthropic.types.ToolUseBlock)
    assert (block.name, block.input) == ("get_weather", PARIS)


async def test_strict_tool_calls_leaves_the_untagged_json_as_text(qwen):
    choice = (await ask_chat(qwen, question(), strict_tool_calls=True)).choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("stop", None)
    assert json.loads(choice.message.content) == {"name": "get_weather", "arguments": PARIS}


async def test_with_the_tool_call_grammar_the_call_still_comes_through(qwen):
    choice = (await ask_chat(qwen, question(), tool_call_grammar="auto")).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", PARIS)


def test_the_tool_call_grammar_on_qwen_triggers_on_its_special_token(qwen):
    """<tool_call> is one added token in Qwen's vocabulary: the grammar takes it as the
    trigger, holds the call to its schema, and refuses the tag spelled in plain tokens."""
    tokenizer, compiler = qwen.model_info.tokenizer, qwen.model_info.grammar
    constraint = compiler.text_or_tool_calls([TOOLS[0]["function"]], "<tool_call>", "</tool_call>")

    def accepts(*pieces: str) -> bool:
        ids = [i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False)]
        matcher = constraint.matcher.deep_copy()
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert len(tokenizer.encode("<tool_call>", add_special_tokens=False)) == 1
    assert accepts("It is sunny.") and accepts(call) and accepts(f"Let me check.{call}")
    assert not accepts(call.replace('"Paris"', "75"))
    assert not accepts("x <", "tool", "_call>")
