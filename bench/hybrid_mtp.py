"""Random Qwen3.5-style hybrids whose checkpoint carries an MTP head, built offline.

Real Qwen3.5 weights need a download (and a Mac or GPU to run fast); the MTP path's
costs -- the head's draft steps, verifies and recurrent rollbacks -- only need the
shapes. So `hybrid-mtp-170m` (`bench.models`) is a ~170M-parameter Qwen3.5 hybrid
(12 layers, hidden 1024, gated delta net : attention 3 : 1) with the demo tokenizer,
whose head is a "copy" of the target's own next-token path (`add_mtp_head`), so drafts
are mostly accepted, as a trained head's are. The tests build tiny ones the same way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Every layer but one full-attention layer contributes this fraction of its output in
# a "copy" checkpoint, so the one-layer MTP head can mostly reproduce the target.
COPY_RESIDUAL_SCALE = 0.005

HYBRID_170M = {
    "model_type": "qwen3_5",
    "hidden_size": 1024,
    "num_hidden_layers": 12,
    "full_attention_interval": 4,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "linear_num_value_heads": 16,
    "linear_num_key_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "mtp_num_hidden_layers": 1,
    "torch_dtype": "float32",
}


def add_mtp_head(model, config: dict, kind: str, seed: int) -> dict:
    """`mtp.*` weights for `model` (updated in place for "copy"):

    * "random": a random head. It rarely agrees with the target: drafts are mostly
      rejected, so every rejection path (restore and replay included) runs.
    * "copy": the head is the target's own next-token path. Embeddings get unit RMS,
      the head's fc passes the normalised embedding through, its layer is a copy of
      the target's first full-attention layer, and the target's other layers are
      scaled down (`COPY_RESIDUAL_SCALE`). Fed (h_i, x_{i+1}), the head then computes
      about what the target computes at position i+1, so most drafts are accepted."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engines.model.mtp import build_head

    mx.random.seed(seed + 7)
    head = build_head(config)
    text = getattr(model, "language_model", model).model
    if kind == "copy":
        if config["model_type"] != "qwen3_5":
            raise ValueError("a copy head is built for the dense qwen3_5 layers only")
        embed = text.embed_tokens.weight
        text.embed_tokens.weight = embed * mx.rsqrt(mx.mean(embed * embed, -1, keepdims=True))
        attention = config["full_attention_interval"] - 1
        for index, layer in enumerate(text.layers):
            if index != attention:
                mixer = layer.linear_attn.out_proj if layer.is_linear else layer.self_attn.o_proj
                mixer.weight *= COPY_RESIDUAL_SCALE
                layer.mlp.down_proj.weight *= COPY_RESIDUAL_SCALE
        own = dict(tree_flatten(head.layers[0].parameters()))  # mlx-vlm's layer has more
        source = tree_flatten(text.layers[attention].parameters())
        head.layers[0].load_weights([(name, value) for name, value in source if name in own])
        size = config["hidden_size"]
        head.fc.weight = mx.concatenate([mx.eye(size), mx.zeros((size, size))], axis=1)
    elif kind != "random":
        raise ValueError(f"unknown MTP head kind {kind!r}")
    return {f"mtp.{key}": value for key, value in tree_flatten(head.parameters())}


def build_hybrid_mtp(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """`HYBRID_170M` with a copy head, saved as an mlx-lm folder (reused once built)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5

    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for item in tokenizer_dir.iterdir():
        if item.is_file() and not item.name.startswith(("config", "model", "tandem")):
            shutil.copy(item, out / item.name)
    base = json.loads((tokenizer_dir / "config.json").read_text())
    config = {**HYBRID_170M, "vocab_size": base["vocab_size"], "eos_token_id": base["eos_token_id"]}
    mx.random.seed(seed)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    head = add_mtp_head(model, config, "copy", seed)
    weights = {**dict(tree_flatten(model.parameters())), **head}
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
