"""Tiny random checkpoints of architectures whose caches cannot roll back, offline.

Each is a real mlx-lm model type (`mlx_lm.models.<type>.Model`) scaled down to a few
layers of hidden size 64, with random weights, saved as `config.json` +
`model.safetensors` next to the tiny test model's tokenizer, so it loads through
`mlx_lm.load` like a downloaded checkpoint:

* `sliding`: a Llama whose `layer_types` mix full and sliding-window attention;
  mlx-lm gives its sliding layers a `RotatingKVCache(16)` (as gpt-oss, Gemma 3).
* `lfm2`: LFM2, whose short-convolution layers keep an `ArraysCache` state.
* `qwen3_next`: a Qwen3-Next hybrid: gated-delta linear attention (`ArraysCache`)
  with one full-attention layer in four, mixture-of-experts MLPs.
* `gpt_oss`: gpt-oss (attention sinks, mixture of experts) whose sliding-window
  layers alternate with full attention, as in the real model.
* `gemma3`: Gemma 3's text model, five sliding-window layers to one global one.
* `qwen3_5`: a Qwen3.5 hybrid (dense MLPs, gated attention) whose checkpoint also
  holds `mtp.*` weights, the multi-token-prediction head mlx-lm drops at load
  (`build_tiny_arch(..., mtp=...)` says which head, see `add_mtp_head`).

And one whose caches do roll back, for what needs another family:

* `ministral3`: Ministral 3 with full attention only (plain `KVCache`), one of the
  families mlx-lm can split into pipeline stages (`--distributed pipeline`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench.hybrid_mtp import add_mtp_head

SLIDING_WINDOW = 16
_MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "tandem_demo.json",
)

_COMMON = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "torch_dtype": "float32",
}

# Qwen3-Next and Qwen3.5 alike: gated-delta linear attention, one full-attention layer in 4
_GATED_DELTA = {
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "intermediate_size": 128,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}

CONFIGS: dict[str, dict] = {
    "sliding": {
        "model_type": "llama",
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
        ],
        "sliding_window": SLIDING_WINDOW,
    },
    "gemma3": {  # Gemma 3's text model: five sliding-window layers to one global
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "intermediate_size": 128,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": SLIDING_WINDOW,
        "sliding_window_pattern": 6,
    },
    "gemma4": {  # Gemma 4's text model: sliding and full layers, the last two KV-shared
        "model_type": "gemma4_text",
        "num_hidden_layers": 6,
        "intermediate_size": 96,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 8,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "final_logit_softcapping": 30.0,
    },
    "lfm2": {
        "model_type": "lfm2",
        "num_hidden_layers": 4,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention", "conv", "conv"],
        "rope_theta": 1000000.0,
    },
    "qwen3_next": {
        "model_type": "qwen3_next",
        **_GATED_DELTA,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "moe_intermediate_size": 32,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "tie_word_embeddings": False,
    },
    "gpt_oss": {
        "model_type": "gpt_oss",
        "num_hidden_layers": 4,
        "num_local_experts": 4,
        # every expert for every token: top-k routing would turn the float rounding of
        # a differently shaped attention (a window kept in order and masked, against
        # mlx-lm's rotating buffer of exactly the window) into another expert and a
        # different token on some CPUs -- rounding, not the cache logic tested here
        "num_experts_per_tok": 4,
        "intermediate_size": 64,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "qwen3_5": {
        "model_type": "qwen3_5",
        **_GATED_DELTA,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1,
    },
    "ministral3": {
        "model_type": "ministral3",
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "llama_4_scaling_beta": 0.1,
            "original_max_position_embeddings": 1024,
        },
    },
}


def build_tiny_arch(
    kind: str,
    out_dir: Path,
    tokenizer_dir: Path,
    seed: int = 0,
    noise: float = 0.0,
    mtp: str | None = None,
) -> Path:
    """Write a random `kind` model (see `CONFIGS`) using `tokenizer_dir`'s tokenizer.

    `noise` > 0 adds that much relative Gaussian noise to every layer weight of the
    same random model (same `seed`): a draft that agrees with it mostly, not always.
    `mtp` ("random" or "copy", models with an MTP head only): see `add_mtp_head`."""
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map, tree_map_with_path

    from engines.model.demo import _scale_layer_weight

    out_dir.mkdir(parents=True, exist_ok=True)
    for item in tokenizer_dir.iterdir():
        if item.is_file() and item.name not in _MODEL_FILES:
            shutil.copy(item, out_dir / item.name)
    base = json.loads((tokenizer_dir / "config.json").read_text())
    mtp_layers = {"num_nextn_predict_layers": 1} if mtp and kind == "qwen3_next" else {}
    config = {
        **_COMMON,
        **CONFIGS[kind],
        **mtp_layers,
        "vocab_size": base["vocab_size"],
        "eos_token_id": base["eos_token_id"],
    }
    if config["model_type"] == "gemma4_text":  # per-layer inputs for every token id
        config["vocab_size_per_layer_input"] = base["vocab_size"]
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    model.update(tree_map_with_path(_scale_layer_weight, model.parameters()))
    if kind == "qwen3_5":
        model.update(tree_map_with_path(_scale_text_layer, model.parameters()))
    if noise:
        key = mx.random.key(seed + 1)

        def perturb(value):
            nonlocal key
            key, sub = mx.random.split(key)
            return value + noise * value.std() * mx.random.normal(value.shape, key=sub)

        model.update(tree_map(perturb, model.parameters()))
    head = add_mtp_head(model, config, mtp, seed) if mtp is not None else {}
    weights = dict(tree_flatten(model.parameters()))
    if kind == "qwen3_5":  # in the model's file, which mlx-lm's qwen3_5 sanitize filters
        weights.update(head)
    elif head:  # a file of its own: mlx-lm's qwen3_next refuses unknown keys
        mx.eval(head)
        mx.save_safetensors(str(out_dir / "mtp.safetensors"), head)
    mx.eval(weights)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights)
    # mlx-lm's pipeline loader reads which file holds each layer from the index.
    index = {"metadata": {}, "weight_map": dict.fromkeys(weights, "model.safetensors")}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def _scale_text_layer(path: str, value):
    """The demo's layer-weight scale for a model whose text layers sit one level down."""
    from engines.model.demo import _scale_layer_weight

    return _scale_layer_weight(path.removeprefix("language_model."), value)
