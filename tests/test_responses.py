"""The OpenAI Responses API (`/v1/responses`) through the real `openai` SDK: exact greedy
text, streaming events, usage, instructions, previous_response_id and its bounded store,
function calls and reasoning (the tiny model forced to write them), errors, speculation."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from mlx_lm import generate
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from server.app import create_app
from server.config import ServerConfig
from server.responses.endpoints import (
    ResponsesRequest,
    ResponseStore,
    StoredResponse,
    normalize_input,
)
from tests.clients import forced_scheduler
from tests.conftest import MODEL_NAME, make_client
from tests.forcing import SCRIPTS, THINKING, TOOL_CALL, tool_round_trip_messages

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
    {
        "type": "function",
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
]
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
]
FAULT = "FAULT-NOW"
CODE = "def add(a, b):\n    return a + b\n" * 3


@pytest.fixture(scope="module")
def forced(tiny_model_dir, reference):
    yield from forced_scheduler(tiny_model_dir, reference.tokenizer, SCRIPTS, FAULT)


def sdk(http_client: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://tandem.test/v1", api_key="x", http_client=http_client, max_retries=0
    )


def client_with_store(scheduler, store: ResponseStore) -> httpx.AsyncClient:
    """Like `make_client`, with a given response store on the app."""
    config = ServerConfig(scheduler=scheduler.config, served_model_name=MODEL_NAME)
    app = create_app(config, scheduler)
    app.state.responses_store = store
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://tandem.test", timeout=60)


def rendered(reference, messages: list[dict], tools: list | None = None) -> str:
    return reference.tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )


def token_count(reference, prompt: str) -> int:
    return len(reference.tokenizer.encode(prompt, add_special_tokens=False))


def ask(name: str) -> str:
    return f"Weather please. FORCE:{name}"


def sse_frames(body: str) -> list[tuple[str, dict]]:
    """(event name, data) for every frame of a Responses stream."""
    frames = []
    for block in body.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        frames.append((lines["event"], json.loads(lines["data"])))
    return frames


async def stream_events(client: openai.AsyncOpenAI, **kwargs) -> list:
    stream = await client.responses.create(model=MODEL_NAME, stream=True, **kwargs)
    return [event async for event in stream]


def assert_well_formed(events: list, last: str = "response.completed") -> None:
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == last and last not in types[:-1]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    ids = {e.response.id for e in events if hasattr(e, "response")}
    assert len(ids) == 1


# --- text --------------------------------------------------------------------------


async def test_greedy_output_text_equals_mlx_lm_generate_with_instructions(scheduler, reference):
    async with make_client(scheduler) as http:
        response = await sdk(http).responses.create(
            model=MODEL_NAME,
            instructions="You are terse.",
            input="Say hello.",
            max_output_tokens=48,
            temperature=0,
        )
    prompt = rendered(
        reference,
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hello."},
        ],
    )
    assert "You are terse." in prompt
    expected = generate(reference.model, reference.tokenizer, prompt, max_tokens=48)
    assert response.output_text == expected
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == MODEL_NAME and response.instructions == "You are terse."
    (message,) = response.output
    assert message.type == "message" and message.id.startswith("msg_")
    ids = reference.tokenizer.encode(prompt, add_special_tokens=False)
    generated = reference.greedy_until_eos(ids, 48)
    status = "completed" if generated[-1] in reference.tokenizer.eos_token_ids else "incomplete"
    assert message.role == "assistant" and message.status == status == response.status
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (len(ids), len(generated))
    assert usage.total_tokens == len(ids) + len(generated)
    assert usage.output_tokens_details.reasoning_tokens == 0


async def test_input_items_render_like_the_plain_string(scheduler):
    items = [
        {"role": "developer", "content": "You are terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
    ]
    async with make_client(scheduler) as http:
        client = sdk(http)
        as_items = await client.responses.create(
            model=MODEL_NAME, input=items, max_output_tokens=16, temperature=0
        )
        as_string = await client.responses.create(
            model=MODEL_NAME,
            instructions="You are terse.",
            input="Hi.",
            max_output_tokens=16,
            temperature=0,
        )
    assert as_items.output_text == as_string.output_text
    assert as_items.usage.input_tokens == as_string.usage.input_tokens


async def test_streamed_deltas_equal_the_non_streamed_text(scheduler):
    request = {"input": "Once upon a time", "max_output_tokens": 40, "temperature": 0}
    async with make_client(scheduler) as http:
        client = sdk(http)
        whole = await client.responses.create(model=MODEL_NAME, **request)
        events = await stream_events(client, **request)
    assert_well_formed(events, last=f"response.{whole.status}")
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == whole.output_text
    completed = events[-1].response
    assert completed.output_text == whole.output_text and completed.status == whole.status
    assert completed.usage.output_tokens == whole.usage.output_tokens
    assert completed.usage.input_tokens == whole.usage.input_tokens
    item_id = completed.output[0].id
    assert {e.item_id for e in deltas} == {item_id}
    assert [e.type for e in events if e.type.startswith("response.output_item")] == [
        "response.output_item.added",
        "response.output_item.done",
    ]


async def test_sse_frames_name_their_event_and_end_without_done(scheduler):
    async with make_client(scheduler) as http:
        reply = await http.post(
            "/v1/responses",
            json={"input": "Hello", "max_output_tokens": 8, "temperature": 0, "stream": True},
        )
    assert reply.headers["content-type"].startswith("text/event-stream")
    frames = sse_frames(reply.text)
    assert all(name == data["type"] for name, data in frames)
    assert "[DONE]" not in reply.text
    assert frames[-1][0] in ("response.completed", "response.incomplete")


async def test_max_output_tokens_makes_the_response_incomplete(scheduler):
    request = {
        "input": "Count to a hundred.",
        "max_output_tokens": 5,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    async with make_client(scheduler) as http:
        client = sdk(http)
        response = await client.responses.create(model=MODEL_NAME, **request)
        events = await stream_events(client, **request)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5
    assert response.output[0].status == "incomplete"
    assert_well_formed(events, last="response.incomplete")
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == response.output_text


# --- previous_response_id and the store ---------------------------------------------


async def test_previous_response_id_continues_the_conversation(scheduler, reference):
    async with make_client(scheduler) as http:
        client = sdk(http)
        first = await client.responses.create(
            model=MODEL_NAME,
            instructions="Be kind.",
            input="Say hello.",
            max_output_tokens=12,
            temperature=0,
        )
        second = await client.responses.create(
            model=MODEL_NAME,
            previous_response_id=first.id,
            input="And again.",
            max_output_tokens=12,
            temperature=0,
        )
    # Instructions are not carried over to a follow-up, as on OpenAI.
    prompt = rendered(
        reference,
        [
            {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And again."},
        ],
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == token_count(reference, prompt)
    expected = generate(reference.model, reference.tokenizer, prompt, max_tokens=12)
    assert second.output_text == expected


async def test_unknown_previous_response_id_is_404_in_openai_shape(scheduler):
    async with make_client(scheduler) as http:
        with pytest.raises(openai.NotFoundError) as caught:
            await sdk(http).responses.create(
                model=MODEL_NAME, input="Hi", previous_response_id="resp_nope"
            )
        raw = await http.post(
            "/v1/responses", json={"input": "Hi", "previous_response_id": "resp_nope"}
        )
    assert caught.value.status_code == 404
    assert raw.json()["error"] == {
        "message": raw.json()["error"]["message"],
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "previous_response_not_found",
    }
    assert "resp_nope" in raw.json()["error"]["message"]


async def test_store_is_a_bounded_lru(scheduler):
    request = {"model": MODEL_NAME, "max_output_tokens": 4, "temperature": 0}
    async with client_with_store(scheduler, ResponseStore(capacity=2)) as http:
        client = sdk(http)
        ids = [(await client.responses.create(input=f"Turn {i}", **request)).id for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(input="Go on", previous_response_id=ids[0], **request)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(ids[0])
        for kept in ids[1:]:
            assert (await client.responses.retrieve(kept)).id == kept


async def test_retrieve_delete_and_store_false(scheduler):
    request = {"model": MODEL_NAME, "max_output_tokens": 6, "temperature": 0}
    async with make_client(scheduler) as http:
        client = sdk(http)
        created = await client.responses.create(input="Keep me", **request)
        fetched = await client.responses.retrieve(created.id)
        assert fetched.output_text == created.output_text
        assert fetched.usage.output_tokens == created.usage.output_tokens
        await client.responses.delete(created.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(created.id)
        unstored = await client.responses.create(input="Forget me", store=False, **request)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.id)


# --- function calls and reasoning (forced output) -------------------------------------


async def test_function_call_is_an_exact_output_item(forced):
    async with make_client(forced) as http:
        response = await sdk(http).responses.create(
            model=MODEL_NAME, input=ask("tool"), tools=TOOLS, max_output_tokens=80, temperature=0
        )
    (call,) = response.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert response.output_text == "" and response.status == "completed"
    assert response.tools[0].name == "get_weather"
    assert response.speculation["draft_tokens"] >= 0  # the extra field passes through


async def test_sdk_stream_helper_assembles_the_final_response(forced):
    request = {"input": ask("plain"), "max_output_tokens": 24, "temperature": 0}
    async with make_client(forced) as http:
        client = sdk(http)
        async with client.responses.stream(model=MODEL_NAME, **request) as stream:
            texts = [
                event.delta async for event in stream if event.type == "response.output_text.delta"
            ]
            final = await stream.get_final_response()
    assert "".join(texts) == final.output_text == "Just text."
    assert final.status == "completed"


async def test_tool_markup_without_tools_stays_text(forced):
    async with make_client(forced) as http:
        response = await sdk(http).responses.create(
            model=MODEL_NAME, input=ask("tool"), max_output_tokens=80, temperature=0
        )
    assert response.output_text == TOOL_CALL
    assert [item.type for item in response.output] == ["message"]


async def test_streamed_function_call_arguments_assemble_to_the_same_items(forced):
    request = {"input": ask("two"), "tools": TOOLS, "max_output_tokens": 120, "temperature": 0}
    async with make_client(forced) as http:
        client = sdk(http)
        whole = await client.responses.create(model=MODEL_NAME, **request)
        events = await stream_events(client, **request)
        async with client.responses.stream(model=MODEL_NAME, **request) as helper:
            final = await helper.get_final_response()
    assert_well_formed(events)
    arguments: dict[str, str] = {}
    for event in events:
        if event.type == "response.function_call_arguments.delta":
            arguments[event.item_id] = arguments.get(event.item_id, "") + event.delta
    done = {
        e.item_id: e.arguments for e in events if e.type == "response.function_call_arguments.done"
    }
    assert arguments == done
    streamed = events[-1].response.output
    calls = [item for item in streamed if item.type == "function_call"]
    assert [(c.name, json.loads(arguments[c.id])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {"zone": "CET"}),
    ]
    for output in (whole, events[-1].response, final):
        assert [item.type for item in output.output] == [
            "message",
            "function_call",
            "function_call",
        ]
        assert output.output_text == "Checking both."
        assert [(c.name, c.arguments) for c in output.output[1:]] == [
            (c.name, c.arguments) for c in calls
        ]
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1, 2]


async def test_function_call_output_round_trip(forced, reference):
    async with make_client(forced) as http:
        client = sdk(http)
        first = await client.responses.create(
            model=MODEL_NAME, input=ask("tool"), tools=TOOLS, max_output_tokens=80, temperature=0
        )
        (call,) = first.output
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
        thanks = {"role": "user", "content": "Thanks. FORCE:plain"}
        chained = await client.responses.create(
            model=MODEL_NAME,
            previous_response_id=first.id,
            input=[result, thanks],
            tools=TOOLS,
            max_output_tokens=20,
            temperature=0,
        )
        explicit = await client.responses.create(
            model=MODEL_NAME,
            input=[
                {"role": "user", "content": ask("tool")},
                call.model_dump(exclude_none=True),
                result,
                thanks,
            ],
            tools=TOOLS,
            max_output_tokens=20,
            temperature=0,
        )
    prompt = rendered(
        reference,
        tool_round_trip_messages({"role": "user", "content": ask("tool")}, call.call_id),
        CHAT_TOOLS,
    )
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt
    for response in (chained, explicit):
        assert response.output_text == "Just text."
        assert response.usage.input_tokens == token_count(reference, prompt)


async def test_think_output_becomes_a_reasoning_item(forced, reference):
    request = {"input": ask("think"), "max_output_tokens": 60, "temperature": 0}
    async with make_client(forced) as http:
        client = sdk(http)
        response = await client.responses.create(model=MODEL_NAME, **request)
        events = await stream_events(client, **request)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [part.text for part in reasoning.content] == ["The user wants a greeting."]
    assert reasoning.summary == []
    assert message.type == "message" and response.output_text == "Hello there!"
    assert_well_formed(events)
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == "The user wants a greeting."
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == streamed
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Hello there!"
    # usage counts the reasoning: the tokens of <think>...</think>, not of the answer
    thought = token_count(reference, THINKING[: THINKING.index("</think>") + len("</think>")])
    answer = token_count(reference, "Hello there!")
    assert response.usage.output_tokens_details.reasoning_tokens == thought
    assert response.usage.output_tokens - answer - 1 <= thought  # one EOS token at most
    (completed,) = [e for e in events if e.type == "response.completed"]
    assert completed.response.usage.output_tokens_details.reasoning_tokens == thought


async def test_failure_mid_generation(forced):
    request = {"input": f"Tell me more {FAULT}", "max_output_tokens": 30, "temperature": 0}
    async with make_client(forced) as http:
        client = sdk(http)
        with pytest.raises(openai.InternalServerError):
            await client.responses.create(model=MODEL_NAME, **request)
        events = await stream_events(client, **request)
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-2:] == ["error", "response.failed"]
    assert "response.completed" not in types
    assert "injected fault" in events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and "injected fault" in failed.error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_every_response_and_event_validates_against_the_sdk_models(forced):
    """The SDK parses leniently; validating strictly proves every required field is sent."""
    events = TypeAdapter(ResponseStreamEvent)
    async with make_client(forced) as http:
        for name, limit in (("two", 120), ("think", 60), ("plain", 3)):
            request = {"input": ask(name), "tools": TOOLS, "max_output_tokens": limit}
            whole = await http.post("/v1/responses", json=request)
            Response.model_validate(whole.json())
            streamed = await http.post("/v1/responses", json={**request, "stream": True})
            for _, data in sse_frames(streamed.text):
                events.validate_python(data)


# --- pure translation -------------------------------------------------------------------


def test_function_calls_join_the_assistant_turn_they_follow():
    body = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": ""},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
            ]
        }
    )
    user, assistant, tool = normalize_input(body.input)
    assert user == {"role": "user", "content": "Weather?"}
    assert assistant["content"] == "Checking."
    assert [(c["id"], c["function"]) for c in assistant["tool_calls"]] == [
        ("c1", {"name": "f", "arguments": {"a": 1}}),
        ("c2", {"name": "g", "arguments": {}}),
    ]
    assert tool == {"role": "tool", "tool_call_id": "c1", "content": "one"}


def test_store_evicts_the_least_recently_used():
    store = ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put("", name, StoredResponse.of([], {"id": name}))
    assert store.get("", "a") is not None  # "a" is now the most recent
    store.put("", "c", StoredResponse.of([], {"id": "c"}))
    assert store.get("", "b") is None and len(store) == 2
    assert store.get("", "a") is not None and store.get("", "c") is not None


def test_store_counts_bytes_and_keeps_scopes_apart():
    entry = StoredResponse.of([{"role": "user", "content": "hi"}], {"id": "a"})
    store = ResponseStore(max_bytes=2 * entry.size)
    assert store.put("k1", "a", entry) and store.bytes == entry.size
    assert store.get("k2", "a") is None and not store.delete("k2", "a")
    store.put("k1", "a", entry)  # replacing an entry does not count it twice
    assert store.bytes == entry.size
    store.put("k1", "b", entry)
    store.put("k1", "c", entry)
    assert store.get("k1", "a") is None and store.bytes == 2 * entry.size
    too_big = StoredResponse.of([], {"id": "x" * 3 * entry.size})
    assert not store.put("k1", "x", too_big) and store.get("k1", "x") is None
    assert store.delete("k1", "b") and store.bytes == entry.size


# --- errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_video", "video_url": "x"}]}]},
            "input[0].content",
        ),
        (
            {"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "web_search"}]}]},
            "tools",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, None),
        ({"temperature": "hot"}, "temperature"),
        ({"input": 42}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"store": "yes"}, "store"),
        ({"background": True}, "background"),
    ],
)
async def test_refused_requests_are_400_in_openai_shape(scheduler, extra, param):
    async with make_client(scheduler) as http:
        reply = await http.post("/v1/responses", json={"input": "Hi", "tools": TOOLS, **extra})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"].startswith(param)


async def test_unknown_model_is_404_and_unknown_fields_are_ignored(scheduler):
    async with make_client(scheduler) as http:
        client = sdk(http)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="other", input="Hi")
        ok = await client.responses.create(
            model=MODEL_NAME,
            input="Hi",
            max_output_tokens=4,
            reasoning={"effort": "low"},
            extra_body={"no_such_field": 1},
        )
    assert ok.status in ("completed", "incomplete")


# --- speculation ------------------------------------------------------------------------


async def test_speculation_is_active_and_greedy_text_equals_plain(spec_scheduler, reference):
    request = {"input": CODE, "max_output_tokens": 64, "temperature": 0}
    async with make_client(spec_scheduler) as http:
        client = sdk(http)
        response = await client.responses.create(model=MODEL_NAME, **request)
        events = await stream_events(client, **request)
    stats = response.speculation
    assert stats["draft_tokens"] > 0 and 0 < stats["accepted_tokens"] <= stats["draft_tokens"]
    prompt = rendered(reference, [{"role": "user", "content": CODE}])
    assert response.output_text == generate(
        reference.model, reference.tokenizer, prompt, max_tokens=64
    )
    assert events[-1].response.speculation == stats
    assert events[-1].response.output_text == response.output_text


async def test_overrides_switch_speculation_off(spec_scheduler):
    request = {"input": CODE, "max_output_tokens": 32, "temperature": 0}
    async with make_client(spec_scheduler) as http:
        client = sdk(http)
        off = await client.responses.create(
            model=MODEL_NAME, extra_body={"enable_draft": False, "enable_pld": False}, **request
        )
        zero = await client.responses.create(
            model=MODEL_NAME, extra_body={"num_draft_tokens": 0}, **request
        )
        on = await client.responses.create(model=MODEL_NAME, **request)
    assert off.speculation["drafts"] == 0 and zero.speculation["drafts"] == 0
    assert on.speculation["drafts"] > 0
    assert off.output_text == zero.output_text == on.output_text
