"""What a verify costs against a plain step, by draft width and batch rows.

    python -m bench.device_verify MODEL [--tokens 1,2,4,8,16] [--rows 1,2,4,8,16]
        [--context 256] [--repeats 5] [--json OUT]

Speculation pays where a forward of T tokens per row costs little more than a forward
of one: on this CPU a verify of 8 tokens costs about two plain steps, on a GPU about
one. For every (rows B, tokens T) it times one forward of [B, T] over a KV cache
holding `--context` tokens per row, then trims the T positions away (a KV cache
trims for free), median of the repeats after a warm-up, and reports it against a
plain single-row step ([1, 1]) and against a plain step of the same rows ([B, 1]):
the batched engine's choice is between those two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def forward_seconds(model, rows: int, tokens: int, context: int, repeats: int) -> float:
    """Median seconds of a [rows, tokens] forward after `context` cached tokens."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((rows, context), dtype=mx.int32), cache=cache))
    feed = mx.ones((rows, tokens), dtype=mx.int32)
    runs = []
    for _ in range(repeats + 1):  # the first is a warm-up
        started = time.perf_counter()
        mx.eval(model(feed, cache=cache))
        runs.append(time.perf_counter() - started)
        trim_prompt_cache(cache, tokens)
    return statistics.median(runs[1:])


def grid(model, rows: list[int], tokens: list[int], context: int, repeats: int) -> dict:
    """Seconds and both ratios for every (rows, tokens)."""
    seconds = {(b, t): forward_seconds(model, b, t, context, repeats) for b in rows for t in tokens}
    base = seconds.get((1, 1)) or forward_seconds(model, 1, 1, context, repeats)
    cells = []
    for (b, t), value in seconds.items():
        plain_rows = seconds.get((b, 1)) or forward_seconds(model, b, 1, context, repeats)
        cells.append(
            {
                "rows": b,
                "tokens": t,
                "ms": 1000 * value,
                "vs_plain_step": value / base,
                "vs_plain_step_same_rows": value / plain_rows,
            }
        )
    return {"plain_step_ms": 1000 * base, "context": context, "cells": cells}


def table(result: dict, rows: list[int], tokens: list[int]) -> str:
    """Rows down, tokens across: forward / plain step of the same rows (and / [1,1])."""
    by = {(c["rows"], c["tokens"]): c for c in result["cells"]}
    lines = [
        f"plain step {result['plain_step_ms']:.2f} ms at context {result['context']}; "
        "cell: verify / plain step of the same rows (/ one-row plain step)",
        "| rows \\ tokens | " + " | ".join(str(t) for t in tokens) + " |",
        "|---" * (len(tokens) + 1) + "|",
    ]
    for b in rows:
        cells = [
            f"{by[b, t]['vs_plain_step_same_rows']:.2f} ({by[b, t]['vs_plain_step']:.2f})"
            for t in tokens
        ]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", default="1,2,4,8,16")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(args.model)
    rows = [int(b) for b in args.rows.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    result = {"model": args.model, "device": str(mx.default_device())}
    result.update(grid(model, rows, tokens, args.context, args.repeats))
    print(f"model {args.model} on {result['device']}")
    print(table(result, rows, tokens))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
