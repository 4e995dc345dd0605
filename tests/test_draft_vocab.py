"""A draft that scores only its frequent tokens (and each request's own): its logits are
the whole head's on those rows, one request's own tokens are never scored for another,
and speculation with it stays exact -- greedy output equal to plain decoding, one
request at a time and in the batch, and sampled output in plain sampling's
distribution."""

from __future__ import annotations

import zlib

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from engines.drafting.draft_vocab import (
    LEFT_OUT_LOGIT,
    MAX_OWN,
    OwnTokens,
    ReducedVocabDraft,
    bind_own,
    kept_token_ids,
    reduce_draft_vocab,
)
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from engines.sample.sampling import RandomStream
from engines.sequence import make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from tests.distributions import assert_same_token_distribution
from tests.test_batched_speculation import (
    COST,
    PROMPTS,
    assert_rows_equal,
    mixed_requests,
    run_batch,
)

KEPT_ROWS = 128  # of the tiny tokenizer's 512: most text needs tokens left out


@pytest.fixture(scope="module")
def draft(perturbed_draft_dir):
    model, tokenizer = load(str(perturbed_draft_dir))
    return model, tokenizer


def logits_of(model, tokens: list[int]) -> mx.array:
    return model(mx.array([tokens]), cache=make_prompt_cache(model))


def test_kept_rows_are_the_first_ids_and_every_special_token(draft):
    model, tokenizer = draft
    kept = kept_token_ids(tokenizer, KEPT_ROWS, 512)
    assert kept[:KEPT_ROWS] == list(range(KEPT_ROWS))
    for eos in tokenizer.eos_token_ids:
        assert eos in kept
    assert all(t < 512 for t in kept)


def test_reduced_logits_are_the_whole_heads_on_kept_and_own_rows_floor_elsewhere(draft):
    model, tokenizer = draft
    reduced = reduce_draft_vocab(model, tokenizer, KEPT_ROWS)
    assert isinstance(reduced, ReducedVocabDraft)
    tokens = tokenizer.encode(PROMPTS[0])
    own = sorted({t for t in tokens if not reduced.kept_mask[t]})
    assert own, "the prompt needs tokens outside the kept rows"
    whole = logits_of(model, tokens)
    mine = logits_of(reduced.bind([own]), tokens)
    scored = mx.array(reduced.kept + own)
    assert mx.allclose(mine[..., scored], whole[..., scored], atol=1e-4).item()
    others = [t for t in range(512) if not reduced.kept_mask[t] and t not in own]
    assert mx.all(mine[..., mx.array(others)] == LEFT_OUT_LOGIT).item()
    unbound = logits_of(reduced, tokens)
    assert mx.all(unbound[..., mx.array(own)] == LEFT_OUT_LOGIT).item()


def test_one_rows_own_tokens_are_never_scored_for_another_row(draft):
    model, tokenizer = draft
    reduced = reduce_draft_vocab(model, tokenizer, KEPT_ROWS)
    left_out = [t for t in range(512) if not reduced.kept_mask[t]]
    mine, theirs = left_out[:5], left_out[5:9]
    inputs = mx.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    whole = model(inputs, cache=make_prompt_cache(model))
    logits = reduced.bind([mine, theirs, []])(inputs, cache=make_prompt_cache(model))
    assert mx.allclose(logits[0][..., mx.array(mine)], whole[0][..., mx.array(mine)], atol=1e-4)
    assert mx.all(logits[0][..., mx.array(theirs)] == LEFT_OUT_LOGIT).item()
    assert mx.allclose(logits[1][..., mx.array(theirs)], whole[1][..., mx.array(theirs)], atol=1e-4)
    assert mx.all(logits[1][..., mx.array(mine)] == LEFT_OUT_LOGIT).item()
    assert mx.all(logits[2][..., mx.array(mine + theirs)] == LEFT_OUT_LOGIT).item()


def test_own_tokens_follow_the_context_and_start_over_on_another():
    kept = bytearray([1] * 4 + [0] * 6)
    own = OwnTokens()
    assert own.update([1, 2, 7, 5], kept) == [5, 7]
    assert own.update([1, 2, 7, 5, 9, 3], kept) == [5, 7, 9]
    assert own.scanned == 6
    assert own.update([8], kept) == [8], "a shorter context is another request's"


def test_a_quantized_head_reduces_to_the_same_rows(perturbed_draft_dir):
    model, tokenizer = load(str(perturbed_draft_dir))
    nn.quantize(model, group_size=32, bits=8)
    reduced = reduce_draft_vocab(model, tokenizer, KEPT_ROWS)
    assert isinstance(reduced, ReducedVocabDraft)
    tokens = tokenizer.encode(PROMPTS[1])
    kept = mx.array(reduced.kept)
    assert mx.allclose(
        logits_of(reduced, tokens)[..., kept], logits_of(model, tokens)[..., kept], atol=1e-4
    ).item()


class ScaledLogits:
    """A model whose logits are its head's, doubled (as softcapped or scaled heads are)."""

    def __init__(self, model) -> None:
        self.model, self.lm_head, self.inner = model.model, getattr(model, "lm_head", None), model

    def __call__(self, inputs, cache=None):
        return 2.0 * self.inner(inputs, cache=cache)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_model_whose_logits_are_more_than_its_head_keeps_its_whole_vocabulary(draft):
    model, tokenizer = draft
    scaled = ScaledLogits(model)
    assert reduce_draft_vocab(scaled, tokenizer, KEPT_ROWS) is scaled


def test_the_automatic_size_leaves_a_small_vocabulary_whole(draft):
    model, tokenizer = draft
    assert reduce_draft_vocab(model, tokenizer, None) is model
    assert reduce_draft_vocab(model, tokenizer, 0) is model
    assert bind_own(model, [OwnTokens()], [[1, 2]]) is model


def test_the_drafter_scores_its_requests_own_tokens(draft):
    """A proposal brings the request's own tokens into its state, and drafts what the
    whole draft drafts for as long as that is a kept or an own token."""
    from engines.drafting.draft_model import DraftModelDrafter, DraftState

    model, tokenizer = draft
    reduced = reduce_draft_vocab(model, tokenizer, KEPT_ROWS)
    greedy = SamplingParams(temperature=0.0)
    rng = RandomStream(mx.random.key(0))
    proposed_own = 0
    for text in PROMPTS:
        # what the draft wrote after the prompt: a random model loops, so its next
        # tokens are often ones this context already holds
        prompt = tokenizer.encode(text)
        steps = generate_step(mx.array(prompt), model, max_tokens=40)
        context = prompt + [token for token, _ in steps]
        state = DraftState()
        mine = DraftModelDrafter(reduced, 512).propose(state, context, 6, greedy, rng)
        whole = DraftModelDrafter(model, 512).propose(DraftState(), context, 6, greedy, rng)
        own = sorted({t for t in context if not reduced.kept_mask[t]})
        assert state.own.ids == own
        scored = [t for t in whole.tokens if reduced.kept_mask[t] or t in own]
        covered = next((i for i, t in enumerate(whole.tokens) if t not in scored), 6)
        assert mine.tokens[:covered] == whole.tokens[:covered], text
        proposed_own += sum(t in own for t in mine.tokens[:covered])
    assert proposed_own, "some proposals drafted a request's own token"


# ---- speculation with a reduced draft stays exact -------------------------------------


def reduced_registry(target_dir, draft_dir):
    registry = ModelRegistry.load(str(target_dir), str(draft_dir))
    registry.draft.model = reduce_draft_vocab(registry.draft.model, registry.tokenizer, KEPT_ROWS)
    assert isinstance(registry.draft.model, ReducedVocabDraft)
    return registry


@pytest.fixture(scope="module")
def reduced_engines(tiny_model_dir, perturbed_draft_dir):
    from engines.batched.engine import BatchedSpeculativeEngine

    registry = reduced_registry(tiny_model_dir, perturbed_draft_dir)
    single = SpeculativeEngine(registry, SpecConfig(), cost=COST)
    batched = BatchedSpeculativeEngine(registry, single.speculation, prefill_step_size=64)
    return registry, single, batched


def run_alone(registry, engine, request):
    registry.transfer(engine.name)
    seq = make_sequence(request, registry.tokenizer)
    engine.admit(seq)
    while engine.active is not None:
        engine.step()
    return seq


def test_one_request_drafting_from_a_reduced_vocabulary_equals_plain_decoding(
    reduced_engines, reference
):
    registry, single, _ = reduced_engines
    accepted = 0
    for i, text in enumerate(PROMPTS[:4]):
        prompt = reference.tokenizer.encode(text)
        request = GenerationRequest(
            f"r{i}",
            tuple(prompt),
            48,
            SamplingParams(temperature=0.0),
            ignore_eos=True,
            speculation=SpeculationOverrides(enable_pld=False),
        )
        seq = run_alone(registry, single, request)
        assert seq.generated == reference.greedy_tokens(prompt, 48), text
        accepted += sum(s.accepted_tokens for s in seq.spec.by_method.values())
    assert accepted > 0, "the reduced draft's proposals were accepted"


@pytest.mark.parametrize("n", [2, 5])
def test_batched_rows_drafting_from_a_reduced_vocabulary_equal_solo_plain_decoding(
    reduced_engines, reference, n
):
    registry, _, batched = reduced_engines
    registry.transfer(batched.name)
    requests, expected = mixed_requests(reference, n)
    seqs, outputs, drafted = run_batch(batched, requests)
    assert_rows_equal(seqs, outputs, expected)
    assert drafted > 0
    assert "draft" in {m for seq in seqs.values() for m in seq.spec.by_method}


def first_two(registry, engine, prompt, seeds, spec: bool) -> list[tuple[int, ...]]:
    overrides = (
        SpeculationOverrides(enable_pld=False) if spec else SpeculationOverrides(num_draft_tokens=0)
    )
    pairs = []
    for seed in seeds:
        request = GenerationRequest(
            f"s{seed}",
            tuple(prompt),
            2,
            SamplingParams(temperature=0.8, top_k=6),
            ignore_eos=True,
            speculation=overrides,
        )
        registry.transfer(engine.name)
        seq = make_sequence(request, registry.tokenizer)
        seq.rng = RandomStream(mx.random.key(seed))
        engine.admit(seq)
        while engine.active is not None:
            engine.step()
        pairs.append(tuple(seq.generated))
    return pairs


@pytest.mark.slow
def test_sampling_with_a_reduced_draft_matches_plain_sampling(reduced_engines, reference):
    """q gives the tokens left out probability 0, and the rejection rule stays exact."""
    registry, single, _ = reduced_engines
    prompt = reference.tokenizer.encode(PROMPTS[0])
    base = zlib.crc32(b"reduced-vocab-sampled") % 10_000
    trials = 900
    spec = first_two(registry, single, prompt, [base + i for i in range(trials)], spec=True)
    plain = first_two(
        registry, single, prompt, [base + trials + i for i in range(trials)], spec=False
    )
    assert_same_token_distribution(spec, plain)


async def test_a_server_with_draft_vocab_drafts_from_it_and_answers_as_mlx_lm(
    tiny_model_dir, perturbed_draft_dir, reference
):
    """`--draft-vocab` through the scheduler config: the loaded draft is reduced, every
    request (one alone, then four at once in the batch) is plain mlx-lm's text."""
    import asyncio

    from mlx_lm import generate

    from tests.conftest import make_client, start_scheduler

    scheduler = start_scheduler(
        tiny_model_dir, draft_model=str(perturbed_draft_dir), draft_vocab=KEPT_ROWS
    )
    try:
        assert isinstance(scheduler.registry.draft.model, ReducedVocabDraft)
        prompts = [PROMPTS[1], *PROMPTS[3:6]]
        async with make_client(scheduler) as client:

            async def complete(prompt: str) -> dict:
                payload = {"prompt": prompt, "max_tokens": 40, "temperature": 0}
                response = await client.post("/v1/completions", json=payload)
                assert response.status_code == 200, response.text
                return response.json()

            alone = await complete(prompts[0])
            together = await asyncio.gather(*(complete(p) for p in prompts))
            stats = (await client.get("/v1/stats")).json()["speculation"]
        kept = len(kept_token_ids(scheduler.registry.tokenizer, KEPT_ROWS, 512))
        want = {"kept": kept, "of": 512, "own_per_request_max": MAX_OWN}
        assert stats["draft_vocabulary"] == want
        assert alone["speculation"]["draft_tokens"] > 0
        for prompt, body in zip([prompts[0], *prompts], [alone, *together], strict=True):
            expected = generate(reference.model, reference.tokenizer, prompt, max_tokens=40)
            assert body["choices"][0]["text"] == expected, prompt
    finally:
        scheduler.stop()
