"""Speculation inside the batch for hybrid models (recurrent layers beside attention):
Qwen3-Next, Qwen3.5 and LFM2 rows draft (prompt lookup, a plain-KV draft model), one
forward verifies them, and each row's recurrent state is restored and rerun on
exactly its kept tokens (`engines/cache/ragged_recurrent.py`) while its KV layers cut --
every row's output equal to its solo plain decoding with mlx-lm. Rows also prefill
raggedly (padding never enters a recurrent state) and move in and out of the batch
both ways, so a hybrid request drafts alone again once the others finish."""

from __future__ import annotations

import asyncio

import pytest
from mlx_lm import load
from mlx_lm.sample_utils import make_logits_processors

from engines.request import GenerationRequest, SamplingParams
from engines.sequence import FinishReason
from tests.conftest import Reference, start_scheduler
from tests.test_batched_speculation import (
    PROMPTS,
    assert_rows_equal,
    assert_seeded_rows_match_solo,
    assert_served_batch_is_exact_and_returns,
    greedy_request,
    make_engines,
    mixed_requests,
    repetitive_bias,
    round_trip_through_the_batch,
    run_batch,
)
from tests.tiny_archs import build_tiny_arch

ARCHS = ("qwen3_next", "qwen3_5", "lfm2")


@pytest.fixture(scope="module", params=ARCHS)
def hybrid(request, tmp_path_factory, tiny_model_dir, perturbed_draft_dir):
    """(kind, checkpoint, mlx-lm reference, (single-stream, batched) engines whose draft
    is a plain-KV Llama sharing the tokenizer)."""
    kind = request.param
    path = build_tiny_arch(kind, tmp_path_factory.mktemp("hybrid") / kind, tiny_model_dir)
    reference = Reference(*load(str(path)))
    draft = draft_for(kind, perturbed_draft_dir)
    return kind, path, reference, make_engines(path, draft)


def draft_for(kind: str, llama_draft):
    """The plain-KV draft, where the tokenizers agree (transformers loads the
    qwen3_5 checkpoint's copy of the tokenizer with one token more: prompt lookup only)."""
    return None if kind == "qwen3_5" else llama_draft


@pytest.mark.parametrize("n", [2, 3, 5])
def test_hybrid_rows_drafting_in_a_batch_each_equal_solo_plain_decoding(hybrid, n):
    _, _, reference, (_, engine) = hybrid
    assert engine.recurrent, "the batch holds recurrent rows"
    requests, expected = mixed_requests(reference, n)
    seqs, outputs, drafted = run_batch(engine, requests)
    assert_rows_equal(seqs, outputs, expected)
    assert drafted > 0, "rows drafted while batched"
    accepted = sum(seq.spec.accepted_tokens for seq in seqs.values())
    rejected = sum(seq.spec.draft_tokens - seq.spec.accepted_tokens for seq in seqs.values())
    assert accepted > 0 and rejected > 0, "rows kept different numbers of positions"


def test_hybrid_rows_joining_and_cancelled_while_others_speculate_stay_exact(hybrid):
    _, _, reference, (_, engine) = hybrid
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:4]]
    bias = repetitive_bias(reference.tokenizer)
    looping = SamplingParams(temperature=0.0, logit_bias=bias)
    first = [
        GenerationRequest("a", tuple(prompts[0]), 70, looping, ignore_eos=True),
        greedy_request("b", prompts[1], 70),
    ]
    joining = {4: [greedy_request("c", prompts[2], 40)], 9: [greedy_request("d", prompts[3], 30)]}
    seqs, _, drafted = run_batch(engine, first, join_after=joining, cancel_at={6: ["b"]})
    processors = make_logits_processors(logit_bias=dict(bias))
    assert seqs["a"].generated == reference.greedy_tokens(
        prompts[0], 70, logits_processors=processors
    )
    assert seqs["c"].generated == reference.greedy_tokens(prompts[2], 40)
    assert seqs["d"].generated == reference.greedy_tokens(prompts[3], 30)
    assert seqs["b"].finish_reason == FinishReason.CANCELLED
    assert drafted > 0 and engine.batch_size == 0


def test_a_hybrid_request_moves_into_the_batch_and_back_out_exactly(hybrid):
    """Single-stream -> batch -> single-stream with its recurrent state and KV cache:
    the batch hands back exactly the committed tokens but the newest, no trim needed."""
    _, _, reference, (spec, engine) = hybrid
    round_trip_through_the_batch(spec, engine, reference)


def test_seeded_hybrid_rows_give_their_solo_seeded_tokens_in_a_batch(hybrid):
    _, _, reference, (spec, engine) = hybrid
    assert_seeded_rows_match_solo(spec, engine, reference)


async def test_served_hybrid_batches_with_drafting_and_returns_to_single_stream(
    hybrid, perturbed_draft_dir
):
    """The scheduler batches a hybrid speculatively (rows roll back alone) and lets a
    request return to the single-stream engine when the others are done."""
    kind, path, reference, _ = hybrid
    draft = draft_for(kind, perturbed_draft_dir)
    scheduler = start_scheduler(path, draft_model=str(draft) if draft else None)
    try:
        await assert_served_batch_is_exact_and_returns(scheduler, reference)
    finally:
        scheduler.stop()


async def test_paused_hybrid_streams_resume_exactly_when_read_again(hybrid):
    """Backpressure takes an unread stream's row out of the batch (its recurrent state
    and KV cache kept) and puts it back when read: no token lost, repeated or changed."""
    from tests.test_fairness import tokens_of, until_buffered

    _, path, reference, _ = hybrid
    scheduler = start_scheduler(path, max_num_seqs=2, max_unread_events=4, unread_timeout=10.0)
    try:
        prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:2]]
        streams = [scheduler.submit(greedy_request(f"p{i}", p, 60)) for i, p in enumerate(prompts)]
        for stream in streams:
            await until_buffered(stream, 5)  # nobody reads: both pause
        await asyncio.sleep(0.1)
        assert all(stream.buffered <= 8 for stream in streams), "an unread row kept going"
        got = await asyncio.gather(*(tokens_of(stream) for stream in streams))
        for prompt, tokens in zip(prompts, got, strict=True):
            assert tokens == reference.greedy_tokens(prompt, 60)
    finally:
        scheduler.stop()
