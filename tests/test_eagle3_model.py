"""The EAGLE-3 drafter: both published checkpoint formats load, its logits match
mlx-vlm's reference drafter on the same weights (a first step over context pairs,
then a chained step fed its own output state), a ragged batch gives each row what it
gets alone, draft ids map onto the target vocabulary, and what does not fit raises
`DrafterMismatch` naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engines.drafting.eagle3_model import (
    DrafterMismatch,
    Eagle3Config,
    check_fits,
    is_eagle3_config,
    load_eagle3,
)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 128
VOCAB, DRAFT_VOCAB, TARGET_LAYERS = 300, 100, 8
AUX = [1, 4, 6]

LAYER = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": INTER,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "num_hidden_layers": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "vocab_size": VOCAB,
    "attention_bias": False,
}
SPECULATORS = {
    "architectures": ["Eagle3Speculator"],
    "speculators_model_type": "eagle3",
    "transformer_layer_config": LAYER,
    "draft_vocab_size": DRAFT_VOCAB,
    "target_hidden_size": HIDDEN,
    "norm_before_residual": False,
    "eagle_aux_hidden_state_layer_ids": AUX,
}
SPECFORGE = {
    **LAYER,
    "architectures": ["LlamaForCausalLMEagle3"],
    "draft_vocab_size": DRAFT_VOCAB,
    "target_hidden_size": HIDDEN,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True},
}


def random_weights(seed: int = 0) -> dict[str, mx.array]:
    """Speculators' key names; d2t maps the draft ids onto a sorted subset of the vocab."""
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.1) -> mx.array:
        return mx.array(rng.normal(0.0, scale, shape).astype(np.float32))

    def norm() -> mx.array:
        return mx.array((1.0 + rng.normal(0.0, 0.1, HIDDEN)).astype(np.float32))

    kept = np.sort(rng.choice(VOCAB, DRAFT_VOCAB, replace=False))
    p = "layers.0."
    return {
        "embed_tokens.weight": w(VOCAB, HIDDEN, scale=1.0),
        "fc.weight": w(HIDDEN, 3 * HIDDEN),
        p + "input_layernorm.weight": norm(),
        p + "hidden_norm.weight": norm(),
        p + "post_attention_layernorm.weight": norm(),
        p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, 2 * HIDDEN),
        p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * HEAD_DIM),
        p + "mlp.gate_proj.weight": w(INTER, HIDDEN),
        p + "mlp.up_proj.weight": w(INTER, HIDDEN),
        p + "mlp.down_proj.weight": w(HIDDEN, INTER),
        "norm.weight": norm(),
        "lm_head.weight": w(DRAFT_VOCAB, HIDDEN, scale=0.5),
        "d2t": mx.array((kept - np.arange(DRAFT_VOCAB)).astype(np.int64)),
        "t2d": mx.array(np.isin(np.arange(VOCAB), kept)),
    }


def save(folder: Path, config: dict, weights: dict[str, mx.array]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


def specforge_names(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """SpecForge's key names, without an embedding (the drafter then uses the target's)."""
    return {
        k.replace("layers.0.", "midlayer."): v
        for k, v in weights.items()
        if k != "embed_tokens.weight"
    }


def reference(weights: dict[str, mx.array]):
    """mlx-vlm's drafter on the same weights (its own key names, speculators')."""
    from mlx_vlm.speculative.drafters.eagle3 import Eagle3DraftModel, ModelConfig

    model = Eagle3DraftModel(ModelConfig.from_dict(SPECULATORS))
    model.load_weights(list(model.sanitize(dict(weights)).items()), strict=True)
    mx.eval(model.parameters())
    return model


def context(seed: int, n: int) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    tokens = mx.array(rng.integers(0, VOCAB, (1, n)).astype(np.int32))
    features = mx.array(rng.normal(0.0, 1.0, (1, n, 3 * HIDDEN)).astype(np.float32))
    return tokens, features


def run_ours(model, tokens: mx.array, features: mx.array):
    """A first step over the context pairs, then one chained step from the last one."""
    cache = model.make_cache()
    first, state = model.step(tokens, model.fuse(features), cache)
    drafted = model.target_ids(mx.argmax(first[:, -1:], axis=-1))
    chained, _ = model.step(drafted, state[:, -1:], cache)
    return first, drafted, chained


def run_reference(ref, tokens: mx.array, features: mx.array, drafted: mx.array):
    """As mlx-vlm's round loop does: `prefill_from_target_hidden`'s forward over the
    shifted pairs, then `draft_block`'s chained forward from the last output state."""
    ref.reset(object())
    ref._next_position = 1
    state = ref._forward_tokens(tokens, features, mx.int32)
    first = ref._logits(state)
    chained = ref._logits(ref._forward_tokens(drafted, state[:, -1:], mx.int32))
    return first, chained


@pytest.mark.parametrize("fmt", ["speculators", "specforge"])
def test_matches_mlx_vlm_reference(tmp_path, fmt):
    weights = random_weights(1)
    if fmt == "speculators":
        folder = save(tmp_path / fmt, SPECULATORS, weights)
    else:
        folder = save(tmp_path / fmt, SPECFORGE, specforge_names(weights))
    model = load_eagle3(folder, TARGET_LAYERS, mx.float32)
    assert model.config.aux_layer_ids == tuple(AUX)
    if fmt == "specforge":
        assert "embed_tokens" not in model
        with pytest.raises(RuntimeError):
            model.embed(mx.array([[1]]))
        from mlx.nn import Embedding

        target_embed = Embedding(VOCAB, HIDDEN)
        target_embed.weight = weights["embed_tokens.weight"]
        model.bind(target_embed)
    assert model.d2t.dtype == mx.int32 and model.fc.weight.dtype == mx.float32

    tokens, features = context(2, 7)
    first, drafted, chained = run_ours(model, tokens, features)
    ref_first, ref_chained = run_reference(reference(weights), tokens, features, drafted)
    assert first.shape == (1, 7, DRAFT_VOCAB) and chained.shape == (1, 1, DRAFT_VOCAB)
    np.testing.assert_allclose(np.array(first), np.array(ref_first), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(chained), np.array(ref_chained), atol=1e-4, rtol=1e-4)
    # the chained step fed the state, not noise: a different state changes its logits
    assert float(mx.max(mx.abs(first[:, -1] - chained[:, 0]))) > 1e-3


def test_loads_in_another_dtype(tmp_path):
    model = load_eagle3(save(tmp_path / "m", SPECULATORS, random_weights()), 8, mx.bfloat16)
    assert model.lm_head.weight.dtype == mx.bfloat16 and model.d2t.dtype == mx.int32
    tokens, features = context(3, 4)
    logits, state = model.step(tokens, model.fuse(features.astype(mx.bfloat16)), model.make_cache())
    assert logits.dtype == mx.bfloat16 and state.shape == (1, 4, HIDDEN)


def test_aux_ids_default_to_the_targets_layers():
    for config in (
        {**SPECULATORS, "eagle_aux_hidden_state_layer_ids": None},
        {**SPECFORGE, "eagle_config": {"eagle_aux_hidden_state_layer_ids": None}},
    ):
        assert Eagle3Config.from_config(config, target_layers=24).aux_layer_ids == (2, 12, 21)
    assert Eagle3Config.from_config(SPECFORGE, 24).aux_layer_ids == tuple(AUX)
    assert is_eagle3_config(SPECULATORS) and is_eagle3_config(SPECFORGE)
    assert not is_eagle3_config(LAYER)


def test_ragged_batch_rows_match_each_row_alone(tmp_path):
    model = load_eagle3(save(tmp_path / "m", SPECULATORS, random_weights(4)), 8, mx.float32)
    lengths = [6, 3]
    rows = [context(10 + i, n) for i, n in enumerate(lengths)]
    alone = [run_ours(model, tokens, features) for tokens, features in rows]

    width = max(lengths)
    tokens = mx.concatenate([mx.pad(t, [(0, 0), (0, width - t.shape[1])]) for t, _ in rows], axis=0)
    features = mx.concatenate(
        [mx.pad(f, [(0, 0), (0, width - f.shape[1]), (0, 0)]) for _, f in rows], axis=0
    )
    cache = model.make_cache(rows=2)
    first, state = model.step(tokens, model.fuse(features), cache)
    cache[0].set_lengths(lengths)  # cut the padding
    last = mx.array([n - 1 for n in lengths])
    drafted = mx.concatenate([a[1] for a in alone], axis=0)
    chained, _ = model.step(drafted, state[mx.arange(2), last][:, None], cache)
    assert cache[0].lengths == [n + 1 for n in lengths]
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(np.array(first[i, :n]), np.array(alone[i][0][0]), atol=1e-5)
        np.testing.assert_allclose(np.array(chained[i]), np.array(alone[i][2][0]), atol=1e-5)


def test_draft_ids_map_onto_the_target_vocabulary(tmp_path):
    weights = random_weights(5)
    model = load_eagle3(save(tmp_path / "m", SPECULATORS, weights), 8, mx.float32)
    kept = np.array(mx.arange(DRAFT_VOCAB) + weights["d2t"].astype(mx.int32))
    assert np.array_equal(np.array(model.target_ids(mx.arange(DRAFT_VOCAB))), kept)
    assert np.all(np.diff(kept) > 0) and kept[-1] < VOCAB

    logits = mx.array(np.random.default_rng(6).normal(0, 3, (2, 3, DRAFT_VOCAB)), mx.float32)
    logp = model.target_logprobs(logits, VOCAB)
    assert logp.shape == (2, 3, VOCAB) and logp.dtype == mx.float32
    values = np.array(logp)
    np.testing.assert_allclose(np.exp(values[..., kept]).sum(-1), 1.0, atol=1e-5)
    expected = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    np.testing.assert_allclose(values[..., kept], expected, atol=1e-5)
    others = np.setdiff1d(np.arange(VOCAB), kept)
    assert np.all(np.isneginf(values[..., others]))


def test_a_drafter_that_does_not_fit_raises(tmp_path):
    config = Eagle3Config.from_config(SPECULATORS, TARGET_LAYERS)
    check_fits(config, HIDDEN, TARGET_LAYERS, VOCAB)  # fits
    with pytest.raises(DrafterMismatch, match="target_hidden_size"):
        check_fits(config, 2 * HIDDEN, TARGET_LAYERS, VOCAB)
    with pytest.raises(DrafterMismatch, match="eagle_aux_hidden_state_layer_ids"):
        check_fits(config, HIDDEN, 5, VOCAB)
    with pytest.raises(DrafterMismatch, match="vocab_size"):
        check_fits(config, HIDDEN, TARGET_LAYERS, VOCAB - 1)

    weights = random_weights()
    model = load_eagle3(save(tmp_path / "ok", SPECULATORS, weights), TARGET_LAYERS, mx.float32)
    model.check_fits(HIDDEN, TARGET_LAYERS, VOCAB)
    model.d2t = mx.concatenate([model.d2t[:-1], mx.array([VOCAB], dtype=mx.int32)])
    with pytest.raises(DrafterMismatch, match="d2t"):
        model.check_fits(HIDDEN, TARGET_LAYERS, VOCAB)

    misshapen = {**weights, "fc.weight": mx.zeros((HIDDEN, 2 * HIDDEN))}
    with pytest.raises(DrafterMismatch, match="fc.weight"):
        load_eagle3(save(tmp_path / "shape", SPECULATORS, misshapen), TARGET_LAYERS, mx.float32)
    missing = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    with pytest.raises(DrafterMismatch, match="lm_head"):
        load_eagle3(save(tmp_path / "missing", SPECULATORS, missing), TARGET_LAYERS, mx.float32)
    bare = specforge_names(weights)
    small = load_eagle3(save(tmp_path / "bare", SPECFORGE, bare), TARGET_LAYERS, mx.float32)
    with pytest.raises(DrafterMismatch, match="hidden_size"):
        small.bind(lambda tokens: mx.zeros((*tokens.shape, 2 * HIDDEN)))
