"""`tandem bench invariance [MODEL]`: do this device's kernels give a verify step the
logits plain decoding gives?

Greedy speculation is token-identical to plain decoding only if the logits of a position
are the same whether it is computed in a T-token verify forward or in a one-token step.
On the CPU (OpenBLAS, MKL) they are, to float32 rounding. A GPU computes a one-token step
with matrix-vector kernels and a verify with matrix-matrix kernels that sum in another
order, and with MLX's TF32 default (NVIDIA, Apple M5) in another precision for float32
weights: Tandem turns TF32 off (`engines/platform/precision.py`); half precision keeps the kernels'
own rounding. This prints, per dtype, the largest logit difference between the two over
`--positions` positions after a `--prefix`-token prompt, and at how many positions the
greedy token differs.

MODEL is a path, a hub id or a bench model name (`qwen2.5-coder-0.5b`, ...); without
one, two random Llamas are built offline (hidden 64 with 2 layers, hidden 768 with 6).
Random tokens are fed; the logits, not the text, count.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, dataclass

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True)
class Invariance:
    model: str
    dtype: str
    max_logit_difference: float
    logit_scale: float
    greedy_flips: int
    positions: int


def verify_against_plain(model, tokens: mx.array, prefix: int, positions: int) -> tuple:
    """Logits of `positions` tokens after `prefix`: one forward over all of them (a verify)
    and one token at a time (plain decoding), each after the same prefilled prompt."""
    cache = make_prompt_cache(model)
    model(tokens[:, :prefix], cache=cache)
    block = model(tokens[:, prefix : prefix + positions], cache=cache).astype(mx.float32)
    cache = make_prompt_cache(model)
    model(tokens[:, :prefix], cache=cache)
    steps = [
        model(tokens[:, i : i + 1], cache=cache).astype(mx.float32)
        for i in range(prefix, prefix + positions)
    ]
    return block, mx.concatenate(steps, axis=1)


def measure(name: str, model, dtypes: list[str], prefix: int, positions: int) -> list:
    vocab = model.args.vocab_size
    tokens = mx.random.randint(3, vocab, (1, prefix + positions), key=mx.random.key(1))
    results = []
    for dtype in dtypes:
        model.set_dtype(DTYPES[dtype])
        block, single = verify_against_plain(model, tokens, prefix, positions)
        flips = (block.argmax(-1) != single.argmax(-1)).sum().item()
        results.append(
            Invariance(
                model=name,
                dtype=dtype,
                max_logit_difference=mx.abs(block - single).max().item(),
                logit_scale=mx.abs(single).max().item(),
                greedy_flips=int(flips),
                positions=positions,
            )
        )
    return results


def random_models() -> dict:
    from mlx_lm import load

    from engines.model.demo import TinyModelSpec, build_tiny_model

    wide = TinyModelSpec(
        hidden_size=768,
        num_hidden_layers=6,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
    )
    root = tempfile.mkdtemp(prefix="tandem-invariance-")
    specs = {"random-64x2": TinyModelSpec(), "random-768x6": wide}
    return {
        name: load(str(build_tiny_model(f"{root}/{name}", spec)))[0] for name, spec in specs.items()
    }


def main(argv: list[str]) -> None:
    from engines.platform.blas import describe_blas
    from engines.platform.precision import float32_matmuls  # `tandem` turned TF32 off, as it serves

    parser = argparse.ArgumentParser(prog="tandem bench invariance", description=__doc__)
    parser.add_argument("model", nargs="?", help="path, hub id or bench model (default: random)")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--prefix", type=int, default=32)
    parser.add_argument("--positions", type=int, default=8)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= set(DTYPES):
        parser.error(f"--dtypes: choose from {', '.join(DTYPES)}")

    if args.model:
        from mlx_lm import load

        from bench.models import resolve_model

        models = {args.model: load(resolve_model(args.model))[0]}
    else:
        models = random_models()
    print(
        f"device {mx.default_device()}, BLAS {describe_blas()}, "
        f"float32 matmuls {float32_matmuls()}; verify of {args.positions} tokens after "
        f"{args.prefix} against {args.positions} plain steps"
    )
    results = []
    for name, model in models.items():
        for row in measure(name, model, dtypes, args.prefix, args.positions):
            results.append(row)
            print(
                f"{row.model:14s} {row.dtype:9s} max |verify - plain| "
                f"{row.max_logit_difference:.2e} (logits up to {row.logit_scale:.2f}), "
                f"greedy differs at {row.greedy_flips}/{row.positions}"
            )
    if args.json:
        with open(args.json, "w") as out:
            json.dump([asdict(row) for row in results], out, indent=1)
