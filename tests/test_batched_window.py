"""Speculation inside the batch for sliding-window models (gpt-oss, Gemma 3, and a Llama
whose `layer_types` mix full and sliding attention): mlx-lm keeps their sliding
layers in a `RotatingKVCache`, which cannot trim once it wraps. In the batch a row
keeps its window in temporal order (`RaggedKVCache` with a `window`), masked to the
window and slid left as it fills, so each row rolls back alone by a change of length.
Every row's output equals its solo plain decoding with mlx-lm, across many slides of a
16-position window; rows move in and out of the batch both ways, as the same kind of
one-row windowed caches on the single-stream side (`trimmable_windows`), which roll
back by a trim too: no replay."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from engines.cache.ragged_cache import SLIDE_SLACK, RaggedKVCache, feed_rows, ragged_from_rows
from engines.cache.rollback import (
    RollbackError,
    supports_batched_rows,
    supports_rollback,
    take_snapshot,
    trim_exact,
)
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
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
from tests.tiny_archs import SLIDING_WINDOW, build_tiny_arch

ARCHS = ("sliding", "gpt_oss", "gemma3")


@pytest.fixture(scope="module", params=ARCHS)
def windowed(request, tmp_path_factory, tiny_model_dir, perturbed_draft_dir):
    """(kind, checkpoint, mlx-lm reference, (single-stream, batched) engines whose draft
    is a plain-KV Llama sharing the tokenizer)."""
    kind = request.param
    path = build_tiny_arch(kind, tmp_path_factory.mktemp("window") / kind, tiny_model_dir)
    reference = Reference(*load(str(path)))
    return kind, path, reference, make_engines(path, perturbed_draft_dir)


def windows_of(cache: list) -> list[int | None]:
    return [getattr(layer, "window", None) for layer in cache]


# ---- the windowed ragged cache --------------------------------------------------------


def test_windowed_rows_slide_roll_back_and_hand_back_caches_that_continue_exactly(windowed):
    """Three rows of different lengths feed ragged chunks far past the window (several
    slides), rolling back different amounts after each: every row's logits equal its
    single-sequence forward on mlx-lm's own caches, and a row taken out continues
    exactly as it would have on mlx-lm's own caches."""
    _, _, reference, _ = windowed
    model = reference.model
    assert supports_batched_rows(model)
    cache = ragged_from_rows([make_prompt_cache(model) for _ in range(3)])
    assert SLIDING_WINDOW in windows_of(cache) and None in windows_of(cache)
    solo = [make_prompt_cache(model) for _ in range(3)]
    key = mx.random.key(3)
    slid = False
    for step in range(40):
        key, sub = mx.random.split(key)
        counts = [(step + i) % 5 + 1 for i in range(3)]
        tokens = mx.random.randint(1, 200, (3, 5), key=sub).tolist()
        fed = [row[:n] for row, n in zip(tokens, counts, strict=True)]
        logits = feed_rows(model, cache, fed)
        keep = [max(1, n - (step + i) % 3) for i, n in enumerate(counts)]
        for i in range(3):
            expected = model(mx.array(fed[i][: keep[i]])[None], cache=solo[i])[0]
            assert mx.allclose(logits[i, : keep[i]], expected, atol=1e-4).item(), (step, i)
        lengths = [held - n + k for held, n, k in zip(cache[0].held, counts, keep, strict=True)]
        for layer in cache:
            layer.set_lengths(lengths)
        slid = slid or any(start for layer in cache for start in layer.starts)
    assert slid, "rows slid past their window"
    windows = [layer for layer in cache if layer.window]
    assert all(max(layer.columns) <= 3 * SLIDING_WINDOW for layer in windows), "they stay small"
    for i in range(3):
        taken = [layer.extract(i) for layer in cache]
        assert {type(c) for c in taken} == {KVCache, RaggedKVCache}
        nxt = mx.array([[7, 8, 9]])
        got = model(nxt, cache=taken)[0]
        want = model(nxt, cache=solo[i])[0]
        assert mx.allclose(got, want, atol=1e-4).item(), i


def test_a_slid_row_refuses_to_roll_back_past_its_window():
    cache = RaggedKVCache([0], window=4)
    keys = mx.zeros((1, 1, 9, 2))
    for _ in range(3):  # slides once 9 + 9 positions hold more than window + slack
        cache.update_and_fetch(keys, keys)
    assert cache.starts == [18 - 4 - SLIDE_SLACK] and cache.offset == 27
    assert cache.trimmable(27 - 10) and not cache.trimmable(27 - 9)
    assert not cache.is_trimmable(), "mlx-lm's amount-free question gets a safe no"
    cache.set_lengths([10])  # the window before the position it next writes: kept
    with pytest.raises(ValueError, match="cannot become 9"):
        cache.set_lengths([9])
    assert cache.trim(5) == 0, "a trim never cuts into the window"
    with pytest.raises(RollbackError):
        trim_exact([cache], 1)


def test_tandem_serves_sliding_windows_with_caches_that_trim(windowed):
    """Loaded by Tandem, the sliding layers get windowed caches that roll back by a
    trim, alone as in the batch: no snapshot to restore, no replay."""
    _, path, reference, (spec, _) = windowed
    model = spec.registry.target.model
    kinds = {type(layer) for layer in make_prompt_cache(model)}
    assert kinds == {KVCache, RaggedKVCache} and supports_rollback(model)
    cache = make_prompt_cache(model)
    prompt = reference.tokenizer.encode(PROMPTS[1] * 3)  # past the window
    mx.eval(model(mx.array(prompt)[None], cache=cache))
    assert take_snapshot(cache) is None
    trim_exact(cache, 5)
    assert all(layer.offset == len(prompt) - 5 for layer in cache)
    solo = make_prompt_cache(reference.model)
    mx.eval(reference.model(mx.array(prompt[:-5])[None], cache=solo))
    step = mx.array([prompt[-5:]])
    assert mx.allclose(model(step, cache=cache), reference.model(step, cache=solo), atol=1e-4)


# ---- the batched speculative engine ----------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 5])
def test_windowed_rows_drafting_in_a_batch_each_equal_solo_plain_decoding(windowed, n):
    _, _, reference, (_, engine) = windowed
    requests, expected = mixed_requests(reference, n)
    seqs, outputs, drafted = run_batch(engine, requests)
    assert_rows_equal(seqs, outputs, expected)
    assert drafted > 0, "rows drafted while batched"
    rejected = sum(seq.spec.draft_tokens - seq.spec.accepted_tokens for seq in seqs.values())
    assert rejected > 0, "rows rolled back (accepted runs: the 240-token test below)"


@pytest.mark.slow
def test_long_windowed_rows_stay_exact_over_many_slides(windowed):
    """240 tokens per row (15 windows), PLD on output that loops beside a row drafting
    with the draft model (a different random model: mostly rejected)."""
    _, _, reference, (_, engine) = windowed
    tokenizer = reference.tokenizer
    bias = repetitive_bias(tokenizer)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:2]]
    looping = SamplingParams(temperature=0.0, logit_bias=bias)
    requests = [
        GenerationRequest(
            "pld",
            tuple(prompts[0]),
            240,
            looping,
            ignore_eos=True,
            speculation=SpeculationOverrides(enable_draft=False),
        ),
        greedy_request(
            "draft", prompts[1], 240, speculation=SpeculationOverrides(enable_pld=False)
        ),
    ]
    seqs, outputs, drafted = run_batch(engine, requests)
    processors = make_logits_processors(logit_bias=dict(bias))
    expected = {
        "pld": reference.greedy_tokens(prompts[0], 240, logits_processors=processors),
        "draft": reference.greedy_tokens(prompts[1], 240),
    }
    assert_rows_equal(seqs, outputs, expected)
    assert seqs["pld"].spec.accepted_tokens > 0, "prompt lookup kept runs of drafts"
    assert seqs["draft"].spec.draft_tokens > 0, "the (unrelated) draft model drafted too"


def test_windowed_rows_joining_and_cancelled_while_others_speculate_stay_exact(windowed):
    _, _, reference, (_, engine) = windowed
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:4]]
    first = [greedy_request("a", prompts[0], 70), greedy_request("b", prompts[1], 70)]
    joining = {4: [greedy_request("c", prompts[2], 40)], 9: [greedy_request("d", prompts[3], 30)]}
    seqs, _, drafted = run_batch(engine, first, join_after=joining, cancel_at={6: ["b"]})
    assert seqs["a"].generated == reference.greedy_tokens(prompts[0], 70)
    assert seqs["c"].generated == reference.greedy_tokens(prompts[2], 40)
    assert seqs["d"].generated == reference.greedy_tokens(prompts[3], 30)
    assert seqs["b"].finish_reason == FinishReason.CANCELLED
    assert drafted > 0 and engine.batch_size == 0


def test_a_windowed_request_moves_into_the_batch_and_back_out_exactly(windowed):
    """Single-stream (a one-row windowed cache) -> batch -> single-stream, past the
    window on both sides."""
    _, _, reference, (spec, engine) = windowed
    round_trip_through_the_batch(spec, engine, reference)


def test_seeded_windowed_rows_give_their_solo_seeded_tokens_in_a_batch(windowed):
    _, _, reference, (spec, engine) = windowed
    assert_seeded_rows_match_solo(spec, engine, reference)


async def test_served_windowed_model_batches_with_drafting_and_returns_to_single_stream(
    windowed, perturbed_draft_dir
):
    _, path, reference, _ = windowed
    scheduler = start_scheduler(path, draft_model=str(perturbed_draft_dir))
    try:
        await assert_served_batch_is_exact_and_returns(scheduler, reference)
    finally:
        scheduler.stop()
