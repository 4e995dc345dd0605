"""The real-model tier: SmolLM2-135M-Instruct (the demo; a GGUF from its registry
package, imported once into the cache) through the real HTTP stack, with its real
chat template and 49k-token BPE tokenizer. Slow: run by `make test-slow` in CI."""

from __future__ import annotations

import json

import pytest
from mlx_lm import generate, load

from engines.model.gguf_import import import_gguf
from engines.model.packaged_models import SMOLLM2_135M, packaged_gguf
from tests.clients import CODE, chat, post_chat, served
from tests.conftest import make_client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_dir():
    return import_gguf(packaged_gguf(SMOLLM2_135M))


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    yield from served(smollm2_dir)


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    return load(str(smollm2_dir))


@pytest.mark.parametrize(
    "question",
    ["What is the capital of France?", "Name three colours.", "Write a haiku about tea."],
)
async def test_greedy_chat_equals_mlx_lm_generate(smollm2, reference, question):
    model, tokenizer = reference
    prompt = tokenizer.apply_chat_template(
        chat(question), add_generation_prompt=True, tokenize=False
    )
    expected = generate(model, tokenizer, prompt, max_tokens=24)
    body = await post_chat(smollm2, messages=chat(question), max_tokens=24)
    assert body["choices"][0]["message"]["content"] == expected
    if "France" in question:
        assert "Paris" in expected


async def test_prompt_lookup_on_quoted_code_equals_plain(smollm2):
    """A 135M model answers an edit request in prose, but it does quote code it is asked
    to repeat: prompt lookup then drafts from the prompt, and the output is unchanged."""
    request = chat(f"Repeat this code exactly as it is:\n\n{CODE}")
    plain = await post_chat(smollm2, messages=request, max_tokens=64, enable_pld=False)
    drafted = await post_chat(smollm2, messages=request, max_tokens=64, enable_pld=True)
    assert drafted["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert drafted["speculation"]["draft_tokens"] > 0, drafted["speculation"]


async def test_streamed_utf8_never_splits_a_character(smollm2):
    text = "café 🙂 日本語 ñ e\u0301 Ελληνικά"
    messages = chat(f"Repeat exactly: {text}")
    whole = (await post_chat(smollm2, messages=messages, max_tokens=40))["choices"][0]
    async with make_client(smollm2) as client:
        async with client.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 40, "temperature": 0, "stream": True},
        ) as response:
            deltas = []
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"]
                    if choice and choice[0]["delta"].get("content"):
                        deltas.append(choice[0]["delta"]["content"])
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == whole["message"]["content"]


async def test_a_stop_string_across_a_token_boundary_ends_the_text_before_it(smollm2, reference):
    _, tokenizer = reference
    messages = chat("What is the capital of France?")
    full = (await post_chat(smollm2, messages=messages, max_tokens=24))["choices"][0]["message"]
    ids = tokenizer.encode(full["content"], add_special_tokens=False)
    pieces = [tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    boundary = next(len(p) for p in pieces if len(p) >= 6)  # the end of a token, inside the text
    stop = full["content"][boundary - 2 : boundary + 2]  # two characters each side
    assert len(stop) == 4
    body = await post_chat(smollm2, messages=messages, max_tokens=24, stop=[stop])
    assert body["choices"][0]["message"]["content"] == full["content"].split(stop)[0]
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_structured_output_follows_the_schema(smollm2):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    body = await post_chat(
        smollm2,
        messages=chat("Which city is the capital of France? Answer in JSON."),
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    answer = json.loads(body["choices"][0]["message"]["content"])
    assert set(answer) == {"city", "country"}
