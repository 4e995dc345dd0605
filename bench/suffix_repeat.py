"""The same question asked again in a new conversation: by the same API key, suffix
decoding drafts the earlier answer (`engines/drafting/suffix.py`); by another key it
must be no faster (a key's index is its own).

    python -m bench.suffix_repeat MODEL [--prompt-tokens 1200] [--max-tokens 64]

Two schedulers in process (the model's dtype, greedy, defaults otherwise), one prompt of
this repository's code and a question. In the first, key k1 asks it (the first answer:
prompt lookup only), asks it again (a new conversation: the prefix cache serves the
prompt, suffix decoding drafts the first answer), then twice at once (the batched
engine); key k2 asks the same prompt (no cache, no suffix drafts: it must be no faster
than k1's first). The second scheduler runs k1's four requests with suffix decoding off:
the decode speed each ratio is against. Last, mlx-lm's own `generate_step` decodes the
prompt in process: plain decoding, which every answer must equal token for token.
Prints one JSON line per request (time to first token, decode tokens/s, drafted and
accepted tokens by method, the ratio), then the model, BLAS, load average and whether
every answer was identical to plain decoding.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from bench.models import resolve_model
from engines.gating.measured_costs import CostModel
from engines.platform.blas import describe_blas
from engines.request import GenerationRequest, SamplingParams
from scheduler import Scheduler, SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]
QUESTION = (
    "\n\nExplain in plain words what the function feed_rows above does, "
    "then write a short test for it.\n"
)
ALONE = ("first", "again")  # k1, one after the other
TOGETHER = ("together-1", "together-2")  # k1, at once


async def ask(scheduler: Scheduler, rid: str, ids: list[int], scope: str, max_tokens: int):
    request = GenerationRequest(
        rid, tuple(ids), max_tokens, SamplingParams(temperature=0.0), cache_scope=scope
    )
    started, first, tokens, last = time.perf_counter(), None, [], None
    async for event in scheduler.submit(request):
        if event.token_ids and first is None:
            first = time.perf_counter()
        tokens += event.token_ids
        last = event
    ended = time.perf_counter()
    methods = (last.speculation or {}).get("by_method", {})
    return {
        "request": rid,
        "key": scope,
        "ttft_s": round(first - started, 3),
        "decode_tok_s": round((len(tokens) - 1) / (ended - first), 2),
        "cached_tokens": last.cached_tokens,
        "drafted_accepted": {
            m: [s["draft_tokens"], s["accepted_tokens"]] for m, s in methods.items()
        },
        "tokens": tokens,
    }


async def measure(model: str, prompt_tokens: int, max_tokens: int, suffix: bool) -> list[dict]:
    """k1's requests (and, with `suffix`, k2's), in a scheduler of their own."""
    off = {} if suffix else {"suffix_tokens_per_key": 0}
    scheduler = Scheduler(SchedulerConfig(model=model, cost_model=CostModel.assumed(9), **off))
    scheduler.start()
    assert scheduler.wait_loaded(900), scheduler.error
    ids = prompt_ids(scheduler.registry.tokenizer, prompt_tokens)
    try:
        results = [await ask(scheduler, rid, ids, "k1", max_tokens) for rid in ALONE]
        results += await asyncio.gather(
            *(ask(scheduler, r, ids, "k1", max_tokens) for r in TOGETHER)
        )
        if suffix:
            results.append(await ask(scheduler, "other-key", ids, "k2", max_tokens))
    finally:
        scheduler.stop(timeout=120)
    return results


def prompt_ids(tokenizer, prompt_tokens: int) -> list[int]:
    code = (ROOT / "engines" / "cache" / "ragged_cache.py").read_text()
    return tokenizer.encode(code)[:prompt_tokens] + tokenizer.encode(QUESTION)


def plain_greedy(model_dir: str, prompt_tokens: int, max_tokens: int) -> list[int]:
    """mlx-lm's `generate_step`, greedy, on the same prompt ids: plain decoding."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(model_dir)
    ids = mx.array(prompt_ids(tokenizer, prompt_tokens))
    return [int(token) for token, _ in generate_step(ids, model, max_tokens=max_tokens)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.suffix_repeat", description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--prompt-tokens", type=int, default=1200)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    model = resolve_model(args.model)
    served = asyncio.run(measure(model, args.prompt_tokens, args.max_tokens, suffix=True))
    plain = asyncio.run(measure(model, args.prompt_tokens, args.max_tokens, suffix=False))
    mlx_lm_tokens = plain_greedy(model, args.prompt_tokens, args.max_tokens)
    reference = {r["request"]: r for r in plain}
    reference["other-key"] = served[0]  # k2's first ask against k1's
    for result in served:
        against = reference[result["request"]]
        shown = {k: v for k, v in result.items() if k != "tokens"}
        shown["decode_vs_plain"] = round(result["decode_tok_s"] / against["decode_tok_s"], 2)
        print(json.dumps(shown), flush=True)
    for result in plain:
        shown = {k: v for k, v in result.items() if k != "tokens"}
        print(json.dumps({**shown, "suffix": "off"}), flush=True)
    summary = {
        "model": model,
        "blas": describe_blas(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        # Tandem stops at the end-of-sequence token, generate_step does not
        "identical_to_plain": all(
            r["tokens"] == mlx_lm_tokens[: len(r["tokens"])] for r in served + plain
        ),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
