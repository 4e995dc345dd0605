"""What a prompt chunk costs the decoding rows on this machine: one forward of a chunk
alone, of a decode step alone, and of both packed into one forward
(`engines/batched/packed_forward.py`), by chunk size.

    python -m bench.packed_cost MODEL [--context 1024] [--sizes 8,16,32,64,128,256]

The chunk is fed at `--context` tokens of cache, the decoding row at 256; each forward is
timed twice (best kept) and cut back after, as the engines evaluate them: the chunk's
cache only, the row's logits. It shows the trade the prefill pacer makes
(`engines/prefill_pacing.py`): a packed step of C tokens is the decoding row's gap, and C
over its time is the prompt's prefill rate while it shares the machine. Where a decode
step costs as much as a dozen prompt tokens (a CPU), a gap near 3 decode steps caps that
rate below the rate alone; where a decode step is a pass over the weights that a chunk
makes anyway (a GPU), the row rides nearly free. Prints the model, BLAS and load.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from bench.models import resolve_model
from engines.batched.packed_forward import packed_logits, supports_packing
from engines.platform.blas import describe_blas

SIZES = (8, 16, 32, 64, 128, 256)


def filled(model, ids: mx.array, tokens: int, step: int = 256) -> list:
    cache = make_prompt_cache(model)
    for start in range(0, tokens, step):
        model(ids[:, start : min(start + step, tokens)], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def best_of_two(run: Callable[[], None], undo: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(2):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
        undo()
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.packed_cost", description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=1024, help="the chunk's cache length")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    args = parser.parse_args(argv)
    path = resolve_model(args.model)
    model, _ = load(str(path))
    if not supports_packing(model):
        raise SystemExit(f"{args.model}: not a llama/qwen2 full-attention model (no packing)")
    sizes = [int(s) for s in args.sizes.split(",")]
    vocab, length = model.args.vocab_size, max(args.context, 257) + max(sizes)
    ids = mx.array([[(1000 + i) % vocab for i in range(length)]])
    chunk_cache, row_cache = filled(model, ids, args.context), filled(model, ids, 256)
    row = ids[:, 256:257]
    dtype = model.model.norm.weight.dtype
    print(f"model: {path}  dtype: {dtype}  device: {mx.default_device()}")
    loads = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"BLAS: {describe_blas()}  load average: {loads}")

    def undo(chunk: int) -> Callable[[], None]:
        return lambda: (trim_prompt_cache(chunk_cache, chunk), trim_prompt_cache(row_cache, 1))

    def decode() -> None:
        mx.eval(model(row, cache=row_cache)[:, -1])

    step = best_of_two(decode, lambda: trim_prompt_cache(row_cache, 1))
    print(f"decode step alone: {step * 1000:.0f} ms (chunk at {args.context} tokens of cache)")
    print("chunk  alone ms  packed ms  separate ms  packed/decode  prefill tok/s alone, packed")
    for size in sizes:
        chunk = ids[:, args.context : args.context + size]

        def alone(chunk: mx.array = chunk) -> None:
            model(chunk, cache=chunk_cache)
            mx.eval([c.state for c in chunk_cache])

        def packed(chunk: mx.array = chunk) -> None:
            _, logits = packed_logits(model, [(chunk, chunk_cache), (row, row_cache)])
            mx.eval(logits[:, -1], [c.state for c in chunk_cache])

        by_itself = best_of_two(alone, lambda size=size: trim_prompt_cache(chunk_cache, size))
        together = best_of_two(packed, undo(size))
        print(
            f"{size:5d}  {by_itself * 1000:8.0f}  {together * 1000:9.0f}  "
            f"{(by_itself + step) * 1000:11.0f}  {together / step:12.2f}x  "
            f"{size / by_itself:8.1f}, {size / together:5.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
