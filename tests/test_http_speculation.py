"""Speculation through HTTP: stats in responses and final chunks, per-request
overrides on every endpoint, and greedy output equal to plain decoding."""

from __future__ import annotations

import json

import pytest
from mlx_lm import generate
from prometheus_client.parser import text_string_to_metric_families

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


async def served_counts(client) -> dict[str, float]:
    """The server's lifetime draft counters, from /metrics (summed over methods)."""
    response = await client.get("/metrics")
    totals = dict.fromkeys(COUNTERS.values(), 0.0)
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in COUNTERS and sample.name.endswith("_total"):
                totals[COUNTERS[sample.name]] += sample.value
    return totals


COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_response_and_final_chunk_carry_speculation_stats(spec_scheduler, endpoint):
    """Each response's stats are what the server counted for it (drafting adapts between
    requests -- the draft's calibration is learned -- so two runs need not draft alike)."""
    async with make_client(spec_scheduler) as client:
        for stream in (False, True):
            before = await served_counts(client)
            response = await client.post(endpoint, json=payload_for(endpoint, stream=stream))
            after = await served_counts(client)
            stats = last_data(response.text) if stream else response.json()
            stats = stats["speculation"]
            assert stats["draft_tokens"] > 0
            assert 0 < stats["accepted_tokens"] <= stats["draft_tokens"]
            assert sum(stats["accepted_per_position"]) == stats["accepted_tokens"]
            assert "draft" in stats["by_method"]
            assert (
                sum(m["draft_tokens"] for m in stats["by_method"].values())
                == (stats["draft_tokens"])
            )
            for name, total in after.items():
                assert stats[name] == total - before[name], name


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
