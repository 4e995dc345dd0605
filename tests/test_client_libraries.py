"""Client libraries against a real server on 127.0.0.1, each with its own HTTP stack.

Structured output through a forced tool call (issue item 3) on chat templates without a
tool format: SmolLM2's (the demo model's) and a minimal one of our own, on the tiny
model. langchain-anthropic's and langchain-openai's `with_structured_output`,
pydantic-ai's `output_type` (its forced `final_result` tool) over the OpenAI and the
Anthropic providers, and the SDKs' own forced-tool options (chat, Responses, Messages):
each gets a tool call whose arguments validate against the schema. The tiny model's
output is random, so the schema is closed (enums, a bounded integer, a boolean, no extra
keys): the grammar decides the shape, and every random choice inside it still ends.
"""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.conftest import MODEL_NAME, start_scheduler
from tests.forcing import TIME_SCHEMA
from tests.live_server import live_server


class Forecast(BaseModel):
    """A weather forecast for one city."""

    model_config = ConfigDict(extra="forbid")  # closed: no free-form extra keys
    city: Literal["Paris", "Oslo"]
    days: int = Field(ge=1, le=7)
    sunny: bool


QUESTION = "What is the weather in Paris this week?"
SCHEMA = Forecast.model_json_schema()
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "forecast", "description": Forecast.__doc__, "parameters": SCHEMA},
}
OTHER_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}}


@pytest.fixture(scope="module", params=["smollm2", "bare"])
def base_url(request):
    """A live server for each template without a tool format in turn."""
    model_dir = request.getfixturevalue(f"{request.param}_template_dir")
    scheduler = start_scheduler(model_dir)
    try:
        with live_server(scheduler) as url:
            yield url
    finally:
        scheduler.stop()


def forecast(arguments: dict | str) -> Forecast:
    """The arguments, validated as the client's schema asks."""
    value = json.loads(arguments) if isinstance(arguments, str) else arguments
    return Forecast.model_validate(value, strict=False)


# --- frameworks ------------------------------------------------------------------------


def test_langchain_anthropic_with_structured_output(base_url):
    from langchain_anthropic import ChatAnthropic

    model = ChatAnthropic(
        model=MODEL_NAME, base_url=base_url, api_key="x", temperature=0, max_tokens=100
    )
    answer = model.with_structured_output(Forecast).invoke(QUESTION)
    assert isinstance(answer, Forecast)


def test_langchain_openai_with_structured_output_by_function_calling(base_url):
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        model=MODEL_NAME, base_url=f"{base_url}/v1", api_key="x", temperature=0, max_tokens=100
    )
    answer = model.with_structured_output(Forecast, method="function_calling").invoke(QUESTION)
    assert isinstance(answer, Forecast)


def test_pydantic_ai_output_type_over_openai_chat(base_url):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=f"{base_url}/v1", api_key="x")
    agent = Agent(OpenAIChatModel(MODEL_NAME, provider=provider), output_type=Forecast)
    assert isinstance(agent.run_sync(QUESTION).output, Forecast)


def test_pydantic_ai_output_type_over_anthropic(base_url):
    from pydantic_ai import Agent
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    provider = AnthropicProvider(base_url=base_url, api_key="x")
    agent = Agent(AnthropicModel(MODEL_NAME, provider=provider), output_type=Forecast)
    assert isinstance(agent.run_sync(QUESTION).output, Forecast)


# --- the SDKs' forced-tool options ---------------------------------------------------------


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "forecast"}}]
)
def test_openai_sdk_chat_tool_choice_forces_a_valid_call(base_url, choice):
    client = openai_client(base_url)
    request = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [CHAT_TOOL] if choice == "required" else [OTHER_TOOL, CHAT_TOOL],
        "tool_choice": choice,
        "max_tokens": 100,
        "temperature": 0,
    }
    choice_out = client.chat.completions.create(**request).choices[0]
    assert choice_out.finish_reason == "tool_calls"
    (call,) = choice_out.message.tool_calls
    assert call.function.name == "forecast"
    forecast(call.function.arguments)
    parts, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        parts += chunk.choices[0].delta.tool_calls or [] if chunk.choices else []
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert finish == "tool_calls"
    assert forecast("".join(p.function.arguments or "" for p in parts))


def test_openai_sdk_responses_forced_function_call(base_url):
    client = openai_client(base_url)
    tool = {"type": "function", **CHAT_TOOL["function"]}
    for choice in ("required", {"type": "function", "name": "forecast"}):
        response = client.responses.create(
            model=MODEL_NAME,
            input=QUESTION,
            tools=[tool],
            tool_choice=choice,
            max_output_tokens=100,
            temperature=0,
        )
        (item,) = response.output
        assert (item.type, item.name) == ("function_call", "forecast")
        forecast(item.arguments)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "forecast"}])
def test_anthropic_sdk_tool_choice_forces_a_tool_use_block(base_url, choice):
    client = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
    tools = [{"name": "forecast", "description": Forecast.__doc__, "input_schema": SCHEMA}]
    request = {
        "model": MODEL_NAME,
        "max_tokens": 100,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": tools,
        "tool_choice": choice,
        "extra_body": {"temperature": 0},
    }
    message = client.messages.create(**request)
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert (block.type, block.name) == ("tool_use", "forecast")
    forecast(block.input)
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    forecast(final.content[0].input)


# --- the demo model itself (slow: a real 135M model on the CPU) --------------------------


class Place(BaseModel):
    city: str
    country: str


class PlaceForecast(BaseModel):
    """A weather forecast for one place."""

    place: Place  # a nested model: pydantic refers to it in `$defs`
    days: int = Field(ge=1, le=7)
    sunny: bool


@pytest.fixture(scope="module")
def demo_url():
    from engines.model.gguf_import import import_gguf
    from engines.model.packaged_models import SMOLLM2_135M, packaged_gguf

    scheduler = start_scheduler(import_gguf(packaged_gguf(SMOLLM2_135M)))
    try:
        with live_server(scheduler) as url:
            yield url
    finally:
        scheduler.stop()


@pytest.mark.slow
def test_the_demo_model_answers_structured_output_requests_with_a_forced_call(demo_url):
    """`tandem serve --demo`'s SmolLM2-135M-Instruct: its template has no tool format, and
    open schemas (no `additionalProperties`) with a nested model still close."""
    from langchain_anthropic import ChatAnthropic
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = ChatAnthropic(
        model=MODEL_NAME, base_url=demo_url, api_key="x", temperature=0, max_tokens=100
    )
    assert isinstance(model.with_structured_output(PlaceForecast).invoke(QUESTION), PlaceForecast)
    provider = OpenAIProvider(base_url=f"{demo_url}/v1", api_key="x")
    agent = Agent(
        OpenAIChatModel(MODEL_NAME, provider=provider),
        output_type=PlaceForecast,
        model_settings={"temperature": 0, "max_tokens": 100},
    )
    assert isinstance(agent.run_sync(QUESTION).output, PlaceForecast)
