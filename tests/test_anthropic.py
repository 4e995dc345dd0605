"""The Anthropic Messages surface through the real `anthropic` SDK: greedy text equal to
plain mlx-lm, streaming equal to non-streaming, usage, stop reasons, tool_use and
thinking blocks (the tiny model forced to write them), errors in Anthropic's shape,
speculation and its per-request overrides, and count_tokens.

This SDK speaks `httpx2`, not `httpx`, so it gets its own ASGI client; raw requests use
conftest's `make_client`. It no longer has sampling arguments, so `temperature` travels
in `extra_body`.
"""

from __future__ import annotations

import json

import anthropic
import httpx2
import pytest
from mlx_lm import generate

from scheduler import Scheduler
from server.anthropic.blocks import BlockStream
from server.anthropic.prompt import normalize_messages
from server.anthropic.schemas import MessagesPrompt
from server.app import create_app
from server.config import ServerConfig
from server.output_parser import ParsedDelta, ToolCall
from tests.clients import forced_scheduler
from tests.conftest import MODEL_NAME, make_client
from tests.forcing import SCRIPTS, tool_round_trip_messages

BASE_URL = "http://tandem.test"
GREEDY = {"temperature": 0}
FAULT = "FAIL-HERE"  # the scheduler's test hook: such a prompt fails mid-generation
SPEC_PROMPT = "def add(a, b):\n    return a + b\n" * 3

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"type": "string"}}}
TOOLS = [
    {"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER_SCHEMA},
    {"name": "get_time", "input_schema": TIME_SCHEMA},
]
# The same tools as the chat template receives them.
TEMPLATE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
]


@pytest.fixture(scope="module")
def forced(tiny_model_dir, reference):
    yield from forced_scheduler(tiny_model_dir, reference.tokenizer, SCRIPTS, FAULT)


def sdk_http(scheduler: Scheduler, **config_overrides) -> httpx2.AsyncClient:
    """The app behind an httpx2 client, configured as conftest's `make_client` does."""
    config = ServerConfig(
        scheduler=scheduler.config, served_model_name=MODEL_NAME, **config_overrides
    )
    transport = httpx2.ASGITransport(app=create_app(config, scheduler))
    return httpx2.AsyncClient(transport=transport, base_url=BASE_URL, timeout=60)


def sdk(http: httpx2.AsyncClient, **credentials) -> anthropic.AsyncAnthropic:
    credentials = credentials or {"api_key": "x"}
    return anthropic.AsyncAnthropic(base_url=BASE_URL, http_client=http, **credentials)


async def create(client: anthropic.AsyncAnthropic, extra_body: dict | None = None, **kwargs):
    """A greedy request (unless extra_body says otherwise)."""
    return await client.messages.create(
        model=MODEL_NAME, extra_body={**GREEDY, **(extra_body or {})}, **kwargs
    )


def ask(name: str) -> list[dict]:
    return [{"role": "user", "content": f"Weather please. FORCE:{name}"}]


def rendered_ids(reference, messages: list[dict], tools: list | None = None) -> list[int]:
    text = reference.tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return reference.tokenizer.encode(text, add_special_tokens=False)


def prompt_tokens(usage) -> int:
    """Anthropic reports prompt tokens read from cache apart from `input_tokens`."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def prompt_tokens_of(body: dict) -> int:
    return body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"]


def blocks(message) -> list[tuple]:
    """Content blocks without their random ids."""
    out = []
    for block in message.content:
        if block.type == "text":
            out.append(("text", block.text))
        elif block.type == "thinking":
            out.append(("thinking", block.thinking, block.signature))
        else:
            out.append((block.type, block.name, block.input))
    return out


def sse_events(body: str) -> list[tuple[str, dict]]:
    """(event name, data) pairs of an Anthropic SSE body."""
    events = []
    for frame in body.strip().split("\n\n"):
        name_line, data_line = frame.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        events.append((name_line[len("event: ") :], json.loads(data_line[len("data: ") :])))
    return events


# --- Plain text: exactness, streaming, usage, stop reasons --------------------------


async def test_greedy_text_equals_mlx_lm_generate_on_templated_prompt(scheduler, reference):
    async with sdk_http(scheduler) as http:
        reply = await create(
            sdk(http),
            max_tokens=48,
            system="You are terse.",
            messages=[{"role": "user", "content": "Say hello."}],
        )
    prompt = reference.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello."},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    expected = generate(reference.model, reference.tokenizer, prompt, max_tokens=48)
    assert blocks(reply) == [("text", expected)]
    assert reply.id.startswith("msg_")
    assert (reply.type, reply.role, reply.model) == ("message", "assistant", MODEL_NAME)


async def test_usage_counts_the_rendered_prompt_and_the_generated_tokens(scheduler, reference):
    messages = [{"role": "user", "content": "Count these tokens, please."}]
    tokens = reference.greedy_until_eos(rendered_ids(reference, messages), 24)
    async with sdk_http(scheduler) as http:
        first = await create(sdk(http), max_tokens=24, messages=messages)
        again = await create(sdk(http), max_tokens=24, messages=messages)
    for reply in (first, again):
        assert prompt_tokens(reply.usage) == len(rendered_ids(reference, messages))
        assert reply.usage.output_tokens == len(tokens)
    assert again.usage.cache_read_input_tokens > 0  # the prefix cache served the repeat
    ended = tokens[-1] in reference.tokenizer.eos_token_ids
    assert first.stop_reason == ("end_turn" if ended else "max_tokens")


async def test_sdk_streamed_text_equals_non_streamed_text(scheduler):
    messages = [{"role": "user", "content": "Tell me a story about a robot."}]
    async with sdk_http(scheduler) as http:
        client = sdk(http)
        whole = await create(client, max_tokens=60, messages=messages)
        async with client.messages.stream(
            model=MODEL_NAME, max_tokens=60, messages=messages, extra_body=GREEDY
        ) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
        raw = [e async for e in await create(client, max_tokens=60, messages=messages, stream=True)]
    assert text == whole.content[0].text
    assert blocks(final) == blocks(whole)
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 60)
    assert prompt_tokens(final.usage) == prompt_tokens(whole.usage)
    assert [e.type for e in raw[:2]] == ["message_start", "content_block_start"]  # no pings
    assert [e.type for e in raw[-3:]] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [e.delta.text for e in raw if e.type == "content_block_delta"]
    assert "".join(deltas) == whole.content[0].text
    assert {e.index for e in raw if e.type.startswith("content_block")} == {0}


async def test_raw_sse_names_every_event_and_closes_with_usage(scheduler):
    payload = {
        "model": MODEL_NAME,
        "max_tokens": 12,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Hello"}],
    }
    async with make_client(scheduler) as client:
        whole = (await client.post("/v1/messages", json=payload)).json()
        streamed = await client.post("/v1/messages", json={**payload, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert all(name == data["type"] for name, data in events)
    assert [name for name, _ in events[:2]] == ["message_start", "ping"]
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["usage"]["input_tokens"] == prompt_tokens_of(whole)
    assert delta["delta"] == {"stop_reason": whole["stop_reason"], "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert [{"type": "text", "text": text}] == whole["content"]
    assert set(whole["usage"]) == {
        "input_tokens",
        "output_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
    }


async def test_natural_stop_is_end_turn(forced, reference):
    async with sdk_http(forced) as http:
        reply = await create(sdk(http), max_tokens=40, messages=ask("plain"))
    assert blocks(reply) == [("text", "Just text.")]
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    script = reference.tokenizer.encode("Just text.", add_special_tokens=False)
    assert reply.usage.output_tokens == len(script) + 1  # the EOS token is generated too


async def test_max_tokens_stop_reason(forced):
    async with sdk_http(forced) as http:
        reply = await create(sdk(http), max_tokens=2, messages=ask("plain"))
    assert (reply.stop_reason, reply.stop_sequence, reply.usage.output_tokens) == (
        "max_tokens",
        None,
        2,
    )


async def test_stop_sequence_cuts_output_and_names_the_matched_sequence(forced):
    kwargs = {"max_tokens": 40, "messages": ask("plain"), "stop_sequences": ["zzz", "text"]}
    async with sdk_http(forced) as http:
        client = sdk(http)
        reply = await create(client, **kwargs)
        async with client.messages.stream(model=MODEL_NAME, extra_body=GREEDY, **kwargs) as s:
            final = await s.get_final_message()
    for message in (reply, final):
        assert blocks(message) == [("text", "Just ")]
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "text")


# --- Tools and thinking ----------------------------------------------------------------


async def test_tool_call_becomes_a_tool_use_block(forced):
    async with sdk_http(forced) as http:
        reply = await create(sdk(http), max_tokens=80, messages=ask("tool"), tools=TOOLS)
    assert reply.stop_reason == "tool_use"
    assert blocks(reply) == [("tool_use", "get_weather", {"city": "Paris", "days": 2})]
    assert reply.content[0].id.startswith("toolu_")


async def test_streamed_tool_calls_assemble_through_the_sdk_helper(forced):
    kwargs = {"max_tokens": 120, "messages": ask("two"), "tools": TOOLS}
    expected = [
        ("text", "Checking both."),
        ("tool_use", "get_weather", {"city": "Oslo"}),
        ("tool_use", "get_time", {"zone": "CET"}),
    ]
    async with sdk_http(forced) as http:
        client = sdk(http)
        whole = await create(client, **kwargs)
        async with client.messages.stream(model=MODEL_NAME, extra_body=GREEDY, **kwargs) as s:
            events = [event async for event in s]
            final = await s.get_final_message()
    assert blocks(whole) == blocks(final) == expected
    assert final.stop_reason == whole.stop_reason == "tool_use"
    deltas = [(e.index, e.delta.type) for e in events if e.type == "content_block_delta"]
    assert [index for index, kind in deltas if kind == "input_json_delta"] == [1, 2]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["text", "tool_use", "tool_use"]


async def test_tool_result_round_trip_renders_through_the_template(forced, reference):
    async with sdk_http(forced) as http:
        client = sdk(http)
        first = await create(client, max_tokens=80, messages=ask("tool"), tools=TOOLS)
        call = first.content[0]
        follow_up = [
            *ask("tool"),
            {"role": "assistant", "content": [block.model_dump() for block in first.content]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": call.id,
                        "content": [{"type": "text", "text": "Sunny, 21 C"}],
                    },
                    {"type": "text", "text": "Thanks. FORCE:plain"},
                ],
            },
        ]
        second = await create(client, max_tokens=20, messages=follow_up, tools=TOOLS)
        counted = await client.messages.count_tokens(
            model=MODEL_NAME, messages=follow_up, tools=TOOLS
        )
    assert blocks(second) == [("text", "Just text.")]
    chat_messages = tool_round_trip_messages(ask("tool")[0], call.id)
    ids = rendered_ids(reference, chat_messages, TEMPLATE_TOOLS)
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in reference.tokenizer.decode(ids)
    assert prompt_tokens(second.usage) == counted.input_tokens == len(ids)


async def test_thinking_becomes_a_thinking_block_before_the_text(forced):
    kwargs = {
        "max_tokens": 60,
        "messages": ask("think"),
        "thinking": {"type": "enabled", "budget_tokens": 1024},  # accepted, changes nothing
    }
    expected = [("thinking", "The user wants a greeting.", ""), ("text", "Hello there!")]
    async with sdk_http(forced) as http:
        client = sdk(http)
        whole = await create(client, **kwargs)
        async with client.messages.stream(model=MODEL_NAME, extra_body=GREEDY, **kwargs) as s:
            events = [event async for event in s]
            final = await s.get_final_message()
    assert blocks(whole) == blocks(final) == expected
    deltas = [(e.index, e.delta.type) for e in events if e.type == "content_block_delta"]
    assert {kind for _, kind in deltas} == {"thinking_delta", "text_delta"}
    assert [index for index, _ in deltas] == sorted(index for index, _ in deltas)


async def test_final_assistant_turn_is_a_prefill_the_reply_continues(forced, reference):
    messages = [*ask("plain"), {"role": "assistant", "content": "Answer:"}]
    async with sdk_http(forced) as http:
        reply = await create(sdk(http), max_tokens=20, messages=messages)
    template = reference.tokenizer.apply_chat_template(
        ask("plain"), add_generation_prompt=True, tokenize=False
    )
    prompt = reference.tokenizer.encode(template + "Answer:", add_special_tokens=False)
    assert prompt_tokens(reply.usage) == len(prompt)
    assert blocks(reply) == [("text", "Just text.")]  # the forced script, after the prefill


# --- Errors ------------------------------------------------------------------------------

HI = [{"role": "user", "content": "hi"}]


def with_content(*content: dict) -> dict:
    return {"max_tokens": 8, "messages": [{"role": "user", "content": list(content)}]}


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
VIDEO = {"type": "video", "source": {}}


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ({"messages": HI}, "max_tokens: Field required"),
        ({"max_tokens": "16", "messages": HI}, "max_tokens"),
        ({"max_tokens": 0, "messages": HI}, "max_tokens"),
        ({"max_tokens": 8, "messages": "hi"}, "messages"),
        ({"max_tokens": 8, "messages": []}, "messages"),
        ({"max_tokens": 8, "messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": 5}]}, "content"),
        ({"max_tokens": 8, "messages": HI, "temperature": "hot"}, "temperature"),
        ({"max_tokens": 8, "messages": HI, "stream": "yes"}, "stream"),
        ({"max_tokens": 8, "messages": HI, "stop_sequences": "END"}, "stop_sequences"),
        ({"max_tokens": 8, "messages": HI, "system": 3}, "system"),
        ({"max_tokens": 8, "messages": HI, "metadata": {"enable_draft": "no"}}, "enable_draft"),
        (with_content({"type": "text", "text": 5}), "text"),
        (with_content({"type": "video", "source": {}}), "'video' block, which this server"),
        (with_content({"type": "tool_result", "tool_use_id": "t", "content": [VIDEO]}),
         "'video' block"),
        ({"max_tokens": 8, "messages": HI, "system": [IMAGE]}, "system.0.type"),
        (with_content({"type": "tool_use", "id": "t", "name": "f", "input": {}}), "user turn"),
        ({"max_tokens": 8, "messages": HI, "tool_choice": {"type": "any"}}, "no tools"),
        ({"max_tokens": 8, "messages": HI, "tools": TOOLS,
          "tool_choice": {"type": "tool", "name": "nope"}}, "not in tools"),
        ({"max_tokens": 8, "messages": HI, "tools": TOOLS, "tool_choice": {"type": "tool"}},
         "needs a name"),
        ({"max_tokens": 8, "messages": HI, "output_config": {"format": {"type": "xml"}}},
         "json_schema"),
        ({"max_tokens": 8, "messages": HI,
          "output_config": {"format": {"type": "json_schema", "schema": {"type": "nope"}}}},
         "invalid JSON schema"),
        ({"max_tokens": 8, "messages": HI, "tools": [{"name": "f"}]}, "input_schema"),
    ],
)  # fmt: skip
async def test_invalid_requests_get_400_in_anthropic_shape(client, payload, fragment):
    response = await client.post("/v1/messages", json=payload)
    assert response.status_code == 400, response.text
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert fragment in body["error"]["message"]


async def test_bad_json_and_unknown_model_in_anthropic_shape(client):
    bad = await client.post(
        "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        missing = await client.post(path, json={"model": "nope", "max_tokens": 8, "messages": HI})
        assert missing.status_code == 404
        assert missing.json() == {
            "type": "error",
            "error": {
                "type": "not_found_error",
                "message": f"model 'nope' does not exist; this server serves '{MODEL_NAME}'",
            },
        }


async def test_failure_mid_generation_is_an_error_event_or_a_500(forced):
    payload = {"max_tokens": 20, "messages": [{"role": "user", "content": f"{FAULT} FORCE:plain"}]}
    async with make_client(forced) as client:
        whole = await client.post("/v1/messages", json=payload)
        streamed = await client.post("/v1/messages", json={**payload, "stream": True})
    assert whole.status_code == 500
    assert whole.json()["error"]["type"] == "api_error"
    events = sse_events(streamed.text)
    assert events[0][0] == "message_start" and events[-1][0] == "error"
    assert events[-1][1]["type"] == "error"
    assert events[-1][1]["error"]["type"] == "api_error"
    assert "message_stop" not in [name for name, _ in events]
    async with sdk_http(forced) as http:
        with pytest.raises(anthropic.APIStatusError) as failed:
            async with sdk(http).messages.stream(
                model=MODEL_NAME, extra_body=GREEDY, **payload
            ) as stream:
                await stream.get_final_message()
    assert failed.value.body["error"]["type"] == "api_error"


async def test_unknown_fields_are_ignored(client):
    payload = {"max_tokens": 4, "messages": HI, "service_tier": "auto", "cache_control": {}}
    response = await client.post("/v1/messages", json=payload)
    assert response.status_code == 200, response.text


async def test_sdk_raises_its_typed_errors(scheduler):
    async with sdk_http(scheduler) as http:
        client = sdk(http)
        with pytest.raises(anthropic.BadRequestError) as bad:
            await create(client, max_tokens=8, messages=[{"role": "user", "content": [VIDEO]}])
        with pytest.raises(anthropic.NotFoundError) as missing:
            await client.messages.create(model="nope", max_tokens=8, messages=HI)
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert missing.value.body["error"]["type"] == "not_found_error"


async def test_api_key_is_checked_as_x_api_key_or_bearer(scheduler):
    payload = {"max_tokens": 4, "messages": HI}
    async with make_client(scheduler, api_keys=("k",)) as raw:
        denied = await raw.post("/v1/messages", json=payload)
        wrong = await raw.post("/v1/messages", json=payload, headers={"x-api-key": "nope"})
        by_header = await raw.post("/v1/messages", json=payload, headers={"x-api-key": "k"})
        by_bearer = await raw.post(
            "/v1/messages/count_tokens", json=payload, headers={"Authorization": "Bearer k"}
        )
    for response in (denied, wrong):
        assert response.status_code == 401
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "authentication_error"
    assert by_header.status_code == by_bearer.status_code == 200
    async with sdk_http(scheduler, api_keys=("k",)) as http:
        with pytest.raises(anthropic.AuthenticationError):
            await create(sdk(http, api_key="nope"), max_tokens=4, messages=HI)
        assert (await create(sdk(http, api_key="k"), max_tokens=4, messages=HI)).content
        bearer = sdk(http, api_key=None, auth_token="k")
        assert (await create(bearer, max_tokens=4, messages=HI)).content


# --- Speculation and count_tokens -------------------------------------------------------


async def test_speculation_runs_on_messages_and_greedy_text_equals_plain(spec_scheduler, reference):
    messages = [{"role": "user", "content": SPEC_PROMPT}]
    async with sdk_http(spec_scheduler) as http:
        reply = await create(sdk(http), max_tokens=64, messages=messages)
    async with make_client(spec_scheduler) as raw:
        payload = {"max_tokens": 64, "temperature": 0, "messages": messages, "stream": True}
        streamed = sse_events((await raw.post("/v1/messages", json=payload)).text)
    stats = reply.speculation
    assert 0 < stats["accepted_tokens"] <= stats["draft_tokens"]
    assert "draft" in stats["by_method"]
    assert streamed[-2][1]["speculation"] == stats
    prompt = reference.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    expected = generate(reference.model, reference.tokenizer, prompt, max_tokens=64)
    assert blocks(reply) == [("text", expected)]


async def test_metadata_overrides_switch_speculation_per_request(spec_scheduler):
    messages = [{"role": "user", "content": SPEC_PROMPT}]
    async with sdk_http(spec_scheduler) as http:
        client = sdk(http)
        off = await create(
            client,
            max_tokens=32,
            messages=messages,
            metadata={"user_id": "u", "enable_draft": False, "enable_pld": False},
        )
        zero = await create(
            client, max_tokens=32, messages=messages, extra_body={"num_draft_tokens": 0}
        )
        two = await create(
            client,
            max_tokens=32,
            messages=messages,
            metadata={"num_draft_tokens": 2, "enable_pld": False},
        )
    assert off.speculation["drafts"] == zero.speculation["drafts"] == 0
    assert two.speculation["drafts"] > 0 and len(two.speculation["accepted_per_position"]) <= 2


async def test_count_tokens_equals_the_prompt_tokens_of_a_real_request(scheduler, reference):
    kwargs = {
        "system": [
            {"type": "text", "text": "You are terse."},
            {"type": "text", "text": "Be kind."},
        ],
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
            {"role": "user", "content": "What is the weather?"},
        ],
        "tools": TOOLS,
    }
    async with sdk_http(scheduler) as http:
        client = sdk(http)
        counted = await client.messages.count_tokens(model=MODEL_NAME, **kwargs)
        reply = await create(client, max_tokens=4, **kwargs)
    chat_messages = [
        {"role": "system", "content": "You are terse.\nBe kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is the weather?"},
    ]
    expected = len(rendered_ids(reference, chat_messages, TEMPLATE_TOOLS))
    assert counted.input_tokens == prompt_tokens(reply.usage) == expected


# --- Pure translation ---------------------------------------------------------------------


def test_user_blocks_become_tool_messages_then_text():
    prompt = MessagesPrompt.model_validate(
        {
            "system": "Sys",
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},
                        {"type": "text", "text": "Looking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"},
                        {"type": "text", "text": "And?"},
                    ],
                },
            ],
        }
    )
    call = {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    assert normalize_messages(prompt.system, prompt.messages) == [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "And?"},
    ]


def test_whitespace_between_blocks_does_not_open_a_block():
    layout = BlockStream()
    layout.feed(ParsedDelta(reasoning="\n"))
    layout.feed(ParsedDelta(reasoning="Plan."))
    layout.feed(ParsedDelta(content="\n\n"))
    layout.feed(ParsedDelta(tool_calls=[ToolCall("f", '{"a": 1}', id="call_x")]))
    layout.feed(ParsedDelta(content="\n"))
    layout.feed(ParsedDelta(content=" Done"))
    layout.feed(ParsedDelta(content=" \n"))
    layout.close()
    assert layout.blocks == [
        {"type": "thinking", "thinking": "\nPlan.", "signature": ""},
        {"type": "tool_use", "id": "toolu_x", "name": "f", "input": {"a": 1}},
        {"type": "text", "text": "\n Done \n"},
    ]


def test_block_events_number_blocks_in_order():
    layout = BlockStream()
    events = layout.feed(ParsedDelta(content="Hi", reasoning="Think"))
    events += layout.close()
    assert [(e["type"], e["index"]) for e in events] == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
    ]
