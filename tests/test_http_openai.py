"""OpenAI completions and chat over the real ASGI app: exact greedy text, streaming,
usage, stop sequences, and the real `openai` SDK."""

from __future__ import annotations

import json

import openai
import pytest
from mlx_lm import generate

from tests.conftest import MODEL_NAME, make_client

PROMPT = "Once upon a time there was a robot"


def sse_payloads(body: str) -> list:
    events = [line[len("data: ") :] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_completion_greedy_text_equals_mlx_lm_generate(client, reference):
    response = await client.post(
        "/v1/completions",
        json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 64, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    expected = generate(reference.model, reference.tokenizer, PROMPT, max_tokens=64)
    assert body["choices"][0]["text"] == expected
    prompt_ids = reference.tokenizer.encode(PROMPT)
    assert prompt_ids[0] == reference.tokenizer.bos_token_id
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)


async def test_completion_greedy_tokens_equal_reference_to_max_tokens(client, reference):
    prompt_ids = reference.tokenizer.encode(PROMPT)
    response = await client.post(
        "/v1/completions",
        json={"prompt": prompt_ids, "max_tokens": 200, "temperature": 0, "ignore_eos": True},
    )
    body = response.json()
    expected_ids = reference.greedy_tokens(prompt_ids, 200)
    assert body["usage"]["completion_tokens"] == 200
    assert body["choices"][0]["finish_reason"] == "length"
    detok = reference.tokenizer.detokenizer
    for token in expected_ids:
        detok.add_token(token)
    detok.finalize()
    assert body["choices"][0]["text"] == detok.text


async def test_chat_greedy_text_equals_mlx_lm_generate_on_templated_prompt(client, reference):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello."},
    ]
    response = await client.post(
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": messages, "max_tokens": 48, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    prompt = reference.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    expected = generate(reference.model, reference.tokenizer, prompt, max_tokens=48)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert body["object"] == "chat.completion"


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_streamed_text_concatenated_equals_non_streamed(client, endpoint):
    if endpoint == "/v1/completions":
        payload = {"prompt": PROMPT}
    else:
        payload = {"messages": [{"role": "user", "content": PROMPT}]}
    payload.update(max_tokens=80, temperature=0, ignore_eos=True)
    whole = (await client.post(endpoint, json=payload)).json()
    streamed = await client.post(
        endpoint, json={**payload, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(streamed.text)
    if endpoint == "/v1/completions":
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        expected = whole["choices"][0]["text"]
    else:
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        expected = whole["choices"][0]["message"]["content"]
    assert text == expected
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1]["choices"] == []
    streamed_usage, whole_usage = chunks[-1]["usage"], whole["usage"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert streamed_usage[key] == whole_usage[key]
    # The second request reuses the first one's prompt from the prefix cache.
    assert (
        streamed_usage["prompt_tokens_details"]["cached_tokens"] == whole_usage["prompt_tokens"] - 1
    )


async def test_stop_sequence_cuts_output_with_finish_reason_stop(client, reference):
    full = generate(reference.model, reference.tokenizer, PROMPT, max_tokens=40)
    stop = full[12:15]
    response = await client.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": [stop]},
    )
    choice = response.json()["choices"][0]
    assert choice["text"] == full[: full.index(stop)]
    assert choice["finish_reason"] == "stop"


async def test_seeded_sampling_through_http_is_reproducible(client):
    payload = {
        "prompt": PROMPT,
        "max_tokens": 30,
        "temperature": 0.9,
        "seed": 1234,
        "top_k": 50,
        "min_p": 0.01,
        "ignore_eos": True,
    }
    first = (await client.post("/v1/completions", json=payload)).json()
    second = (await client.post("/v1/completions", json=payload)).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


async def test_openai_sdk_chat_and_completion_and_streaming(scheduler, reference):
    async with make_client(scheduler) as http_client:
        sdk = openai.AsyncOpenAI(
            base_url="http://tandem.test/v1", api_key="unused", http_client=http_client
        )
        models = await sdk.models.list()
        assert [m.id for m in models.data] == [MODEL_NAME]
        completion = await sdk.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0
        )
        expected = generate(reference.model, reference.tokenizer, PROMPT, max_tokens=32)
        assert completion.choices[0].text == expected
        chat = await sdk.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=24,
            temperature=0,
        )
        assert chat.choices[0].message.role == "assistant"
        assert chat.usage.completion_tokens >= 1
        stream = await sdk.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=24,
            temperature=0,
            stream=True,
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(pieces) == chat.choices[0].message.content


async def test_api_key_required_when_configured(scheduler):
    async with make_client(scheduler, api_keys=("secret",)) as client:
        assert (await client.get("/health")).status_code == 200
        denied = await client.get("/v1/models")
        assert denied.status_code == 401
        assert denied.json()["error"]["type"] == "authentication_error"
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        bearer = await client.get("/v1/models", headers={"Authorization": "Bearer secret"})
        assert bearer.status_code == 200
        x_api_key = await client.get("/v1/models", headers={"x-api-key": "secret"})
        assert x_api_key.status_code == 200
