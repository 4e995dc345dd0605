"""What one proposal of each downloaded-drafter kind costs against a target step.

    python -m bench.drafter_cost TARGET [--rows 1,2,4,8,16] [--k 4] [--context 128]
        [--repeats 5] [--json OUT]

For a target folder (an mlx-lm model), random-weight drafters of each kind that fits it
(`bench/drafter_checkpoints.py`: DFlash and EAGLE-3 for any decoder; Gemma-4's assistant
for a Gemma 4 target) are loaded as `tandem serve --draft-model` loads them. At each row
count B it times, fastest of `--repeats`, with B rows of `--context` positions held:

  target   one plain batched step (B rows x 1 token) -- what drafting must beat
  verify   one batched verify of k + 1 tokens per row
  dflash   one DFlash proposal of k tokens for every row (one forward: context 1, block k+1)
  eagle3   one EAGLE-3 proposal of k tokens for every row (k chained forwards)
  assistant  one assistant proposal of k tokens for every row (k forwards over the K/V)

and prints each as a multiple of the target step: a drafter pays when
(1 + expected accepted) / (verify + proposal) beats one plain step per token. Random
weights accept nothing, but a forward's cost does not depend on its weights' values,
so the ratios hold for the trained drafters of the same shapes (`bench/device.py` runs
this on a lent GPU: stage drafters-1b).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import mlx.core as mx


def _seconds(run, repeats: int) -> float:
    """Fastest of `repeats` evaluations of `run()` (after a warm-up)."""
    mx.eval(run())
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(run())
        best = min(best, time.perf_counter() - started)
    return best


def _held(model, rows: int, context: int) -> list:
    """A ragged target cache of `rows` rows holding `context` positions each."""
    from mlx_lm.models.cache import make_prompt_cache

    from engines.cache.ragged_cache import feed_rows, ragged_from_rows

    cache = ragged_from_rows([make_prompt_cache(model) for _ in range(rows)])
    mx.eval(feed_rows(model, cache, [[1] * context for _ in range(rows)]))
    return cache


def _forward(model, cache: list, width: int) -> mx.array:
    """One forward of `width` tokens per row; the cache is cut back after."""
    lengths = list(cache[0].held)
    logits = model(mx.ones((len(lengths), width), dtype=mx.int32), cache=cache)
    mx.eval(logits)
    for layer in cache:
        layer.set_lengths(lengths)
    return logits


def measure(target: str, rows: list[int], k: int, context: int, repeats: int) -> dict:
    from bench.drafter_checkpoints import write_assistant, write_dflash, write_eagle3
    from engines.drafting.assistant import shared_kv
    from engines.drafting.feature_drafters import load_feature_drafter
    from engines.model.registry import ModelRegistry

    registry = ModelRegistry.load(target)
    config = registry.target.config.get("text_config", registry.target.config)
    layers, model = config["num_hidden_layers"], registry.target.model
    scratch = Path(tempfile.mkdtemp(prefix="drafter-cost-"))
    taps = tuple(sorted({min(1, layers - 1), layers // 2, max(0, layers - 2)}))
    aux = None if layers >= 4 else [0, layers // 2, layers]  # null ids: (2, L//2, L-3)
    writers = {
        "dflash": lambda out: write_dflash(out, Path(target), taps, block_size=k + 1),
        "eagle3": lambda out: write_eagle3(out, Path(target), aux_ids=aux),
    }
    if config.get("model_type") == "gemma4_text":
        writers["assistant"] = lambda out: write_assistant(out, Path(target))
    drafters = {
        kind: load_feature_drafter(str(write(scratch / kind)), kind, registry.target)
        for kind, write in writers.items()
    }
    hidden = int(config["hidden_size"])
    table = []
    for b in rows:
        cache = _held(model, b, context)
        row = {
            "rows": b,
            "target": _seconds(lambda held=cache: _forward(model, held, 1), repeats),
            "verify": _seconds(lambda held=cache: _forward(model, held, k + 1), repeats),
        }
        for kind, loaded in drafters.items():
            row[kind] = _seconds(_proposal(kind, loaded, b, k, hidden, cache, shared_kv), repeats)
        table.append(row)
    return {"target": target, "k": k, "context": context, "kinds": list(drafters), "rows": table}


def _proposal(kind: str, loaded, b: int, k: int, hidden: int, target_cache: list, shared_kv):
    """A callable making one proposal of k tokens for b rows with the `kind` drafter."""
    module = loaded.module
    if kind == "dflash":

        def dflash() -> mx.array:
            cache = [mx_row(layer, b) for layer in module.make_cache()]
            features = mx.zeros((b, 1, loaded.feature_width))
            block = mx.ones((b, k + 1), dtype=mx.int32)
            return module.draft_logits(features, [1] * b, block, cache)

        return dflash
    if kind == "eagle3":

        def eagle3() -> mx.array:
            cache = [mx_row(layer, b) for layer in module.make_cache()]
            tokens = mx.ones((b, 1), dtype=mx.int32)
            logits, out = module.step(
                tokens, module.fuse(mx.zeros((b, 1, loaded.feature_width))), cache
            )
            for _ in range(k - 1):
                tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
                logits, out = module.step(tokens, out, cache)
            return logits

        return eagle3

    def assistant() -> mx.array:
        kv, slots = shared_kv(target_cache, loaded.shared)
        h = mx.zeros((b, 1, hidden))
        tokens = mx.ones((b, 1), dtype=mx.int32)
        positions = mx.array([target_cache[0].held[i] - 1 for i in range(b)])
        for _ in range(k):
            logits, h = module.step(tokens, h, kv, positions, slots)
            tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
        return logits

    return assistant


def mx_row(layer, rows: int):
    """`rows` empty rows of a drafter's one-sequence cache layer."""
    from engines.cache.ragged_cache import RaggedKVCache

    return RaggedKVCache([0] * rows) if isinstance(layer, RaggedKVCache) else layer


def report(result: dict) -> None:
    print("\n".join(lines(result)))


def lines(result: dict) -> list[str]:
    """The table: per row count, the target step and each cost as a multiple of it
    (also the device check's summary of stage drafters-1b)."""
    kinds = result["kinds"]
    out = [
        f"target  {result['target']}  k={result['k']}  context={result['context']}",
        "rows  target ms  verify/target  " + "  ".join(f"{k}/target" for k in kinds),
    ]
    for row in result["rows"]:
        ratios = "  ".join(f"{row[kind] / row['target']:>10.2f}" for kind in kinds)
        out.append(
            f"{row['rows']:>4}  {1000 * row['target']:>9.2f}  "
            f"{row['verify'] / row['target']:>13.2f}  {ratios}"
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="bench.drafter_cost", description=__doc__.splitlines()[0])
    parser.add_argument("target", help="an mlx-lm model folder")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--k", type=int, default=4, help="tokens per proposal")
    parser.add_argument("--context", type=int, default=128, help="positions each row holds")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from engines.platform.blas import describe_blas

    print(f"device  {mx.default_device()}  BLAS {describe_blas()}")
    rows = [int(r) for r in args.rows.split(",")]
    result = measure(args.target, rows, args.k, args.context, args.repeats)
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
