"""Structured outputs: `response_format` (chat) and `text.format` (Responses) make the
model write JSON matching the schema -- through the speculative engine (draft and
prompt lookup), the batched engine, and the real HTTP stack -- and the constrained
output is exactly what plain mlx-lm decoding with the same constraint produces."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import llguidance
import openai
import pytest
from pydantic import BaseModel, Field

from engines.errors import InvalidRequest, RequestFailed
from engines.request import GenerationRequest, SamplingParams
from engines.sample.constraints import GrammarCompiler
from tests.conftest import MODEL_NAME, make_client, start_scheduler
from tests.forcing import TIME_SCHEMA, WEATHER_SCHEMA

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["Describe the ball as JSON.", "The weather today", "import json, os, sys"]


def matches_schema(value) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"color", "size", "ok"}
        and value["color"] in ("red", "green", "blue")
        and isinstance(value["size"], int)
        and 0 <= value["size"] <= 99
        and isinstance(value["ok"], bool)
    )


@pytest.fixture(scope="module")
def constrained(tiny_model_dir, perturbed_draft_dir):
    """Both drafters on: a draft model and prompt lookup."""
    scheduler = start_scheduler(tiny_model_dir, draft_model=str(perturbed_draft_dir))
    yield scheduler
    scheduler.stop()


def reference_json_tokens(reference, prompt: list[int], max_tokens: int) -> list[int]:
    """Plain mlx-lm greedy decoding with the same constraint, up to and with EOS."""
    compiler = GrammarCompiler(reference.tokenizer)
    processor = compiler.processor(compiler.json_schema(SCHEMA), len(prompt))
    tokens = []
    for token in reference.greedy_tokens(prompt, max_tokens, logits_processors=[processor]):
        tokens.append(token)
        if token in reference.tokenizer.eos_token_ids:
            break
    return tokens


def text_of(reference, tokens: list[int]) -> str:
    eos = reference.tokenizer.eos_token_ids
    return reference.tokenizer.decode([t for t in tokens if t not in eos])


def json_request(scheduler, rid: str, prompt: list[int], **sampling) -> GenerationRequest:
    constraint = scheduler.model_info.grammar.json_schema(SCHEMA)
    return GenerationRequest(
        rid,
        tuple(prompt),
        64,
        SamplingParams(**({"temperature": 0.0} | sampling)),
        constraint=constraint,
    )


async def post(scheduler, path: str, **body) -> httpx.Response:
    """One greedy request to the real ASGI app."""
    async with make_client(scheduler) as client:
        return await client.post(path, json={"model": MODEL_NAME, "temperature": 0, **body})


async def tokens_of(stream) -> list[int]:
    return [t for event in await stream.collect() for t in event.token_ids]


async def test_speculative_constrained_output_equals_plain_constrained_decoding(
    constrained, reference
):
    for i, text in enumerate(PROMPTS):
        prompt = reference.tokenizer.encode(text)
        tokens = await tokens_of(constrained.submit(json_request(constrained, f"s{i}", prompt)))
        assert tokens == reference_json_tokens(reference, prompt, 64)
        assert tokens[-1] in reference.tokenizer.eos_token_ids  # finished, not cut
        assert matches_schema(json.loads(text_of(reference, tokens)))
    assert constrained.batched_engine is None or constrained.mode.value == "speculative"


async def test_batched_constrained_outputs_each_equal_their_solo_output(constrained, reference):
    prompts = [reference.tokenizer.encode(text) for text in PROMPTS]
    streams = [
        constrained.submit(json_request(constrained, f"b{i}", p)) for i, p in enumerate(prompts)
    ]
    events = await asyncio.gather(*(s.collect() for s in streams))
    assert constrained.batched_engine is not None
    for prompt, request_events in zip(prompts, events, strict=True):
        tokens = [t for event in request_events for t in event.token_ids]
        assert tokens == reference_json_tokens(reference, prompt, 64)
    drafted = sum(e[-1].speculation["draft_tokens"] for e in events)
    assert drafted > 0, "the constrained rows drafted inside the batch"


async def test_sampled_constrained_outputs_always_match_the_schema(constrained, reference):
    prompt = reference.tokenizer.encode(PROMPTS[0])
    for seed in range(6):
        request = json_request(constrained, f"t{seed}", prompt, temperature=1.0, seed=seed)
        text = text_of(reference, await tokens_of(constrained.submit(request)))
        assert matches_schema(json.loads(text)), text


async def test_chat_response_format_json_schema_over_http(constrained):
    async with make_client(constrained) as client:
        for stream in (False, True):
            body = {
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "A ball, as JSON"}],
                "max_tokens": 64,
                "temperature": 0,
                "stream": stream,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "ball", "schema": SCHEMA, "strict": True},
                },
            }
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200
            if stream:
                content = "".join(
                    json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                    for line in response.text.splitlines()
                    if line.startswith("data: {") and '"choices":[{' in line.replace(" ", "")
                )
            else:
                message = response.json()["choices"][0]
                assert message["finish_reason"] == "stop"
                content = message["message"]["content"]
            assert matches_schema(json.loads(content)), content


async def test_chat_json_object_gives_a_json_object(constrained):
    response = await post(
        constrained,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "anything"}],
        max_tokens=200,
        response_format={"type": "json_object"},
    )
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "stop":  # a random model may still be mid-object at 200
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["message"]["content"].startswith("{")


class Ball(BaseModel):
    color: Literal["red", "green"]
    size: int = Field(ge=0, le=9)
    ok: bool


async def test_openai_sdk_parse_with_a_pydantic_model(constrained):
    """The SDK's own path: a pydantic model -> strict json_schema -> `.parsed`."""
    async with make_client(constrained) as http_client:
        sdk = openai.AsyncOpenAI(
            base_url="http://tandem.test/v1", api_key="unused", http_client=http_client
        )
        result = await sdk.chat.completions.parse(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "a ball"}],
            response_format=Ball,
            max_tokens=64,
            temperature=0,
        )
        ball = result.choices[0].message.parsed
        assert isinstance(ball, Ball) and ball.color in ("red", "green") and 0 <= ball.size <= 9


async def test_responses_text_format_json_schema(constrained):
    response = await post(
        constrained,
        "/v1/responses",
        input="A ball, as JSON",
        max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "ball", "schema": SCHEMA}},
    )
    assert response.status_code == 200
    body = response.json()
    text = body["output"][-1]["content"][0]["text"]
    assert matches_schema(json.loads(text)), text
    assert body["text"]["format"]["type"] == "json_schema"


async def test_anthropic_output_config_format(constrained):
    async with make_client(constrained) as client:
        for stream in (False, True):
            response = await client.post(
                "/v1/messages",
                json={
                    "model": MODEL_NAME,
                    "max_tokens": 64,
                    "temperature": 0,
                    "stream": stream,
                    "messages": [{"role": "user", "content": "A ball, as JSON"}],
                    "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
                },
            )
            assert response.status_code == 200
            if stream:
                text = "".join(
                    json.loads(line[6:])["delta"].get("text", "")
                    for line in response.text.splitlines()
                    if line.startswith("data: ") and '"content_block_delta"' in line
                )
            else:
                body = response.json()
                assert body["stop_reason"] == "end_turn"
                text = body["content"][0]["text"]
            assert matches_schema(json.loads(text)), text


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "yaml"}, "response_format"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": []}}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, None),
        ("json", "response_format"),
    ],
)
async def test_bad_response_format_is_a_400_naming_it(constrained, fmt, param):
    response = await post(
        constrained,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "hi"}],
        response_format=fmt,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"].startswith(param or "response_format")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast",
        "parameters": WEATHER_SCHEMA,
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}}


def valid_weather(arguments: dict) -> bool:
    return arguments["city"] in ("Paris", "Oslo") and 1 <= arguments["days"] <= 7


@pytest.mark.parametrize(
    ("choice", "names"),
    [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}),
    ],
)
async def test_chat_tool_choice_forces_a_valid_call(constrained, choice, names):
    response = await post(
        constrained,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        max_tokens=64,
        tools=[WEATHER, TIME],
        tool_choice=choice,
    )
    choice_out = response.json()["choices"][0]
    assert choice_out["finish_reason"] == "tool_calls", choice_out
    [call] = choice_out["message"]["tool_calls"]
    assert call["function"]["name"] in names
    arguments = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert valid_weather(arguments)
    else:
        assert arguments["zone"] in ("UTC", "CET")


async def test_anthropic_tool_choice_tool_forces_a_tool_use_block(constrained):
    tool = WEATHER["function"]
    response = await post(
        constrained,
        "/v1/messages",
        max_tokens=64,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[
            {"name": tool["name"], "input_schema": tool["parameters"]},
            {"name": "get_time", "input_schema": TIME["function"]["parameters"]},
        ],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    body = response.json()
    assert body["stop_reason"] == "tool_use", body
    [block] = [b for b in body["content"] if b["type"] == "tool_use"]
    assert block["name"] == "get_weather" and valid_weather(block["input"])


async def test_responses_tool_choice_required_forces_a_function_call(constrained):
    flat = {"type": "function", **WEATHER["function"]}
    response = await post(
        constrained,
        "/v1/responses",
        input="Weather?",
        max_output_tokens=64,
        tools=[flat],
        tool_choice="required",
    )
    calls = [item for item in response.json()["output"] if item["type"] == "function_call"]
    assert len(calls) == 1 and calls[0]["name"] == "get_weather"
    assert valid_weather(json.loads(calls[0]["arguments"]))


async def test_forcing_a_tool_in_another_tool_format_writes_a_bare_json_call(constrained):
    """Markup other than JSON in tags (here Mistral's) is not enforced; the forced call
    is the bare JSON object the server reads back as a call, as for templates that have
    no tool format at all."""
    async with make_client(constrained, tool_call_parser="mistral") as client:
        response = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "Weather?"}],
                "tools": [WEATHER],
                "tool_choice": "required",
                "max_tokens": 64,
                "temperature": 0,
            },
        )
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert valid_weather(json.loads(call["function"]["arguments"]))


class BrokenMatcher:
    """Stands in for an llguidance matcher that raises (API misuse, a bug)."""

    def try_consume_tokens(self, tokens):
        raise RuntimeError("matcher exploded")

    def rollback(self, n):
        raise RuntimeError("matcher exploded")

    def is_stopped(self):
        raise RuntimeError("matcher exploded")

    def is_error(self):
        raise RuntimeError("matcher exploded")


async def test_a_broken_constraint_fails_only_its_request(tiny_model_dir, reference):
    def factory(request: GenerationRequest) -> list:
        if "BREAK" not in reference.tokenizer.decode(list(request.prompt_tokens)):
            return []
        compiler = GrammarCompiler(reference.tokenizer)
        processor = compiler.processor(compiler.json_schema(SCHEMA), len(request.prompt_tokens))
        processor.matcher = BrokenMatcher()
        return [processor]

    good_result, bad_result, batched = await good_beside_broken(
        tiny_model_dir, reference, factory, ignore_eos=True
    )
    assert batched  # they shared batched forwards
    assert isinstance(bad_result, RequestFailed) and "matcher exploded" in str(bad_result)
    assert good_result == reference.greedy_tokens(reference.tokenizer.encode(GOOD), 30)


GOOD = "A fine prompt"


async def good_beside_broken(tiny_model_dir, reference, factory, **bad_options):
    """A fine request and a "BREAK" one (whose constraint `factory` breaks) submitted
    together: (the fine one's tokens, the broken one's result or exception, whether the
    batched engine served them)."""
    scheduler = start_scheduler(tiny_model_dir, logits_processor_factory=factory)
    try:
        good = reference.tokenizer.encode(GOOD)
        bad = reference.tokenizer.encode("BREAK this one")
        greedy = SamplingParams(temperature=0.0)
        streams = [
            scheduler.submit(GenerationRequest("good", tuple(good), 30, greedy, ignore_eos=True)),
            scheduler.submit(GenerationRequest("bad", tuple(bad), 30, greedy, **bad_options)),
        ]
        good_result, bad_result = await asyncio.gather(
            tokens_of(streams[0]), tokens_of(streams[1]), return_exceptions=True
        )
        return good_result, bad_result, scheduler.batched_engine is not None
    finally:
        scheduler.stop()


class RollbackFails:
    """A real matcher whose rollback reports failure (as llguidance's does once the
    matcher has broken), counting the calls."""

    def __init__(self, matcher) -> None:
        self._matcher = matcher
        self.rollbacks = 0

    def rollback(self, n: int) -> bool:
        self.rollbacks += 1
        return False

    def __getattr__(self, name: str):
        return getattr(self._matcher, name)


async def test_a_failed_matcher_rollback_fails_only_its_request(
    tiny_model_dir, perturbed_draft_dir, reference
):
    """Drafts the target rejects make the matcher roll back; when it cannot, the request
    fails with a clear error instead of silently ending at EOS. The next request, in
    flight meanwhile (waiting: batch_threshold 3 keeps one speculative stream), is exact."""
    broken: list[RollbackFails] = []

    def factory(request: GenerationRequest) -> list:
        if "BREAK" not in reference.tokenizer.decode(list(request.prompt_tokens)):
            return []
        compiler = GrammarCompiler(reference.tokenizer)
        processor = compiler.processor(compiler.json_schema(SCHEMA), len(request.prompt_tokens))
        processor.matcher = RollbackFails(processor.matcher)
        broken.append(processor.matcher)
        return [processor]

    scheduler = start_scheduler(
        tiny_model_dir,
        draft_model=str(perturbed_draft_dir),
        batch_threshold=3,
        logits_processor_factory=factory,
    )
    try:
        bad = reference.tokenizer.encode("BREAK this one: " + PROMPTS[0])
        good = reference.tokenizer.encode("A fine prompt")
        greedy = SamplingParams(temperature=0.0)
        streams = [
            scheduler.submit(GenerationRequest("bad", tuple(bad), 64, greedy)),
            scheduler.submit(GenerationRequest("good", tuple(good), 30, greedy, ignore_eos=True)),
        ]
        bad_result, good_result = await asyncio.gather(
            tokens_of(streams[0]), tokens_of(streams[1]), return_exceptions=True
        )
        assert broken[0].rollbacks > 0
        assert isinstance(bad_result, RequestFailed), bad_result
        assert "roll back" in str(bad_result)
        assert good_result == reference.greedy_tokens(good, 30)
    finally:
        scheduler.stop()


PATTERN_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "string", "pattern": "^[a-z]{2,40}[0-9]+$"}},
    "required": ["a"],
}


async def test_a_matcher_in_an_error_state_fails_only_its_request(tiny_model_dir, reference):
    """A real llguidance matcher that breaks mid-output (here: out of lexer fuel inside
    the string) fails its request with llguidance's reason; the batch mate is exact."""

    def factory(request: GenerationRequest) -> list:
        if "BREAK" not in reference.tokenizer.decode(list(request.prompt_tokens)):
            return []
        compiler = GrammarCompiler(reference.tokenizer)
        constraint = compiler.json_schema(PATTERN_SCHEMA)
        processor = compiler.processor(constraint, len(request.prompt_tokens))
        limits = llguidance.LLParserLimits(step_lexer_fuel=10)
        processor.matcher = llguidance.LLMatcher(
            compiler.ll_tokenizer, constraint.grammar, log_level=0, limits=limits
        )
        return [processor]

    good_result, bad_result, batched = await good_beside_broken(tiny_model_dir, reference, factory)
    assert batched  # they shared batched forwards
    assert isinstance(bad_result, RequestFailed), bad_result
    assert "too many expressions" in str(bad_result)
    assert good_result == reference.greedy_tokens(reference.tokenizer.encode(GOOD), 30)


def many_branches(n: int) -> dict:
    """A schema llguidance cannot build a matcher for at n = 8500 (more grammar symbols
    than its u16 ids hold: it panics, and reports the panic as an error state)."""
    return {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
            for i in range(n)
        ]
    }


HUGE_SCHEMA = many_branches(8500)


@pytest.mark.parametrize("surface", ["chat", "responses", "messages"])
async def test_a_schema_too_big_to_compile_is_a_400_in_each_apis_shape(constrained, surface):
    messages = [{"role": "user", "content": "hi"}]
    path, body = {
        "chat": (
            "/v1/chat/completions",
            {
                "messages": messages,
                "response_format": {"type": "json_schema", "json_schema": {"schema": HUGE_SCHEMA}},
            },
        ),
        "responses": (
            "/v1/responses",
            {"input": "hi", "text": {"format": {"type": "json_schema", "schema": HUGE_SCHEMA}}},
        ),
        "messages": (
            "/v1/messages",
            {
                "messages": messages,
                "max_tokens": 8,
                "output_config": {"format": {"type": "json_schema", "schema": HUGE_SCHEMA}},
            },
        ),
    }[surface]
    response = await post(constrained, path, **body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    if surface == "messages":
        assert response.json()["type"] == "error"
    assert error["type"] == "invalid_request_error"
    assert "schema" in error["message"]


def test_a_grammar_over_the_size_bound_is_an_invalid_request(reference):
    """Forced tool calls too (over HTTP their tools would not fit the tiny context)."""
    compiler = GrammarCompiler(reference.tokenizer)
    function = {"name": "f", "parameters": HUGE_SCHEMA}
    with pytest.raises(InvalidRequest, match="too large"):
        compiler.tool_call([function], "<tool_call>", "</tool_call>")
    with pytest.raises(InvalidRequest, match="too large"):
        compiler.json_schema(HUGE_SCHEMA)


def test_a_grammar_llguidance_cannot_build_is_an_invalid_request(reference):
    """Past the size bound too: llguidance's own failure (its panic on too many
    symbols, reported as an error state) is a clear InvalidRequest, not a 500."""
    compiler = GrammarCompiler(reference.tokenizer, max_grammar_chars=10**7)
    with pytest.raises(InvalidRequest, match="u16::MAX"):
        compiler.json_schema(HUGE_SCHEMA)
