"""The MTP head drafting inside the continuous batch (`engines/batched/mtp.py`).

Tiny Qwen3.5 / Qwen3-Next hybrids whose checkpoints carry a head (`tests/tiny_archs.py`):
the "copy" head reproduces the target's next-token path, so most drafts are accepted
and chains run past depth one; the "random" heads are mostly rejected, so every
row's recurrent state is restored and rerun on its own kept tokens. Each row's head
sees every target forward of the batch (prefill chunks, first tokens, verifies,
pipelined plain steps) and carries its head cache in and out of the batch. Every row
equals its solo plain decoding with mlx-lm; sampled rows are exact in distribution."""

from __future__ import annotations

import asyncio
import zlib

import mlx.core as mx
import pytest
from mlx_lm import load

from engines.batched.engine import BatchedSpeculativeEngine
from engines.model.mtp import load_head
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from engines.sample.sampling import RandomStream
from engines.sequence import make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from tests.conftest import Reference, make_client, start_scheduler
from tests.distributions import assert_same_token_distribution
from tests.test_batched_speculation import (
    COST,
    PROMPTS,
    assert_rows_equal,
    round_trip_through_the_batch,
    run_batch,
)
from tests.test_metrics import scrape, value
from tests.tiny_archs import build_tiny_arch

GREEDY = SamplingParams(temperature=0.0)
MTP_ONLY = SpeculationOverrides(enable_pld=False)
HEADS = {
    "copy": ("qwen3_5", "copy"),
    "random": ("qwen3_5", "random"),
    "next": ("qwen3_next", "random"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("batched-mtp")
    return {
        name: build_tiny_arch(kind, root / name, tiny_model_dir, mtp=head)
        for name, (kind, head) in HEADS.items()
    }


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, Reference]:
    return {name: Reference(*load(str(path))) for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def engines(checkpoints):
    """(single-stream, batched) engines on one registry whose head drafts."""
    built = {}
    for name, path in checkpoints.items():
        registry = ModelRegistry.load(str(path))
        registry.mtp = load_head(registry.target.model, registry.target.config, path)
        # k = 4: the copy head's acceptance share (> 1/2) below is calibrated at that length
        spec = SpeculativeEngine(registry, SpecConfig(num_draft_tokens=4), cost=COST)
        batched = BatchedSpeculativeEngine(registry, spec.speculation, prefill_step_size=64)
        registry.transfer(batched.name)
        built[name] = (spec, batched)
    return built


def request(rid, prompt_ids, max_tokens, sampling=GREEDY, speculation=MTP_ONLY):
    return GenerationRequest(
        rid, tuple(prompt_ids), max_tokens, sampling, ignore_eos=True, speculation=speculation
    )


def mtp_stats(seqs) -> tuple[int, int]:
    """(drafted, accepted) by the head over all rows."""
    stats = [seq.spec.by_method["mtp"] for seq in seqs.values() if "mtp" in seq.spec.by_method]
    return sum(s.draft_tokens for s in stats), sum(s.accepted_tokens for s in stats)


# ---- greedy: each row token-identical to its solo mlx-lm decoding ---------------------


@pytest.mark.parametrize("head", ["copy", "random", "next"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_rows_drafting_with_the_head_each_equal_solo_plain_decoding(engines, references, head, n):
    _, engine = engines[head]
    reference = references[head]
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:n]]
    lengths = [200 if i == 0 else 40 + 13 * i for i in range(n)]
    pairs = list(enumerate(zip(prompts, lengths, strict=True)))
    seqs, outputs, drafted = run_batch(engine, [request(f"r{i}", p, m) for i, (p, m) in pairs])
    expected = {f"r{i}": reference.greedy_tokens(p, m) for i, (p, m) in pairs}
    assert_rows_equal(seqs, outputs, expected)
    assert drafted > 0, "rows drafted with the head while batched"
    mtp_drafted, mtp_accepted = mtp_stats(seqs)
    if head == "copy":  # the head agrees: long accepted runs inside the batch
        assert mtp_accepted > 0.5 * mtp_drafted and mtp_accepted > 100
        per_position = seqs["r0"].spec.accepted_per_position
        assert len(per_position) >= 2 and per_position[1] > 0, "chains past depth one"
    else:
        assert 0 < mtp_drafted and mtp_accepted < mtp_drafted


def test_head_rows_beside_prompt_lookup_and_plain_rows_stay_exact(engines, references):
    _, engine = engines["copy"]
    reference = references["copy"]
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:3]]
    overrides = [MTP_ONLY, SpeculationOverrides(), SpeculationOverrides(num_draft_tokens=0)]
    requests = [
        request(f"m{i}", p, 90, speculation=o)
        for i, (p, o) in enumerate(zip(prompts, overrides, strict=True))
    ]
    seqs, outputs, _ = run_batch(engine, requests)
    expected = {f"m{i}": reference.greedy_tokens(p, 90) for i, p in enumerate(prompts)}
    assert_rows_equal(seqs, outputs, expected)
    assert mtp_stats({"m0": seqs["m0"]})[1] > 0
    assert not seqs["m2"].spec.by_method, "a k=0 row never drafts"


def test_a_request_carries_its_head_into_the_batch_and_back_out(engines, references):
    """Single-stream (the head drafting) -> batch -> single-stream: the head's cache
    travels with the row, and one head state sees every position on both sides (it
    never restarts); output equals uninterrupted decoding."""
    spec, engine = engines["copy"]
    seq, back, _ = round_trip_through_the_batch(spec, engine, references["copy"])
    assert back.drafting.mtp is not None and back.drafting.mtp.cache is not None
    assert back.drafting.mtp.start == 0, "the head never restarted"
    assert seq.spec.by_method["mtp"].accepted_tokens > 40


# ---- sampled ---------------------------------------------------------------------------


def test_seeded_head_rows_give_their_solo_seeded_tokens_in_a_batch(engines, references):
    spec, engine = engines["copy"]
    registry = engine.registry
    prompts = [references["copy"].tokenizer.encode(p) for p in PROMPTS[:3]]
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    solo = {}
    registry.transfer(spec.name)
    for i, prompt in enumerate(prompts):
        plain = request(f"s{i}", prompt, 50, sampling, SpeculationOverrides(num_draft_tokens=0))
        seq = make_sequence(plain, registry.tokenizer)
        spec.admit(seq)
        while spec.active is not None:
            spec.step()
        solo[f"s{i}"] = seq.generated
    registry.transfer(engine.name)
    seqs, _, _ = run_batch(
        engine, [request(f"s{i}", p, 50, sampling) for i, p in enumerate(prompts)]
    )
    for rid, tokens in solo.items():
        assert seqs[rid].generated == tokens, rid
    assert mtp_stats(seqs)[1] > 0, "seeded rows accepted head drafts"


def _second_and_third(engine, prompt_ids, seeds, drafting: bool, batch: int = 16):
    """Tokens 2 and 3 of unseeded sampled 3-token requests, `batch` rows at a time,
    each RNG started from a fixed key: the second is the first the head can draft."""
    overrides = MTP_ONLY if drafting else SpeculationOverrides(num_draft_tokens=0)
    sampling = SamplingParams(temperature=0.8, top_k=6)
    pairs, drafted = [], 0
    for start in range(0, len(seeds), batch):
        chunk = seeds[start : start + batch]
        requests = [request(f"s{s}", prompt_ids, 3, sampling, overrides) for s in chunk]
        rngs = {f"s{s}": RandomStream(mx.random.key(s)) for s in chunk}
        seqs, _, _ = run_batch(engine, requests, rngs=rngs)
        pairs += [tuple(seqs[r.request_id].generated[1:]) for r in requests]
        drafted += mtp_stats(seqs)[0]
    return pairs, drafted


@pytest.mark.slow
def test_sampled_head_rows_match_plain_sampling_distribution(engines, references):
    _, engine = engines["copy"]
    prompt = references["copy"].tokenizer.encode(PROMPTS[0])
    base = zlib.crc32(b"batched-mtp-sampled") % 10_000
    trials = 1000
    spec, drafted = _second_and_third(engine, prompt, [base + i for i in range(trials)], True)
    plain, _ = _second_and_third(engine, prompt, [base + trials + i for i in range(trials)], False)
    assert drafted > trials / 2, "most rows drafted their second token with the head"
    assert_same_token_distribution(spec, plain)


# ---- served ----------------------------------------------------------------------------


async def test_served_model_keeps_drafting_with_its_head_under_load(checkpoints, references):
    """Three concurrent HTTP requests: the scheduler batches them speculatively with
    the head drafting inside the batch, /metrics counts those batched drafts, and every
    response equals mlx-lm."""
    scheduler = start_scheduler(checkpoints["copy"])
    reference = references["copy"]
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:3]]
    lengths = [120, 60, 60]

    def body(prompt, n):
        return {
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "enable_pld": False,
        }

    try:
        assert scheduler.rows_roll_back is True
        async with make_client(scheduler) as client:
            responses = await asyncio.gather(
                *(
                    client.post("/v1/completions", json=body(p, n))
                    for p, n in zip(prompts, lengths, strict=True)
                )
            )
            metrics = await scrape(client)
        for prompt, n, response in zip(prompts, lengths, responses, strict=True):
            assert response.status_code == 200, response.text
            detokenizer = reference.tokenizer.detokenizer
            detokenizer.reset()
            for token in reference.greedy_tokens(prompt, n):
                detokenizer.add_token(token)
            detokenizer.finalize()
            assert response.json()["choices"][0]["text"] == detokenizer.text
        assert isinstance(scheduler.batched_engine, BatchedSpeculativeEngine)
        assert scheduler.batched_engine.mtp is not None
        assert value(metrics, "tandem_spec_batch_size_count") > 0, "rows drafted in a batch"
        assert value(metrics, "tandem_spec_accepted_tokens_total", method="mtp") > 0
    finally:
        scheduler.stop()
