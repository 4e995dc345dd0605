"""Odd and hostile input against the real app and tiny model, each surface (found by a
review; the docstrings say what each did before its fix).

Requests go through the ASGI app with `raise_app_exceptions=False`, so an unhandled
exception shows up as the 500 a real client would get instead of escaping into the test.
"""

from __future__ import annotations

import json

import httpx
import pytest

from server.app import create_app
from server.config import ServerConfig
from server.responses.store import ResponseStore
from tests.clients import forced_scheduler
from tests.conftest import MODEL_NAME

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
USER = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}
KEY_A = "review-key-aaaaaaaaaaaaaaaa"
KEY_B = "review-key-bbbbbbbbbbbbbbbb"
FAULT = "REVIEW-FAULT-NOW"
SCRIPTS = {
    # A model's tool call whose arguments use JSON5's NaN (Python's json reads it).
    "nan": '<tool_call>\n{"name": "get_weather", "arguments": {"city": NaN}}\n</tool_call>',
}
WEATHER_TOOL = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {}}},
}


def app_client(scheduler, store: ResponseStore | None = None, **config) -> httpx.AsyncClient:
    app = create_app(
        ServerConfig(scheduler=scheduler.config, served_model_name=MODEL_NAME, **config),
        scheduler,
    )
    if store is not None:
        app.state.responses_store = store
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://tandem.test", timeout=30)


@pytest.fixture
async def http(scheduler):
    async with app_client(scheduler) as client:
        yield client


@pytest.fixture(scope="module")
def forced(tiny_model_dir, reference):
    yield from forced_scheduler(tiny_model_dir, reference.tokenizer, SCRIPTS, FAULT)


def strict_json(text: str) -> object:
    """RFC 8259 JSON: NaN and Infinity are not numbers there (nor in JavaScript)."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) per frame."""
    frames = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = line[len("data: ") :]
        if data is not None:
            frames.append((name, data))
    return frames


def assert_openai_error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    return error


def assert_anthropic_error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"]
    return body["error"]


# --- defects: each test below fails on the code as reviewed ----------------------------


@pytest.mark.parametrize("function", [5, "get_weather", [1]])
async def test_chat_assistant_tool_call_whose_function_is_not_an_object_is_400(http, function):
    """`tool_calls[].function` must be an object; anything else was a 500 (AttributeError
    in chat.tool_call_arguments)."""
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [{"function": function}]},
    ]
    response = await http.post(CHAT, json={"messages": messages, "max_tokens": 2})
    error = assert_openai_error(response)
    assert error["param"].startswith("messages[1]")
    ok = await http.post(CHAT, json={"messages": USER, "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
async def test_non_json_constants_anywhere_in_a_body_are_400(http, constant):
    """NaN and Infinity are not JSON (RFC 8259); Python's json.loads reads them, and
    decode_body let them through wherever the model is `Any` (tool schemas here)."""
    body = (
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": '
        b'[{"type": "function", "function": {"name": "f", "parameters": '
        b'{"type": "object", "default": ' + constant + b"}}}]}"
    )
    response = await http.post(CHAT, content=body, headers=JSON)
    assert_openai_error(response)


@pytest.mark.parametrize("number", [b"NaN", b"1e999"])
async def test_responses_with_a_non_finite_number_in_tools_is_not_a_500(http, number):
    """The Responses object echoes `tools`; a NaN (or 1e999, read as inf) in them made the
    finished response unserialisable: 500 after the whole generation ran."""
    body = (
        b'{"input": "hi", "max_output_tokens": 2, "tools": [{"type": "function", "name": "f",'
        b' "parameters": {"type": "object", "default": ' + number + b"}}]}"
    )
    response = await http.post(RESPONSES, content=body, headers=JSON)
    assert response.status_code < 500, response.text
    strict_json(response.text)


async def test_responses_stream_with_nan_in_tools_sends_only_valid_json(http):
    """Streamed, the same echo went out as the bare token NaN in every response.* event
    (and into the stored body GET returns): no JSON parser but Python's reads it."""
    body = (
        b'{"input": "hi", "max_output_tokens": 2, "stream": true, "tools": [{"type": '
        b'"function", "name": "f", "parameters": {"type": "object", "default": NaN}}]}'
    )
    response = await http.post(RESPONSES, content=body, headers=JSON)
    assert response.status_code < 500, response.text
    if response.status_code == 200:
        for _, data in sse_events(response.text):
            strict_json(data)


@pytest.mark.parametrize("field", ["text", "tool_choice"])
async def test_responses_deeply_nested_echoed_field_is_not_a_500(http, field):
    """A body json.loads accepts (depth 900) in a field the Response object echoes
    (text.format, tool_choice) overflowed the recursive PiecewiseJSONResponse.pieces:
    RecursionError, a 500 after the generation ran."""
    deep = "[" * 900 + "]" * 900
    if field == "text":
        extra = f'"text": {{"format": {{"type": "text", "x": {deep}}}}}'
    else:
        extra = (
            '"tools": [{"type": "function", "name": "f"}], '
            f'"tool_choice": {{"type": "function", "name": "f", "x": {deep}}}'
        )
    body = f'{{"input": "hi", "max_output_tokens": 2, {extra}}}'
    response = await http.post(RESPONSES, content=body.encode(), headers=JSON)
    assert response.status_code < 500, response.text[:300]


async def test_anthropic_tool_call_with_nan_arguments_is_not_a_500(forced):
    """A model that writes NaN in a tool call's arguments (the parser's json.loads takes
    it) made the non-streamed Messages answer a 500: JSONResponse refuses NaN."""
    payload = {
        "max_tokens": 60,
        "temperature": 0,
        "tools": [WEATHER_TOOL],
        "messages": [{"role": "user", "content": "FORCE:nan"}],
    }
    async with app_client(forced) as client:
        response = await client.post(MESSAGES, json=payload)
    assert response.status_code == 200, response.text
    strict_json(response.text)


async def test_responses_stream_that_fails_mid_generation_ends_with_response_failed(forced):
    """A streamed Response must end with a terminal response.* event (completed,
    incomplete or failed); on a mid-stream failure it ended with a bare `error` event,
    so clients waiting for the terminal event (the SDK's stream helper, Codex, the Agents
    SDK) see a stream that stops without one."""
    # greedy and past EOS: the fault fires at the third token, which a sampled answer
    # ending sooner never reached (the stream then completed)
    payload = {
        "input": f"Tell me more {FAULT}",
        "max_output_tokens": 30,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with app_client(forced) as client:
        response = await client.post(RESPONSES, json=payload)
    assert response.status_code == 200
    names = [name for name, _ in sse_events(response.text)]
    assert names[0] == "response.created"
    assert "response.failed" in names, names
    failed = json.loads(dict(sse_events(response.text))["response.failed"])
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"]


async def test_one_key_cannot_evict_another_keys_stored_responses(scheduler):
    """The store is one LRU for every key: a key that makes `capacity` responses pushes
    every other key's out, so their previous_response_id and GET turn into 404s. Here the
    capacity is 4 (the default is 256 entries, a few seconds of tiny requests)."""
    store = ResponseStore(capacity=4)
    body = {"input": "hi", "max_output_tokens": 1}
    async with app_client(scheduler, store=store, api_keys=(KEY_A, KEY_B)) as client:
        a = {"Authorization": f"Bearer {KEY_A}"}
        b = {"Authorization": f"Bearer {KEY_B}"}
        mine = await client.post(RESPONSES, json=body, headers=a)
        assert mine.status_code == 200, mine.text
        for _ in range(store.capacity):
            assert (await client.post(RESPONSES, json=body, headers=b)).status_code == 200
        kept = await client.get(f"{RESPONSES}/{mine.json()['id']}", headers=a)
    assert kept.status_code == 200, kept.text


# --- edge cases that hold: kept as regression tests --------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": "Only a system turn."}],
        [{"role": "tool", "content": "result", "tool_call_id": "call_nowhere"}],
        [{"role": "user", "content": []}],
        [{"role": "user", "content": ""}],
        [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}],
    ],
    ids=["system-only", "tool-without-call", "empty-parts", "empty-text", "developer"],
)
async def test_odd_but_well_formed_conversations_are_served(http, messages):
    response = await http.post(CHAT, json={"messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("seed", [-1, 2**63, 2**64, 10**30, -(2**63) - 1])
async def test_seed_outside_64_bits_is_served_not_500(http, seed):
    response = await http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, "seed": seed})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", [COMPLETIONS, MESSAGES])
async def test_top_k_far_beyond_the_vocabulary_is_served(http, path):
    body = {"prompt": "hi", "messages": USER, "max_tokens": 2, "top_k": 10**9}
    response = await http.post(path, json=body)
    assert response.status_code == 200, response.text


async def test_duplicate_keys_are_not_a_500(http):
    body = b'{"prompt": "hi", "max_tokens": 2, "max_tokens": 3, "prompt": "yo"}'
    response = await http.post(COMPLETIONS, content=body, headers=JSON)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": NaN}',
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_p": 1e999}',
        b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}',
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
        b'"stop_sequences": ["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"]}',
        b'{"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}], '
        b'"max_tokens": 2}',
        b'{"messages": [{"role": "user", "content": [{"type": ["text"]}]}], "max_tokens": 2}',
    ],
    ids=["nan-temperature", "inf-top-p", "surrogate", "17-stops", "unknown-block", "list-type"],
)
async def test_anthropic_bad_input_is_400_in_anthropic_shape(http, raw):
    response = await http.post(MESSAGES, content=raw, headers=JSON)
    assert_anthropic_error(response)
    ok = await http.post(MESSAGES, json={"messages": USER, "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"messages": 5},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": [{"type": "video", "source": {}}]}]},
        {"messages": USER, "tools": [{"name": "f"}]},
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ]
        },
        {"messages": [{"role": "user", "content": "\ud800"}]},
        {"system": [{"type": "image"}], "messages": USER},
    ],
    ids=[
        "list",
        "content-int",
        "video",
        "no-schema",
        "final-tool-use",
        "surrogate",
        "system-image",
    ],
)
async def test_count_tokens_bad_input_is_400_in_anthropic_shape(http, body):
    raw = json.dumps(body).encode()  # ASCII: a lone surrogate travels as \\ud800
    response = await http.post(COUNT, content=raw, headers=JSON)
    assert_anthropic_error(response)


@pytest.mark.parametrize(
    "item",
    [
        {"type": "computer_call", "id": "c"},
        {"type": 7},
        {"type": "message", "role": "user", "content": [{"type": "input_video", "file_id": "f"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1, 2]"},
        {"type": "function_call_output", "call_id": "c", "output": 5},
        {"role": "wizard", "content": "x"},
    ],
    ids=["unknown-type", "int-type", "video-part", "list-arguments", "int-output", "role"],
)
async def test_responses_bad_input_items_are_400(http, item):
    response = await http.post(RESPONSES, json={"input": [item], "max_output_tokens": 2})
    error = assert_openai_error(response)
    assert error["param"].startswith("input")


async def test_responses_of_one_key_stay_invisible_to_another_when_streamed(scheduler):
    """Streamed responses are stored per key too; GET and DELETE of another key's id and
    a foreign previous_response_id are 404, and the owner still has it afterwards."""
    async with app_client(scheduler, api_keys=(KEY_A, KEY_B)) as client:
        a = {"Authorization": f"Bearer {KEY_A}"}
        b = {"x-api-key": KEY_B}
        streamed = await client.post(
            RESPONSES,
            json={"input": "hi", "max_output_tokens": 2, "stream": True, "instructions": "s3"},
            headers=a,
        )
        done = dict(sse_events(streamed.text))
        rid = json.loads(done["response.incomplete"])["response"]["id"]
        assert (await client.get(f"{RESPONSES}/{rid}", headers=b)).status_code == 404
        assert (await client.delete(f"{RESPONSES}/{rid}", headers=b)).status_code == 404
        follow = await client.post(
            RESPONSES,
            json={"input": "more", "previous_response_id": rid, "max_output_tokens": 2},
            headers=b,
        )
        assert assert_openai_error(follow, 404)["code"] == "previous_response_not_found"
        assert (await client.get(f"{RESPONSES}/{rid}", headers=a)).status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"messages": USER, "max_tokens": 2, "logit_bias": {"1e0": 1}},
        {"messages": USER, "max_tokens": 2, "logit_bias": {"5": "x"}},
        {"messages": USER, "max_tokens": 2, "stop": ["a"] * 17},
        {"messages": USER, "max_tokens": 2, "stop": [1]},
        {"messages": USER, "max_tokens": 2, "n": 0},
        {"messages": USER, "max_tokens": 2, "seed": 1.5},
        {"messages": USER, "max_tokens": 2, "tool_choice": 5},
        {
            "messages": USER,
            "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
        },
        {
            "messages": USER,
            "max_tokens": 2,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "integer", "minimum": "x"}},
            },
        },
        {
            "messages": USER,
            "max_tokens": 2,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"type": "string", "pattern": "("}},
            },
        },
        {"messages": USER, "max_tokens": 2, "response_format": {"type": ["json_object"]}},
        {"messages": USER, "max_completion_tokens": 0},
        {"messages": [{"role": "user", "content": [{"type": 5}]}], "max_tokens": 2},
    ],
    ids=[
        "float-bias-key",
        "str-bias",
        "17-stops",
        "int-stop",
        "n0",
        "float-seed",
        "int-choice",
        "list-params",
        "bad-minimum",
        "bad-pattern",
        "list-format",
        "zero-max",
        "int-part",
    ],
)
async def test_chat_nested_wrong_types_are_400_and_server_keeps_serving(http, body):
    response = await http.post(CHAT, json=body)
    assert_openai_error(response)
    ok = await http.post(CHAT, json={"messages": USER, "max_tokens": 2})
    assert ok.status_code == 200
