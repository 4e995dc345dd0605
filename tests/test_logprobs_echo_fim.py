"""Completions extras: logprobs (also for speculatively accepted and batched tokens),
echo, and fill-in-the-middle via `suffix`; chat logprobs through the OpenAI SDK."""

from __future__ import annotations

import asyncio
import json
import shutil

import mlx.core as mx
import openai
import pytest
from mlx_lm import generate
from mlx_lm.generate import generate_step

from server.openai.logprobs import token_text
from tests.conftest import MODEL_NAME, make_client, start_scheduler

PROMPT = "def add(a, b):\n    return a + b\n" * 2


def reference_logprobs(reference, prompt_ids: list[int], n: int) -> list[tuple[int, mx.array]]:
    steps = generate_step(mx.array(prompt_ids), reference.model, max_tokens=n)
    return [(token, logprobs) for token, logprobs in steps]


def assert_logprobs_match(body: dict, reference, prompt_ids: list[int], top: int) -> None:
    logprobs = body["choices"][0]["logprobs"]
    expected = reference_logprobs(reference, prompt_ids, len(logprobs["token_logprobs"]))
    assert len(logprobs["tokens"]) == body["usage"]["completion_tokens"]
    for i, (token, row) in enumerate(expected):
        assert logprobs["tokens"][i] == token_text(reference.tokenizer, token)
        assert logprobs["token_logprobs"][i] == pytest.approx(row[token].item(), abs=1e-4)
        top_ids = mx.argsort(-row)[:top].tolist()
        got = logprobs["top_logprobs"][i]
        assert list(got) == [token_text(reference.tokenizer, t) for t in top_ids]
        for t, value in zip(top_ids, got.values(), strict=True):
            assert value == pytest.approx(row[t].item(), abs=1e-4)
    assert logprobs["text_offset"][0] == 0


@pytest.fixture(scope="module")
def self_draft(tiny_model_dir):
    """Draft = target: nearly every token is an accepted speculative token."""
    scheduler = start_scheduler(tiny_model_dir, draft_model=str(tiny_model_dir))
    yield scheduler
    scheduler.stop()


async def test_logprobs_equal_plain_decoding(scheduler, reference):
    async with make_client(scheduler) as client:
        body = (
            await client.post(
                "/v1/completions",
                json={
                    "prompt": PROMPT,
                    "max_tokens": 24,
                    "temperature": 0,
                    "logprobs": 3,
                    "ignore_eos": True,
                    "num_draft_tokens": 0,
                },
            )
        ).json()
    assert_logprobs_match(body, reference, reference.tokenizer.encode(PROMPT), 3)


async def test_logprobs_of_accepted_draft_tokens_equal_plain(self_draft, reference):
    async with make_client(self_draft) as client:
        body = (
            await client.post(
                "/v1/completions",
                json={
                    "prompt": PROMPT,
                    "max_tokens": 40,
                    "temperature": 0,
                    "logprobs": 2,
                    "ignore_eos": True,
                    "enable_pld": False,
                },
            )
        ).json()
    assert body["speculation"]["accepted_tokens"] >= 20
    assert_logprobs_match(body, reference, reference.tokenizer.encode(PROMPT), 2)


async def test_logprobs_in_batched_mode_equal_plain(scheduler, reference):
    async with make_client(scheduler) as client:
        replies = await asyncio.gather(
            *(
                client.post(
                    "/v1/completions",
                    json={
                        "prompt": PROMPT + str(i),
                        "max_tokens": 20,
                        "temperature": 0,
                        "logprobs": 1,
                        "ignore_eos": True,
                    },
                )
                for i in range(3)
            )
        )
    for i, reply in enumerate(replies):
        ids = reference.tokenizer.encode(PROMPT + str(i))
        assert_logprobs_match(reply.json(), reference, ids, 1)


async def test_streamed_logprobs_cover_every_token(scheduler):
    async with make_client(scheduler) as client:
        response = await client.post(
            "/v1/completions",
            json={
                "prompt": PROMPT,
                "max_tokens": 30,
                "temperature": 0,
                "logprobs": 0,
                "stream": True,
                "ignore_eos": True,
            },
        )
    chunks = [
        json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")
    ]
    tokens = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert len(tokens) == 30
    offsets = [
        o for c in chunks for o in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])
    ]
    assert offsets == sorted(offsets) and offsets[0] == 0


async def test_chat_logprobs_through_the_sdk(scheduler):
    async with make_client(scheduler) as http:
        client = openai.AsyncOpenAI(base_url="http://tandem.test/v1", api_key="x", http_client=http)
        reply = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=10,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            extra_body={"ignore_eos": True},
        )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 10
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert entry.logprob <= 0


async def test_echo_prepends_the_prompt(scheduler, reference):
    async with make_client(scheduler) as client:
        body = (
            await client.post(
                "/v1/completions",
                json={"prompt": "Once upon", "max_tokens": 12, "temperature": 0, "echo": True},
            )
        ).json()
        streamed = await client.post(
            "/v1/completions",
            json={
                "prompt": "Once upon",
                "max_tokens": 12,
                "temperature": 0,
                "echo": True,
                "stream": True,
            },
        )
    expected = generate(reference.model, reference.tokenizer, "Once upon", max_tokens=12)
    assert body["choices"][0]["text"] == "Once upon" + expected
    chunks = [
        json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    assert chunks[0]["choices"][0]["text"] == "Once upon"
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]


async def test_suffix_builds_a_fill_in_the_middle_prompt(scheduler, reference):
    async with make_client(scheduler) as client:
        body = (
            await client.post(
                "/v1/completions",
                json={
                    "prompt": "def add(a, b):\n",
                    "suffix": "\n    return total\n",
                    "max_tokens": 16,
                    "temperature": 0,
                },
            )
        ).json()
    fim = "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n    return total\n<|fim_middle|>"
    ids = reference.tokenizer.encode(fim)
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["text"] == generate(
        reference.model, reference.tokenizer, fim, max_tokens=16
    )


async def test_suffix_without_fim_tokens_is_a_clear_400(tiny_model_dir, tmp_path):
    no_fim = tmp_path / "no-fim"
    shutil.copytree(tiny_model_dir, no_fim)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = no_fim / name
        path.write_text(path.read_text().replace("fim_", "fxm_"))
    scheduler = start_scheduler(no_fim)
    try:
        async with make_client(scheduler) as client:
            response = await client.post(
                "/v1/completions", json={"prompt": "a", "suffix": "b", "max_tokens": 4}
            )
        assert response.status_code == 400
        assert "fill-in-the-middle" in response.json()["error"]["message"]
    finally:
        scheduler.stop()


def reference_prompt_scores(reference, prompt_ids: list[int]) -> mx.array:
    """Raw log-probabilities of the whole prompt from one plain forward: row i scores
    the token after prompt[i]."""
    logits = reference.model(mx.array(prompt_ids)[None])[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def assert_prompt_logprobs_match(choice: dict, reference, prompt_ids: list[int], top: int):
    logprobs = choice["logprobs"]
    rows = reference_prompt_scores(reference, prompt_ids)
    n = len(prompt_ids)
    tokenizer = reference.tokenizer
    assert logprobs["tokens"][:n] == [token_text(tokenizer, t) for t in prompt_ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i in range(1, n):
        row = rows[i - 1]
        assert logprobs["token_logprobs"][i] == pytest.approx(row[prompt_ids[i]].item(), abs=1e-4)
        top_ids = mx.argsort(-row)[:top].tolist()
        got = logprobs["top_logprobs"][i]
        assert list(got) == [token_text(tokenizer, t) for t in top_ids]
    texts = list(logprobs["tokens"])
    if not choice["text"].startswith(texts[0]):  # a BOS the echoed text does not show
        texts[0] = ""
    assert logprobs["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]


async def test_echo_with_logprobs_scores_the_prompt_then_continues_exactly(scheduler, reference):
    """What evaluation harnesses send: echo + logprobs. The prompt's scores come from the
    prefill that also serves the completion, which still equals plain greedy decoding."""
    prompt_ids = reference.tokenizer.encode(PROMPT)
    async with make_client(scheduler) as client:
        body = (
            await client.post(
                "/v1/completions",
                json={
                    "prompt": prompt_ids,
                    "max_tokens": 12,
                    "temperature": 0,
                    "echo": True,
                    "logprobs": 2,
                    "ignore_eos": True,
                },
            )
        ).json()
    logprobs = body["choices"][0]["logprobs"]
    assert_prompt_logprobs_match(body["choices"][0], reference, prompt_ids, 2)
    generated = [t for t, _ in reference_logprobs(reference, prompt_ids, 12)]
    n = len(prompt_ids)
    assert logprobs["tokens"][n:] == [token_text(reference.tokenizer, t) for t in generated]
    assert body["choices"][0]["text"].startswith(reference.tokenizer.decode(prompt_ids))
    assert len(logprobs["tokens"]) == n + 12


@pytest.mark.parametrize("as_text", [True, False])
async def test_max_tokens_zero_only_scores_the_prompt(scheduler, reference, as_text):
    text = "The cat sat on the mat because it was warm"
    prompt_ids = reference.tokenizer.encode(text)
    async with make_client(scheduler) as client:
        response = await client.post(
            "/v1/completions",
            json={
                "prompt": text if as_text else prompt_ids,
                "max_tokens": 0,
                "echo": True,
                "logprobs": 1,
            },
        )
    choice = response.json()["choices"][0]
    assert choice["text"] == (text if as_text else reference.tokenizer.decode(prompt_ids))
    assert choice["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == len(prompt_ids)
    assert_prompt_logprobs_match(choice, reference, prompt_ids, 1)


async def test_streamed_prompt_logprobs_equal_non_streamed(scheduler, reference):
    prompt_ids = reference.tokenizer.encode(PROMPT)
    payload = {
        "prompt": prompt_ids,
        "max_tokens": 6,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
        "ignore_eos": True,
    }
    async with make_client(scheduler) as client:
        whole = (await client.post("/v1/completions", json=payload)).json()
        streamed = await client.post("/v1/completions", json={**payload, "stream": True})
    chunks = [
        json.loads(line[6:])["choices"][0]
        for line in streamed.text.splitlines()
        if line.startswith("data: {") and '"choices":[{' in line.replace(" ", "")
    ]
    joined: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for key in joined:
            joined[key] += (chunk["logprobs"] or {}).get(key, [])
    expected = whole["choices"][0]["logprobs"]
    assert joined["tokens"] == expected["tokens"]
    assert joined["text_offset"] == expected["text_offset"]
    assert joined["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=1e-5)
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]


async def test_concurrent_prompt_scoring_in_the_batched_engine(self_draft, reference):
    prompts = [reference.tokenizer.encode(t) for t in (PROMPT, "Numbers: 1 2 3 4", "Hi there")]
    async with make_client(self_draft) as client:
        bodies = await asyncio.gather(
            *(
                client.post(
                    "/v1/completions",
                    json={
                        "prompt": p,
                        "max_tokens": 10,
                        "temperature": 0,
                        "echo": True,
                        "logprobs": 1,
                        "ignore_eos": True,
                    },
                )
                for p in prompts
            )
        )
    assert self_draft.batched_engine is not None
    for prompt_ids, response in zip(prompts, bodies, strict=True):
        choice = response.json()["choices"][0]
        logprobs = choice["logprobs"]
        assert_prompt_logprobs_match(choice, reference, prompt_ids, 1)
        generated = [t for t, _ in reference_logprobs(reference, prompt_ids, 10)]
        tail = logprobs["tokens"][len(prompt_ids) :]
        assert tail == [token_text(reference.tokenizer, t) for t in generated]
