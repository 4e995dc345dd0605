"""The Gemma-4 assistant drafter against mlx-vlm's reference, on a tiny random target.

The target is mlx-lm's own gemma4_text (sliding and full layers, KV-shared layers,
per-layer inputs, proportional RoPE on the full layers); the assistant's random weights
are saved in the published key names and loaded by `load_gemma4_assistant`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_vlm.speculative.drafters.gemma4_assistant as vlm  # the reference (dev install)
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import gemma4_text

from engines.drafting.gemma4_assistant_model import (
    DrafterMismatch,
    Gemma4AssistantConfig,
    check_fits,
    is_gemma4_assistant_config,
    load_gemma4_assistant,
)
from engines.model.demo_vision import GEMMA4_ROPE

WINDOW = 8
ROPE = GEMMA4_ROPE
TARGET = {
    "model_type": "gemma4_text",
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_key_value_heads": 2,
    "num_kv_shared_layers": 2,
    "vocab_size": 256,
    "vocab_size_per_layer_input": 256,
    "hidden_size_per_layer_input": 8,
    "sliding_window": WINDOW,
    # non-shared layers 0..3: the last full one is 2, the last sliding one is 3
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "rope_parameters": ROPE,
    "final_logit_softcapping": 30.0,
}
SHARED = {"sliding_attention": 3, "full_attention": 2}


def assistant_config(head: str) -> dict:
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": 64,
        "use_ordered_embeddings": head == "masked",
        "num_centroids": 16,
        "centroid_intermediate_top_k": 4,
        "tie_word_embeddings": head != "untied",
        "block_size": 4,
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size": 32,
            "num_hidden_layers": 4,
            "intermediate_size": 48,
            "num_attention_heads": 4,
            "head_dim": 16,
            "global_head_dim": 32,
            "num_key_value_heads": 2,
            "num_kv_shared_layers": 0,
            "vocab_size": 256,
            "vocab_size_per_layer_input": 256,
            "hidden_size_per_layer_input": 0,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "rope_parameters": ROPE,
            "rms_norm_eps": 1e-6,
        },
    }


def jitter(model: nn.Module, scale: float) -> None:
    """Move every float weight off its initial value (norms off 1, scalars off 1)."""
    params = tree_map(
        lambda p: p + scale * mx.random.normal(p.shape) if p.dtype == mx.float32 else p,
        model.parameters(),
    )
    model.update(params)
    mx.eval(model.parameters())


@pytest.fixture(scope="module")
def target() -> gemma4_text.Model:
    mx.random.seed(0)
    model = gemma4_text.Model(gemma4_text.ModelArgs.from_dict(TARGET))
    jitter(model, 0.05)
    return model


def write_assistant(folder: Path, head: str) -> Path:
    """Random weights in the published key names (mlx-vlm's module tree), token_ordering
    as int64 and a tied lm_head copy as exports carry them."""
    config = assistant_config(head)
    reference = vlm.Gemma4AssistantDraftModel(vlm.ModelConfig.from_dict(config))
    jitter(reference, 0.1)
    weights = dict(tree_flatten(reference.parameters()))
    if head == "masked":
        weights["masked_embedding.token_ordering"] = mx.random.permutation(256).astype(mx.int64)
    if head != "untied":
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


def load_reference(folder: Path) -> nn.Module:
    config = json.loads((folder / "config.json").read_text())
    ref = vlm.Gemma4AssistantDraftModel(vlm.ModelConfig.from_dict(config))
    weights = ref.sanitize(mx.load(str(folder / "model.safetensors")))
    ref.load_weights(list(weights.items()), strict=True)
    mx.eval(ref.parameters())
    return ref


def run_target(target: gemma4_text.Model, tokens: list[int], decode: int | None = None):
    """Prefill (and optionally one decode step): (final-norm hidden at the newest
    position (1, 1, H), the cache)."""
    cache = target.make_cache()
    hidden = target.model(mx.array([tokens]), cache=cache)
    if decode is not None:
        hidden = target.model(mx.array([[decode]]), cache=cache)
    mx.eval(hidden)
    return hidden[:, -1:, :], cache


def reference_steps(ref, target, kv, length: int, tokens: list[int], hidden: mx.array):
    """mlx-vlm's drafter driven the way its MTP loop does: position = length - 1."""
    ref.bind(target)
    ref.set_shared_kv(kv, kv_offset=length, position=length - 1, kv_valid_len=length)
    out = []
    for token in tokens:
        embed = target.model.embed_tokens(mx.array([[token]])) * target.model.embed_scale
        x = mx.concatenate([embed, hidden], axis=-1)
        hidden, logits = ref(x, kv, mx.array([[length - 1]]))
        out.append((logits, hidden))
    return out


def close(a: mx.array, b: mx.array, atol: float = 1e-4) -> bool:
    return a.shape == b.shape and bool(mx.allclose(a, b, atol=atol, rtol=1e-4))


@pytest.mark.parametrize("head", ["masked", "tied", "untied"])
def test_parity_with_mlx_vlm(tmp_path: Path, target, head: str) -> None:
    folder = write_assistant(tmp_path / head, head)
    mine = load_gemma4_assistant(folder, mx.float32).bind(target)
    ref = load_reference(folder)
    assert mine.shared_layers(target) == SHARED

    # 6 prompt tokens then a decode step: the rotating cache's buffer is 8 slots, 7 valid
    hidden, cache = run_target(target, [5, 17, 99, 3, 42, 250], decode=77)
    length = 7
    kv = mine.kv_from_cache(cache)
    assert {k: v[0].shape[2] for k, v in kv.items()} == {
        "full_attention": 7,
        "sliding_attention": 7,
    }
    before = {i: (mx.array(c.keys), c.offset) for i, c in enumerate(cache)}

    logits1, state1 = mine.step(mx.array([[77]]), hidden, kv, length - 1, length)
    chained = int(mx.argmax(logits1[0, -1]).item())
    logits2, state2 = mine.step(mx.array([[chained]]), state1, kv, length - 1, length)
    assert logits1.shape == (1, 1, 256) and state1.shape == (1, 1, 64)

    ref_kv = {
        kind: (cache[i].keys[..., :length, :], cache[i].values[..., :length, :])
        for kind, i in SHARED.items()
    }
    (ref_logits1, ref_state1), (ref_logits2, ref_state2) = reference_steps(
        ref, target, ref_kv, length, [77, chained], hidden
    )
    assert close(logits1, ref_logits1) and close(state1, ref_state1)
    assert close(logits2, ref_logits2) and close(state2, ref_state2)
    assert not close(logits1, logits2)  # the chained step really is a different input

    for i, c in enumerate(cache):  # read only: nothing written, nothing grown
        assert c.offset == before[i][1] and mx.array_equal(c.keys, before[i][0])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_assistant(tmp_path_factory.mktemp("assistant") / "masked", "masked")


@pytest.fixture(scope="module")
def masked(folder: Path, target):
    return load_gemma4_assistant(folder, mx.float32).bind(target)


def test_padded_rows_do_not_leak(masked, target) -> None:
    """Two sequences (7 and 4 positions) in one padded batch, garbage in the padding:
    each row equals the sequence drafted alone, through lengths or explicit masks."""
    hidden_a, cache_a = run_target(target, [5, 17, 99, 3, 42, 250], decode=77)
    hidden_b, cache_b = run_target(target, [9, 8, 7, 6])
    kv_a, kv_b = masked.kv_from_cache(cache_a), masked.kv_from_cache(cache_b)
    alone_a = masked.step(mx.array([[1]]), hidden_a, kv_a, 6, 7)
    alone_b = masked.step(mx.array([[2]]), hidden_b, kv_b, 3, 4)

    def pad(x: mx.array) -> mx.array:
        junk = 3.0 * mx.random.normal((*x.shape[:2], 7 - x.shape[2], x.shape[3]))
        return mx.concatenate([x, junk], axis=2)

    kv = {
        kind: tuple(
            mx.concatenate([a, pad(b)], axis=0) for a, b in zip(kv_a[kind], kv_b[kind], strict=True)
        )
        for kind in kv_a
    }
    tokens, hidden = mx.array([[1], [2]]), mx.concatenate([hidden_a, hidden_b], axis=0)
    lengths = mx.array([7, 4])
    by_lengths = masked.step(tokens, hidden, kv, mx.array([6, 3]), lengths)
    keep = mx.arange(7)[None, :] < lengths[:, None]
    by_masks = masked.step(tokens, hidden, kv, mx.array([6, 3]), masks=dict.fromkeys(kv, keep))
    for batched in (by_lengths, by_masks):
        for got, want_a, want_b in zip(batched, alone_a, alone_b, strict=True):
            assert close(got[:1], want_a) and close(got[1:], want_b)

    leaky = masked.step(tokens, hidden, kv, mx.array([6, 3]))  # every slot readable
    assert close(leaky[0][:1], alone_a[0]) and not close(leaky[0][1:], alone_b[0])


def test_sliding_window_reads_newest_window(masked, folder: Path, target) -> None:
    """A 12-token prefill leaves 12 temporally ordered sliding keys: a query at position
    11 reads only the newest 8 (as mlx-vlm does here), the same as a rotating buffer
    holding just those."""
    hidden, cache = run_target(target, list(range(30, 42)))
    kv = masked.kv_from_cache(cache)
    assert kv["sliding_attention"][0].shape[2] == 12
    long = masked.step(mx.array([[3]]), hidden, kv, 11, 12)
    [(ref_logits, ref_state)] = reference_steps(load_reference(folder), target, kv, 12, [3], hidden)
    assert close(long[0], ref_logits) and close(long[1], ref_state)
    newest = dict(kv, sliding_attention=tuple(x[..., -WINDOW:, :] for x in kv["sliding_attention"]))
    short = masked.step(mx.array([[3]]), hidden, newest, 11, 12)
    assert close(long[0], short[0]) and close(long[1], short[1])
    per_row = masked.step(mx.array([[3]]), hidden, kv, mx.array([11]), mx.array([12]))
    assert close(per_row[0], short[0]) and close(per_row[1], short[1])
    everything = {"sliding_attention": mx.ones((1, 12), dtype=mx.bool_)}
    unwindowed = masked.step(mx.array([[3]]), hidden, kv, 11, 12, masks=everything)
    assert not close(long[0], unwindowed[0])


def test_wrapped_rotating_buffer_reads_every_slot(masked, folder: Path, target) -> None:
    """9 positions in an 8-slot rotating buffer that has wrapped: all 8 keys are within the
    window of the query at position 8. mlx-vlm masks slot 0 here (the one known difference,
    see the module docstring): it equals this drafter with slot 0 masked explicitly."""
    hidden, cache = run_target(target, list(range(50, 58)), decode=9)
    kv = masked.kv_from_cache(cache)
    assert kv["sliding_attention"][0].shape[2] == WINDOW and cache[3].offset == 9
    [(ref_logits, _)] = reference_steps(load_reference(folder), target, kv, 9, [3], hidden)
    mine = masked.step(mx.array([[3]]), hidden, kv, 8, 9)[0]
    without_slot0 = {"sliding_attention": mx.arange(WINDOW)[None, :] > 0}
    as_vlm = masked.step(mx.array([[3]]), hidden, kv, 8, 9, masks=without_slot0)[0]
    assert close(as_vlm, ref_logits) and not close(mine, ref_logits)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("hidden_size", 48, "hidden_size"),
        ("vocab_size", 300, "vocab_size"),
        ("global_head_dim", 64, "global_head_dim"),
        ("head_dim", 8, "head_dim"),
        ("num_key_value_heads", 3, "kv heads"),
        ("rope_parameters", {**ROPE, "full_attention": {"rope_type": "default"}}, "rope"),
        ("layer_types", ["full_attention"] * 6, "layer_types"),
    ],
)
def test_mismatch_names_the_field(field: str, value, named: str) -> None:
    config = Gemma4AssistantConfig.from_config(assistant_config("masked"))
    check_fits(config, TARGET)
    check_fits(assistant_config("masked"), {"model_type": "gemma4", "text_config": TARGET})
    with pytest.raises(DrafterMismatch, match=named):
        check_fits(config, {**TARGET, field: value})


def test_bind_refuses_a_target_it_cannot_read(masked) -> None:
    wrong = gemma4_text.Model(gemma4_text.ModelArgs.from_dict({**TARGET, "hidden_size": 48}))
    with pytest.raises(DrafterMismatch, match="hidden_size"):
        copy.copy(masked).bind(wrong)


def test_loading_is_strict(tmp_path: Path) -> None:
    folder = write_assistant(tmp_path / "a", "tied")
    weights = mx.load(str(folder / "model.safetensors"))
    del weights["model.layers.2.self_attn.q_norm.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(ValueError, match="q_norm"):
        load_gemma4_assistant(folder, mx.float32)
    assert is_gemma4_assistant_config(assistant_config("tied"))
    assert not is_gemma4_assistant_config(TARGET)
