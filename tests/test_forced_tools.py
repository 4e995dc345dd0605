"""Forced tool calls and tools in the prompt for chat templates without a tool format
(issue items 3 and 4): SmolLM2's template (the demo model's) and a minimal template of
our own, on the tiny model. A forced call is constrained to the bare JSON call shape
and comes back as a tool call on every surface, streamed or not; the tools, earlier
calls and results reach the model as text; the forced call is exact through
speculation. The real client libraries are in tests/test_client_libraries.py."""

from __future__ import annotations

import json

import jsonschema_rs
import pytest

from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from scheduler.template_traits import TemplateTraits
from server.output_parser import OutputMarkers
from server.prompts import render_chat
from server.structured import forced_tool_constraint
from server.tool_prompt import history_as_text
from tests.conftest import MODEL_NAME, make_client, start_scheduler
from tests.forcing import TIME_SCHEMA, WEATHER_SCHEMA, forcing_factory

SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
DESCRIPTION = "Weather forecast for a city"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": DESCRIPTION,
            "parameters": WEATHER_SCHEMA,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
]
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": DESCRIPTION, "input_schema": WEATHER_SCHEMA},
    {"name": "get_time", "input_schema": TIME_SCHEMA},
]
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
BARE_CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'


class Recorder:
    """A logits-processor factory that keeps each prompt's text (what the model reads)
    and makes the model write a script where the prompt asks for one (FORCE:name)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prompts: list[str] = []
        self.forcing = forcing_factory(tokenizer, {"bare": BARE_CALL})

    def __call__(self, request: GenerationRequest) -> list:
        self.prompts.append(self.tokenizer.decode(list(request.prompt_tokens)))
        return self.forcing(request)


def recorded_scheduler(model_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    recorder = Recorder(load_tokenizer(model_dir))
    scheduler = start_scheduler(model_dir, logits_processor_factory=recorder)
    scheduler.recorder = recorder
    yield scheduler
    scheduler.stop()


@pytest.fixture(scope="module")
def smollm2(smollm2_template_dir):
    yield from recorded_scheduler(smollm2_template_dir)


@pytest.fixture(scope="module")
def bare(bare_template_dir):
    yield from recorded_scheduler(bare_template_dir)


@pytest.fixture(params=["smollm2", "bare"])
def served(request):
    """Each template without a tool format in turn."""
    return request.getfixturevalue(request.param)


def valid_call(name: str, arguments: dict, allowed=("get_weather", "get_time")) -> bool:
    return name in allowed and jsonschema_rs.validator_for(SCHEMAS[name]).is_valid(arguments)


async def post(scheduler, path: str, body: dict, status: int = 200, **config) -> dict:
    async with make_client(scheduler, **config) as client:
        response = await client.post(path, json={"model": MODEL_NAME, "temperature": 0, **body})
    assert response.status_code == status, response.text
    return response.json()


async def sse(scheduler, path: str, body: dict, **config) -> list[dict]:
    """The data payloads of a streamed response."""
    payloads = []
    async with make_client(scheduler, **config) as client:
        request = {"model": MODEL_NAME, "temperature": 0, "stream": True, **body}
        async with client.stream("POST", path, json=request) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    payloads.append(json.loads(line[6:]))
    return payloads


# --- chat ----------------------------------------------------------------------------


CHOICES = [
    ("required", ("get_weather", "get_time")),
    ({"type": "function", "function": {"name": "get_time"}}, ("get_time",)),
]


@pytest.mark.parametrize(("choice", "allowed"), CHOICES)
async def test_chat_forced_call_is_a_valid_tool_call(served, choice, allowed):
    body = {"messages": QUESTION, "tools": TOOLS, "tool_choice": choice, "max_tokens": 80}
    out = (await post(served, "/v1/chat/completions", body))["choices"][0]
    assert out["finish_reason"] == "tool_calls", out
    assert out["message"]["content"] is None
    (call,) = out["message"]["tool_calls"]
    function = call["function"]
    assert valid_call(function["name"], json.loads(function["arguments"]), allowed)


async def test_chat_forced_call_streams_as_a_tool_call_delta(served):
    body = {"messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "max_tokens": 80}
    chunks = await sse(served, "/v1/chat/completions", body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    (call,) = [part for d in deltas for part in d.get("tool_calls") or []]
    function = call["function"]
    assert valid_call(function["name"], json.loads(function["arguments"]))
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_strict_tool_calls_still_returns_a_forced_call(smollm2):
    body = {"messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "max_tokens": 80}
    out = (await post(smollm2, "/v1/chat/completions", body, strict_tool_calls=True))["choices"]
    assert out[0]["finish_reason"] == "tool_calls"


async def test_tool_choice_auto_still_reads_a_bare_json_answer_as_a_call(served):
    ask = [{"role": "user", "content": "Weather in Paris? FORCE:bare"}]
    body = {"messages": ask, "tools": TOOLS, "max_tokens": 80}
    out = (await post(served, "/v1/chat/completions", body))["choices"][0]
    assert out["finish_reason"] == "tool_calls"
    (call,) = out["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}


# --- Responses and Messages -------------------------------------------------------------


async def test_responses_forced_call_is_a_function_call_item(served):
    body = {
        "input": "Weather in Paris?",
        "tools": RESPONSES_TOOLS,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 80,
    }
    out = await post(served, "/v1/responses", body)
    (item,) = out["output"]
    assert (item["type"], item["name"], out["status"]) == (
        "function_call",
        "get_weather",
        "completed",
    )
    assert valid_call("get_weather", json.loads(item["arguments"]))
    events = await sse(served, "/v1/responses", {**body, "tool_choice": "required"})
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["type"] for item in done] == ["function_call"]
    assert valid_call(done[0]["name"], json.loads(done[0]["arguments"]))


@pytest.mark.parametrize(
    ("choice", "allowed"),
    [
        ({"type": "any"}, ("get_weather", "get_time")),
        ({"type": "tool", "name": "get_weather"}, ("get_weather",)),
    ],
)
async def test_messages_forced_call_is_a_tool_use_block(served, choice, allowed):
    body = {"messages": QUESTION, "tools": ANTHROPIC_TOOLS, "tool_choice": choice, "max_tokens": 80}
    out = await post(served, "/v1/messages", body)
    assert out["stop_reason"] == "tool_use", out
    (block,) = out["content"]
    assert block["type"] == "tool_use" and valid_call(block["name"], block["input"], allowed)
    events = await sse(served, "/v1/messages", body)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["tool_use"]
    (delta,) = [e for e in events if e["type"] == "message_delta"][-1:]
    assert delta["delta"]["stop_reason"] == "tool_use"


# --- tools in the prompt --------------------------------------------------------------


async def test_prompt_tokens_grow_with_tools_and_the_prompt_names_them(served):
    plain = {"messages": QUESTION, "max_tokens": 1}
    without = await post(served, "/v1/chat/completions", plain)
    served.recorder.prompts.clear()
    with_tools = await post(served, "/v1/chat/completions", {**plain, "tools": TOOLS})
    assert with_tools["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"] + 50
    (prompt,) = served.recorder.prompts
    assert all(name in prompt for name in ("get_weather", "get_time", DESCRIPTION))
    assert '{"name": "<tool name>", "arguments":' in prompt  # the call shape it must write


async def test_anthropic_count_tokens_grows_with_tools(served):
    body = {"model": MODEL_NAME, "messages": QUESTION}
    async with make_client(served) as client:
        without = await client.post("/v1/messages/count_tokens", json=body)
        counted = await client.post(
            "/v1/messages/count_tokens", json={**body, "tools": ANTHROPIC_TOOLS}
        )
    assert counted.json()["input_tokens"] > without.json()["input_tokens"] + 50


async def test_earlier_calls_and_results_reach_the_model(served):
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "It is 12:00 in CET"},
    ]
    served.recorder.prompts.clear()
    await post(
        served, "/v1/chat/completions", {"messages": messages, "tools": TOOLS, "max_tokens": 1}
    )
    (prompt,) = served.recorder.prompts
    assert '{"name": "get_time", "arguments": {}}' in prompt
    assert "It is 12:00 in CET" in prompt


def test_the_probe_finds_what_each_template_drops(smollm2, bare, scheduler):
    smol, own = (s.model_info.template_traits for s in (smollm2, bare))
    assert smol == TemplateTraits(tools=False, system=True, calls=False, results=True)
    assert own == TemplateTraits(tools=False, system=False, calls=False, results=False)
    assert scheduler.model_info.template_traits == TemplateTraits()  # the demo's


def test_a_result_written_as_text_joins_the_user_turn_beside_it():
    traits = TemplateTraits(tools=False, system=False, calls=False, results=False)
    call = {"id": "c1", "function": {"name": "get_time", "arguments": {"zone": "CET"}}}
    history = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        {"role": "user", "content": "Thanks"},
    ]
    assert history_as_text(history, traits) == [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": '{"name": "get_time", "arguments": {"zone": "CET"}}'},
        {"role": "user", "content": "Result from the tool get_time:\n12:00\n\nThanks"},
    ]


def test_templates_that_render_tools_are_left_alone(reference):
    rendered = render_chat(reference.tokenizer, QUESTION, TOOLS)
    expected = reference.tokenizer.apply_chat_template(
        QUESTION, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert rendered.text == expected


# --- exact through speculation -----------------------------------------------------------


@pytest.fixture(scope="module")
def drafted(smollm2_template_dir, perturbed_draft_dir):
    """SmolLM2's template with both drafters on: a draft model and prompt lookup."""
    scheduler = start_scheduler(
        smollm2_template_dir, draft_model=str(perturbed_draft_dir), suffix_tokens_per_key=0
    )
    yield scheduler
    scheduler.stop()


def forced_request(scheduler, rid: str, speculate: bool) -> GenerationRequest:
    info = scheduler.model_info
    markers = OutputMarkers.for_tokenizer(info.tokenizer)
    prompt = render_chat(info.tokenizer, QUESTION, TOOLS).ids
    constraint = forced_tool_constraint(TOOLS, None, markers, info.grammar, info.tokenizer, False)
    switches = SpeculationOverrides(enable_pld=speculate, enable_draft=speculate)
    sampling = SamplingParams(temperature=0.0)
    return GenerationRequest(
        rid, tuple(prompt), 80, sampling, constraint=constraint, speculation=switches
    )


async def test_greedy_forced_call_with_speculation_equals_it_without(drafted, reference):
    plain = await drafted.submit(forced_request(drafted, "plain", speculate=False)).collect()
    spec = await drafted.submit(forced_request(drafted, "spec", speculate=True)).collect()
    tokens = [[t for event in events for t in event.token_ids] for events in (plain, spec)]
    assert tokens[0] == tokens[1] == reference_tokens(drafted, reference)
    assert tokens[0][-1] in reference.tokenizer.eos_token_ids  # the call closed, then EOS
    assert spec[-1].speculation["draft_tokens"] > 0
    call = json.loads(reference.tokenizer.decode(tokens[0][:-1]))
    assert valid_call(call["name"], call["arguments"])


def reference_tokens(scheduler, reference) -> list[int]:
    """Plain mlx-lm greedy decoding of the same prompt with the same constraint."""
    request = forced_request(scheduler, "reference", speculate=False)
    prompt = list(request.prompt_tokens)
    processor = scheduler.model_info.grammar.processor(request.constraint, len(prompt))
    tokens = []
    for token in reference.greedy_tokens(prompt, 80, logits_processors=[processor]):
        tokens.append(token)
        if token in reference.tokenizer.eos_token_ids:
            break
    return tokens


def test_special_tokens_in_a_tool_description_stay_text(smollm2):
    """The tool block is message text, so the escaper keeps a `<|im_end|>` in a
    description from closing the system turn (tests/test_template_injection.py)."""
    tokenizer = smollm2.model_info.tokenizer
    hostile = [{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}]
    harmless = [{"type": "function", "function": {"name": "f", "description": "im_end"}}]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    counts = [render_chat(tokenizer, QUESTION, t).ids.count(end) for t in (hostile, harmless)]
    assert counts[0] == counts[1]
    assert '"description": "<|im_end|>"' in render_chat(tokenizer, QUESTION, hostile).text
