"""Speculation through HTTP: stats in responses and final chunks, per-request
overrides on every endpoint, and greedy output equal to plain decoding."""

from __future__ import annotations

import json

import pytest
from mlx_lm import generate

from tests.conftest import make_client

PROMPT = "def add(a, b):\n    return a + b\n" * 3


def payload_for(endpoint: str, **extra) -> dict:
    base = {"max_tokens": 64, "temperature": 0}
    if endpoint == "/v1/completions":
        base["prompt"] = PROMPT
    else:
        base["messages"] = [{"role": "user", "content": PROMPT}]
    return {**base, **extra}


def last_data(body: str) -> dict:
    data = [line[6:] for line in body.splitlines() if line.startswith("data: {")]
    finals = [json.loads(d) for d in data if json.loads(d).get("speculation") is not None]
    assert len(finals) == 1
    return finals[0]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_response_and_final_chunk_carry_speculation_stats(spec_scheduler, endpoint):
    async with make_client(spec_scheduler) as client:
        whole = (await client.post(endpoint, json=payload_for(endpoint))).json()
        stats = whole["speculation"]
        assert stats["draft_tokens"] > 0
        assert 0 < stats["accepted_tokens"] <= stats["draft_tokens"]
        assert sum(stats["accepted_per_position"]) == stats["accepted_tokens"]
        assert "draft" in stats["by_method"]
        streamed = await client.post(endpoint, json=payload_for(endpoint, stream=True))
        assert last_data(streamed.text)["speculation"] == stats


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_overrides_switch_speculation_off_per_request(spec_scheduler, endpoint):
    async with make_client(spec_scheduler) as client:
        off = payload_for(endpoint, enable_draft=False, enable_pld=False)
        body = (await client.post(endpoint, json=off)).json()
        assert body["speculation"]["drafts"] == 0
        zero = payload_for(endpoint, num_draft_tokens=0)
        assert (await client.post(endpoint, json=zero)).json()["speculation"]["drafts"] == 0
        two = payload_for(endpoint, num_draft_tokens=2, enable_pld=False)
        stats = (await client.post(endpoint, json=two)).json()["speculation"]
        assert stats["drafts"] > 0 and len(stats["accepted_per_position"]) <= 2


async def test_speculative_greedy_text_equals_mlx_lm_over_http(spec_scheduler, reference):
    async with make_client(spec_scheduler) as client:
        body = (await client.post("/v1/completions", json=payload_for("/v1/completions"))).json()
    assert body["speculation"]["accepted_tokens"] > 0
    expected = generate(reference.model, reference.tokenizer, PROMPT, max_tokens=64)
    assert body["choices"][0]["text"] == expected
