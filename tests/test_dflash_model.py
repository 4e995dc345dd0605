"""The DFlash drafter module on tiny random weights saved in the published format:
parity with mlx-vlm's reference drafter, ragged rows equal to rows alone, strict loading
and target fit checks."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest

from bench.drafter_checkpoints import dflash_weights
from engines.cache.ragged_cache import RaggedKVCache
from engines.drafting.dflash_model import (
    DFlashConfig,
    DFlashDraftModel,
    DrafterMismatch,
    check_fits,
    is_dflash_config,
    load_dflash,
    tap_layers,
)

HIDDEN, VOCAB, MASK, BLOCK = 64, 300, 299, 4
TAPS = 2
CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": HIDDEN,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 512,
    "block_size": BLOCK,
    "num_target_layers": 3,
    "tie_word_embeddings": True,
    "dflash_config": {"mask_token_id": MASK, "target_layer_ids": [0, 2]},
}


published_weights = dflash_weights  # random, in the published key names


def save_drafter(folder: Path, config: dict, weights: dict[str, mx.array]) -> Path:
    """Two shards, one with the `model.` prefix and a stray embedding copy (ignored)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    keys = sorted(weights)
    half = len(keys) // 2
    first = {k: weights[k] for k in keys[:half]}
    second = {"model." + k: weights[k] for k in keys[half:]}
    second["model.embed_tokens.weight"] = mx.zeros((VOCAB, HIDDEN))
    mx.save_safetensors(str(folder / "model-00001-of-00002.safetensors"), first)
    mx.save_safetensors(str(folder / "model-00002-of-00002.safetensors"), second)
    return folder


@pytest.fixture(scope="module")
def target() -> SimpleNamespace:
    mx.random.seed(7)
    embed, head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)
    mx.eval(embed.parameters(), head.parameters())
    return SimpleNamespace(embed_tokens=embed, lm_head=head)


@pytest.fixture(scope="module")
def weights() -> dict[str, mx.array]:
    return published_weights(CONFIG)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, weights, target) -> DFlashDraftModel:
    folder = save_drafter(tmp_path_factory.mktemp("dflash"), CONFIG, weights)
    return load_dflash(folder, mx.float32).bind(target.embed_tokens, target.lm_head)


def block(*bonus: int) -> mx.array:
    return mx.array([[b] + [MASK] * (BLOCK - 1) for b in bonus])


def features(rows: int, count: int, seed: int) -> mx.array:
    return mx.random.normal((rows, count, TAPS * HIDDEN), key=mx.random.key(seed))


def close(a: mx.array, b: mx.array, atol: float = 1e-4) -> bool:
    return a.shape == b.shape and mx.allclose(a, b, atol=atol, rtol=1e-4).item()


def test_config_reading() -> None:
    config = DFlashConfig.from_config(CONFIG)
    assert is_dflash_config(CONFIG) and not is_dflash_config({"architectures": ["Qwen3"]})
    assert tap_layers(config) == tap_layers(CONFIG) == (0, 2)
    assert (config.mask_token_id, config.block_size, config.num_target_layers) == (MASK, 4, 3)
    # Newer revisions: block_size inside dflash_config, theta inside rope_parameters.
    newer = {k: v for k, v in CONFIG.items() if k not in ("rope_theta", "block_size")}
    newer["rope_parameters"] = {"rope_theta": 1e6, "rope_type": "default"}
    newer["dflash_config"] = {**CONFIG["dflash_config"], "block_size": 8}
    read = DFlashConfig.from_config(newer)
    assert (read.rope_theta, read.rope_scaling, read.block_size) == (1e6, None, 8)
    dflash2 = {**CONFIG, "dflash_config": {**CONFIG["dflash_config"], "conv_kernel_size": 2}}
    with pytest.raises(DrafterMismatch, match="conv_kernel_size"):
        DFlashConfig.from_config(dflash2)
    with pytest.raises(DrafterMismatch, match="layer_types"):
        DFlashConfig.from_config({**CONFIG, "layer_types": ["sliding_attention"] * 2})


def test_loads_published_names_and_casts(tmp_path, weights) -> None:
    model = load_dflash(save_drafter(tmp_path, CONFIG, weights), mx.bfloat16)
    assert model.fc.weight.dtype == mx.bfloat16
    assert mx.array_equal(
        model.layers[1].mlp.up_proj.weight,
        weights["layers.1.mlp.up_proj.weight"].astype(mx.bfloat16),
    ).item()


def reference_model(weights: dict[str, mx.array], target: SimpleNamespace):
    from mlx_vlm.speculative.drafters.qwen3_dflash import Model, ModelConfig

    ref = Model(ModelConfig.from_dict(CONFIG))
    ref.load_weights(list(ref.sanitize(dict(weights)).items()), strict=True)
    return ref.bind(target)


def test_matches_mlx_vlm_across_blocks(drafter, weights, target) -> None:
    ref = reference_model(weights, target)
    ref_cache, cache = ref.make_cache(), drafter.make_cache()
    for step, (count, bonus) in enumerate([(5, 11), (3, 42), (1, 7)]):
        context = features(1, count, seed=step)
        ours = drafter.draft_logits(context, [count], block(bonus), cache)
        theirs = ref(block(bonus), context, ref_cache)[:, 1:]
        assert ours.shape == (1, BLOCK - 1, VOCAB)
        assert close(ours, theirs), f"block {step}"
        assert cache[0].lengths == [ref_cache[0].offset]


def test_no_new_context_sees_only_cached_context(drafter) -> None:
    """S == 0 drafts from the cache alone: the same logits as feeding that context in
    the same call, so no block K/V of an earlier call lingers in the cache."""
    context = features(1, 6, seed=3)
    together = drafter.draft_logits(context, [6], block(9), drafter.make_cache())
    cache = drafter.make_cache()
    drafter.draft_logits(context, [6], block(123), cache)
    alone = drafter.draft_logits(features(1, 0, seed=0), [0], block(9), cache)
    assert close(alone, together)
    assert [c.lengths for c in cache] == [[6], [6]]


def test_ragged_rows_match_each_row_alone(drafter) -> None:
    solo = [drafter.make_cache(), drafter.make_cache()]
    drafter.draft_logits(features(1, 5, seed=10), [5], block(1), solo[0])
    drafter.draft_logits(features(1, 2, seed=11), [2], block(2), solo[1])
    batch = [RaggedKVCache.from_caches([a, b]) for a, b in zip(*solo, strict=True)]
    assert batch[0].lengths == [5, 2]
    for step, counts in enumerate([[3, 1], [0, 2], [4, 4]]):
        width = max(counts)
        padded = 50 * features(2, width, seed=20 + step)  # padding: large, never seen
        rows = [padded[i : i + 1, : counts[i]] for i in range(2)]
        bonus = (30 + step, 60 + step)
        old = list(batch[0].lengths)
        together = drafter.draft_logits(padded, counts, block(*bonus), batch)
        for i in range(2):
            alone = drafter.draft_logits(rows[i], [counts[i]], block(bonus[i]), solo[i])
            assert close(together[i : i + 1], alone), f"step {step} row {i}"
        expected = [length + n for length, n in zip(old, counts, strict=True)]
        assert all(c.lengths == expected for c in batch)
        assert [solo[0][0].lengths[0], solo[1][0].lengths[0]] == expected


def test_load_refuses_weights_that_do_not_fit(tmp_path, weights) -> None:
    wrong = dict(weights, **{"fc.weight": mx.zeros((HIDDEN, 3 * HIDDEN))})
    with pytest.raises(DrafterMismatch, match="fc.weight"):
        load_dflash(save_drafter(tmp_path / "shape", CONFIG, wrong), mx.float32)
    missing = {k: v for k, v in weights.items() if k != "layers.1.self_attn.k_norm.weight"}
    with pytest.raises(DrafterMismatch, match="k_norm"):
        load_dflash(save_drafter(tmp_path / "missing", CONFIG, missing), mx.float32)


def test_check_fits_names_the_field() -> None:
    config = DFlashConfig.from_config(CONFIG)
    check_fits(config, HIDDEN, 3, VOCAB)
    with pytest.raises(DrafterMismatch, match="hidden_size"):
        check_fits(config, 2 * HIDDEN, 3, VOCAB)
    with pytest.raises(DrafterMismatch, match="target_layer_id 2"):
        check_fits(
            DFlashConfig.from_config({**CONFIG, "num_target_layers": None}), HIDDEN, 2, VOCAB
        )
    with pytest.raises(DrafterMismatch, match="mask_token_id"):
        check_fits(config, HIDDEN, 3, MASK)
