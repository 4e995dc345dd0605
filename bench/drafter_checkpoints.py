"""Drafter checkpoints as people download them, at toy sizes: the published config
fields and weight key names, random weights, written next to a tiny target.

`write_dflash` makes a DFlash drafter (z-lab's format: `dflash_config` with the
mask token and the target layers whose outputs it reads) for a target folder: its
hidden size and vocabulary are the target's, the mask token is the target's last
embedding row (published drafters use a reserved row past the tokenizer's tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx


def dflash_config(target_dir: Path, layer_ids: tuple[int, ...], block_size: int) -> dict:
    target = json.loads((Path(target_dir) / "config.json").read_text())
    target = target.get("text_config", target)
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "block_size": block_size,
        "num_target_layers": target["num_hidden_layers"],
        "tie_word_embeddings": True,
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": list(layer_ids)},
    }


def dflash_weights(config: dict, seed: int = 0) -> dict[str, mx.array]:
    """Random weights under the published key names, shaped by `config`."""
    key = mx.random.key(seed)
    d, heads, kv, hd = (
        config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    )
    inter, taps = config["intermediate_size"], len(config["dflash_config"]["target_layer_ids"])
    shapes = {"fc.weight": (d, taps * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * hd, d),
            p + "self_attn.k_proj.weight": (kv * hd, d),
            p + "self_attn.v_proj.weight": (kv * hd, d),
            p + "self_attn.o_proj.weight": (d, heads * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, d),
            p + "mlp.up_proj.weight": (inter, d),
            p + "mlp.down_proj.weight": (d, inter),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }
    weights = {}
    for name, shape in sorted(shapes.items()):
        key, sub = mx.random.split(key)
        noise = mx.random.normal(shape, key=sub)
        weights[name] = 1 + 0.1 * noise if len(shape) == 1 else noise * shape[1] ** -0.5
    return weights


def write_dflash(
    out: Path,
    target_dir: Path,
    layer_ids: tuple[int, ...] = (0, 1),
    block_size: int = 8,
    seed: int = 0,
    **overrides,
) -> Path:
    """A DFlash drafter folder for the target at `target_dir`; `overrides` change
    config fields (a mismatched drafter for refusal tests)."""
    config = dflash_config(target_dir, layer_ids, block_size) | overrides
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    weights = {"model." + k: v for k, v in dflash_weights(config, seed).items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def write_eagle3(
    out: Path,
    target_dir: Path,
    aux_ids: list[int] | None = None,
    draft_vocab: int | None = None,
    seed: int = 0,
    specforge: bool = True,
    **overrides,
) -> Path:
    """An EAGLE-3 speculator folder for the target at `target_dir`: SpecForge's format
    (`midlayer.*`, no embedding: it uses the target's) or the `speculators` one
    (`layers.0.*`, its own embedding). `aux_ids` None leaves them null in the config
    (the default then comes from the target's layer count); `draft_vocab` keeps that
    many target ids (default half; 0: all), a sorted random subset mapped by `d2t`."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    target = target.get("text_config", target)
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    draft_vocab = vocab // 2 if draft_vocab is None else draft_vocab or vocab
    heads, kv, head_dim, inter = 4, 2, hidden // 4, 2 * hidden
    # trained for a target of another width, when a test says so (then fc reads that)
    target_hidden = overrides.pop("target_hidden_size", hidden)
    layer = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "vocab_size": vocab,
    }
    if specforge:
        config = {
            **layer,
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": draft_vocab,
            "target_hidden_size": target_hidden,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids},
        }
    else:
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "draft_vocab_size": draft_vocab,
            "target_hidden_size": target_hidden,
            "eagle_aux_hidden_state_layer_ids": aux_ids,
        }
    config |= overrides
    key = mx.random.key(seed)

    def normal(*shape: int, scale: float) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        return scale * mx.random.normal(shape, key=sub)

    def norm() -> mx.array:
        return 1 + normal(hidden, scale=0.1)

    taps = 3 if aux_ids is None else len(aux_ids)
    p = "midlayer." if specforge else "layers.0."
    key, sub = mx.random.split(key)
    kept = mx.sort(mx.random.permutation(vocab, key=sub)[:draft_vocab])
    weights = {
        "fc.weight": normal(hidden, taps * target_hidden, scale=(taps * target_hidden) ** -0.5),
        p + "input_layernorm.weight": norm(),
        p + "hidden_norm.weight": norm(),
        p + "post_attention_layernorm.weight": norm(),
        p + "self_attn.q_proj.weight": normal(heads * head_dim, 2 * hidden, scale=0.1),
        p + "self_attn.k_proj.weight": normal(kv * head_dim, 2 * hidden, scale=0.1),
        p + "self_attn.v_proj.weight": normal(kv * head_dim, 2 * hidden, scale=0.1),
        p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim, scale=0.1),
        p + "mlp.gate_proj.weight": normal(inter, hidden, scale=0.1),
        p + "mlp.up_proj.weight": normal(inter, hidden, scale=0.1),
        p + "mlp.down_proj.weight": normal(hidden, inter, scale=0.1),
        "norm.weight": norm(),
        "lm_head.weight": normal(draft_vocab, hidden, scale=0.02),  # a flat q: overlaps p
        "d2t": (kept - mx.arange(draft_vocab)).astype(mx.int64),
    }
    if not specforge:
        weights["embed_tokens.weight"] = normal(vocab, hidden, scale=1.0)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def write_assistant(out: Path, target_dir: Path, seed: int = 0, masked: bool = True) -> Path:
    """A Gemma-4 `-assistant` folder for the Gemma-4 target at `target_dir`: the published
    config fields (its own 4-layer text config, `backbone_hidden_size` the target's) and
    key names, random weights, a centroid-masked head (`use_ordered_embeddings`)."""
    from mlx.utils import tree_flatten, tree_map

    from engines.drafting.gemma4_assistant_model import (
        Gemma4AssistantConfig,
        Gemma4AssistantModel,
    )

    target = json.loads((Path(target_dir) / "config.json").read_text())
    target = target.get("text_config", target)  # a vision checkpoint's language half
    vocab = target["vocab_size"]
    config = {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": target["hidden_size"],
        "use_ordered_embeddings": masked,
        # 16 centroids, or fewer where they must divide the vocabulary (a vision
        # model's added tokens: 517 = 11 x 47)
        "num_centroids": next(n for n in range(16, 0, -1) if vocab % n == 0),
        "centroid_intermediate_top_k": 4,
        "tie_word_embeddings": True,
        "block_size": 4,
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size": 32,
            "num_hidden_layers": 4,
            "intermediate_size": 48,
            "num_attention_heads": 4,
            "head_dim": target["head_dim"],
            "global_head_dim": target["global_head_dim"],
            "num_key_value_heads": target.get("num_key_value_heads", 2),
            "num_kv_shared_layers": 0,
            "vocab_size": vocab,
            "vocab_size_per_layer_input": vocab,
            "hidden_size_per_layer_input": 0,
            "sliding_window": target["sliding_window"],
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "rope_parameters": target["rope_parameters"],
            "rms_norm_eps": 1e-6,
        },
    }
    mx.random.seed(seed)
    model = Gemma4AssistantModel(Gemma4AssistantConfig.from_config(config))
    model.update(
        tree_map(
            lambda p: p + 0.1 * mx.random.normal(p.shape) if p.dtype == mx.float32 else p,
            model.parameters(),
        )
    )
    weights = dict(tree_flatten(model.parameters()))
    if masked:
        weights["masked_embedding.token_ordering"] = mx.random.permutation(vocab).astype(mx.int64)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out
