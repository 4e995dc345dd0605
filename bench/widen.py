"""Widen a small Llama into one with realistic per-token cost and the same function.

The TinyStories models in ../shared/models are real but tiny (~0.3M parameters), so a
forward costs mostly Python overhead and cannot show what speculation buys on a real
model. Widening zero-pads every matrix (hidden 64 -> 1024, extra attention heads and
MLP rows with zero weights, extra layers whose output projections are zero) and
rescales the RMSNorm weights and epsilon for the zero padding. The widened model
computes the original function (up to float rounding) with ~100M parameters of real
matmul work per token, so benchmarks get a real language model at a realistic cost.

    python -m bench.widen SRC OUT [--hidden 1024] [--intermediate 4096] [--layers 6]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import mlx.core as mx


def _pad(matrix: mx.array, rows: int, cols: int) -> mx.array:
    out = mx.zeros((rows, cols), dtype=matrix.dtype)
    return out.at[: matrix.shape[0], : matrix.shape[1]].add(matrix)


def _pad_vector(vector: mx.array, size: int) -> mx.array:
    return mx.zeros((size,), dtype=vector.dtype).at[: vector.shape[0]].add(vector)


def widen(src: Path, out: Path, hidden: int, intermediate: int, layers: int) -> Path:
    config = json.loads((src / "config.json").read_text())
    h, n_heads, n_kv = (
        config["hidden_size"],
        config["num_attention_heads"],
        config.get("num_key_value_heads", config["num_attention_heads"]),
    )
    head_dim = config.get("head_dim") or h // n_heads
    assert hidden % head_dim == 0 and hidden >= h and layers >= config["num_hidden_layers"]
    heads = hidden // head_dim
    kv_heads = heads * n_kv // n_heads
    norm_scale = math.sqrt(h / hidden)

    weights = mx.load(str(src / "model.safetensors"))
    wide: dict[str, mx.array] = {}
    for name, value in weights.items():
        if name.endswith("norm.weight"):
            wide[name] = _pad_vector(value * norm_scale, hidden)
        elif name.endswith(("q_proj.weight", "o_proj.weight")) or "mlp" in name:
            rows = {"q_proj": heads * head_dim, "o_proj": hidden}
            key = next((k for k in rows if k in name), None)
            if key == "q_proj":
                wide[name] = _pad(value, heads * head_dim, hidden)
            elif key == "o_proj":
                wide[name] = _pad(value, hidden, heads * head_dim)
            elif name.endswith("down_proj.weight"):
                wide[name] = _pad(value, hidden, intermediate)
            else:
                wide[name] = _pad(value, intermediate, hidden)
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            wide[name] = _pad(value, kv_heads * head_dim, hidden)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            wide[name] = _pad(value, value.shape[0], hidden)
        else:
            raise ValueError(f"unexpected tensor {name}")
    for layer in range(config["num_hidden_layers"], layers):
        template = f"model.layers.{layer % config['num_hidden_layers']}."
        for name, value in list(wide.items()):
            if name.startswith(template):
                wide[f"model.layers.{layer}." + name[len(template) :]] = mx.zeros_like(value)
    out.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            shutil.copy(file, out / file.name)
    mx.save_safetensors(str(out / "model.safetensors"), wide)
    config.update(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=config.get("rms_norm_eps", 1e-5) * h / hidden,
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    widen(args.src, args.out, args.hidden, args.intermediate, args.layers)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
