"""A long prompt's prefill with mlx-lm's attention and with Tandem's CPU attention
(`engines/platform/cpu_attention.py`: heads split across streams, and the compiled
softmax), side by side in one process.

    python -m bench.cpu_attention MODEL [--tokens 4096] [--chunk 512] [--new 8]

Each side is mlx-lm's own `generate_step` over the same prompt ids at the same
`prefill_step_size`; only the attention function the model's module calls differs. It
prints each side's time to first token, the prompt's prefill rate, the ratio, and
whether the first `--new` greedy tokens are identical (they must be: both ways are
bit-identical). The prompt is a real text repeated to length, so attention is over a
long cache as in an agent's prompt. Prints the model, dtype, BLAS, cores and load.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models import base

from bench.models import resolve_model
from engines.platform import cpu_attention
from engines.platform.blas import describe_blas
from engines.platform.cpu_softmax import SoftmaxKernel

TEXT = (
    "def read_config(path):\n    with open(path) as handle:\n        return json.load(handle)\n"
    "The agent reads the file, runs the tests and reports what failed and why.\n"
)


def first_tokens(model, prompt: mx.array, chunk: int, new: int) -> tuple[float, list[int]]:
    started = time.perf_counter()
    tokens, first = [], None
    for token, _ in generate_step(prompt, model, max_tokens=new, prefill_step_size=chunk):
        if first is None:
            first = time.perf_counter() - started
        tokens.append(int(token))
    return first or 0.0, tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_attention", description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length")
    parser.add_argument("--chunk", type=int, default=512, help="prefill_step_size, both sides")
    parser.add_argument("--new", type=int, default=8, help="greedy tokens compared")
    args = parser.parse_args(argv)
    path = resolve_model(args.model)
    model, tokenizer = load(str(path))
    ids = tokenizer.encode(TEXT * (args.tokens // 20 + 1))[: args.tokens]
    prompt = mx.array(ids)
    module = sys.modules[type(model.model.layers[0].self_attn).__module__]  # its attention
    dtype = model.model.norm.weight.dtype
    cores = cpu_attention.usable_cores()
    print(f"model: {path}  dtype: {dtype}  device: {mx.default_device()}")
    loads = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"BLAS: {describe_blas()}  cores: {cores}  load average: {loads}")
    print(f"prompt: {len(ids)} tokens, prefill_step_size {args.chunk}, {args.new} greedy tokens")

    plain_attention = base.scaled_dot_product_attention
    kernel = SoftmaxKernel.load(cores)
    sides = [
        ("mlx-lm attention", plain_attention),
        ("heads split", cpu_attention.CpuAttention(plain_attention, cores)),
    ]
    if kernel is None:
        print("compiled softmax: not built or not matching MLX here; that side is left out")
    else:
        sides.append(
            ("compiled softmax", cpu_attention.CpuAttention(plain_attention, cores, kernel))
        )
    results = {}
    for name, attention in sides:
        module.scaled_dot_product_attention = attention
        try:
            results[name] = first_tokens(model, prompt, args.chunk, args.new)
        finally:
            module.scaled_dot_product_attention = plain_attention
        ttft, _ = results[name]
        print(f"{name:18s} ttft {ttft:7.1f} s  prefill {len(ids) / ttft:6.1f} tok/s", flush=True)
    plain, plain_tokens = results.pop("mlx-lm attention")
    for name, (ttft, tokens) in results.items():
        print(f"{name} / mlx-lm time to first token: {ttft / plain:.2f}x")
        print(f"{name}: first {args.new} tokens identical: {tokens == plain_tokens}")


if __name__ == "__main__":
    main()
