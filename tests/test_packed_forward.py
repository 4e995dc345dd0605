"""The packed forward (engines/batched/packed_forward.py): decoding rows and a prefill
chunk in one pass over the weights compute what two separate forwards compute."""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models import llama

from engines.batched.packed_forward import feed_together, supports_packing
from engines.cache.ragged_cache import RaggedKVCache, feed_rows
from engines.model.registry import GuardedModel

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "models"


def caches(model, rows: int) -> list[RaggedKVCache]:
    return [RaggedKVCache([0] * rows) for _ in model.model.layers]


def prepared(model, prompts: list[list[int]], prefix: list[int]):
    """A decoding batch holding `prompts`, and a one-row prefill group holding `prefix`."""
    batch, group = caches(model, len(prompts)), caches(model, 1)
    feed_rows(model, batch, prompts)
    feed_rows(model, group, [prefix])
    mx.eval([layer.keys for layer in batch + group])
    return batch, group


@pytest.mark.parametrize("folder", ["stories260K", "tinystories-280K-saltyduckegg"])
def test_packed_forward_equals_separate_forwards(folder: str) -> None:
    model, _ = load(str(SHARED / folder))
    assert supports_packing(model)
    rng = random.Random(3)
    vocab = model.args.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (37, 11, 60)]
    prompt = [rng.randrange(vocab) for _ in range(150)]
    next_tokens = [[rng.randrange(vocab)] for _ in prompts]
    alone_batch, alone_group = prepared(model, prompts, prompt[:40])
    packed_batch, packed_group = prepared(model, prompts, prompt[:40])

    expected = [
        feed_rows(model, alone_batch, next_tokens),
        feed_rows(model, alone_group, [prompt[40:97]]),
    ]
    got = feed_together(model, [(packed_batch, next_tokens), (packed_group, [prompt[40:97]])])
    mx.eval(expected, got)

    for want, have in zip(expected, got, strict=True):
        assert have.shape == want.shape
        assert mx.abs(have - want).max().item() < 1e-3, mx.abs(have - want).max().item()
        assert mx.array_equal(mx.argmax(have, -1), mx.argmax(want, -1)).item()
    assert packed_batch[0].held == alone_batch[0].held == [38, 12, 61]
    assert packed_group[0].held == alone_group[0].held == [97]
    for alone, packed in zip(alone_batch + alone_group, packed_batch + packed_group, strict=True):
        for a, b in zip(alone.state, packed.state, strict=True):
            assert mx.allclose(a, b, atol=1e-4).item()
    # and the next decode step from the packed caches continues exactly
    after = [feed_rows(model, c, [[5]] * len(c[0].held)) for c in (alone_batch, packed_batch)]
    assert mx.array_equal(mx.argmax(after[0], -1), mx.argmax(after[1], -1)).item()


def test_packing_is_offered_only_where_it_is_exact() -> None:
    model, _ = load(str(SHARED / "stories260K"))
    assert supports_packing(GuardedModel(None, model, "batched"))  # as an engine holds it
    args = dict(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=64,
    )
    assert supports_packing(llama.Model(llama.ModelArgs(**args)))
    sliding = llama.ModelArgs(
        **args, layer_types=["sliding_attention", "full_attention"], sliding_window=8
    )
    assert not supports_packing(llama.Model(sliding))
    assert not supports_packing(object())
