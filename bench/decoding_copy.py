"""A request arriving while another of its API key decodes the same long prompt (an
agent's subagent, a retry after a client timeout): its time to first token with the
decoding request's cache copied for it (`Engine.copy_cache`), against the same with
`--prefill-follow-min-tokens 0` (it prefills the prompt again).

    python -m bench.decoding_copy MODEL [--tokens 2500] [--answer 48]

Two schedulers in process, one after the other (the model's dtype, greedy, prefix cache
in memory only, defaults otherwise): copies on, then off. In each, key k1 sends a
`--tokens` prompt of this repository's code and a first task (the leader, `--answer`
tokens); once its fourth token is out, k1 sends the same prompt with a second task (the
newcomer, 8 tokens). Prints one JSON line per run: the leader's time to first token
(cold), the newcomer's and the prompt tokens it was served from cache, the ratio
newcomer / cold, and the leader's stream meanwhile (median gap before the newcomer,
largest gap while it prefilled); then the model, BLAS, load average, the ratio of the
newcomer's time to first token on / off, and whether both runs gave the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from bench.models import resolve_model
from engines.gating.measured_costs import CostModel
from engines.platform.blas import describe_blas
from engines.request import GenerationRequest, SamplingParams
from scheduler import Scheduler, SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]
TASKS = (
    "\n\nExplain in plain words what feed_rows above does.\n",
    "\n\nWrite a short test for the function take above.\n",
)
GREEDY = SamplingParams(temperature=0.0)
SENT_AFTER = 4  # leader tokens out when the newcomer is sent (its pace before, measured)


def prompts(tokenizer, length: int) -> list[list[int]]:
    """The shared prompt (`length` tokens of code) with each task after it."""
    code = "".join(
        (ROOT / "engines" / name).read_text()
        for name in ("cache/ragged_cache.py", "batched/prefill_groups.py")
    )
    shared = tokenizer.encode(code)[:length]
    assert len(shared) == length, f"the code is shorter than {length} tokens"
    return [shared + tokenizer.encode(task, add_special_tokens=False) for task in TASKS]


async def run(model: str, length: int, answer: int, copies: bool) -> dict:
    follow = {} if copies else {"prefill_follow_min_tokens": 0}
    config = SchedulerConfig(model=model, cost_model=CostModel.assumed(9), **follow)
    scheduler = Scheduler(config)
    scheduler.start()
    assert scheduler.wait_loaded(900), scheduler.error
    try:
        leader_ids, newcomer_ids = prompts(scheduler.registry.tokenizer, length)
        warm = scheduler.registry.tokenizer.encode("Tell me a short story about the sea. " * 4)
        await scheduler.submit(GenerationRequest("warm", tuple(warm), 2, GREEDY)).collect()
        started = time.perf_counter()
        leader = scheduler.submit(
            GenerationRequest("leader", tuple(leader_ids), answer, GREEDY, cache_scope="k1")
        )
        times, leader_tokens, newcomer = [], [], None
        newcomer_request = GenerationRequest(
            "newcomer", tuple(newcomer_ids), 8, GREEDY, cache_scope="k1"
        )
        async for event in leader:
            if event.token_ids:
                times.append(time.perf_counter())
            leader_tokens += event.token_ids
            if newcomer is None and len(leader_tokens) >= SENT_AFTER:
                sent = time.perf_counter()
                newcomer = asyncio.ensure_future(timed(scheduler.submit(newcomer_request)))
        newcomer_first, events = await newcomer
    finally:
        scheduler.stop(timeout=120)
    ttft = newcomer_first - sent
    gaps = [(b - a, b) for a, b in zip(times, times[1:], strict=False)]
    before = [gap for gap, at in gaps if at < sent]
    during = [gap for gap, at in gaps if sent <= at <= newcomer_first]
    return {
        "copies": copies,
        "leader_ttft_s": round(times[0] - started, 3),
        "newcomer_ttft_s": round(ttft, 3),
        "newcomer_cached_tokens": events[-1].cached_tokens,
        "newcomer_vs_cold": round(ttft / (times[0] - started), 3),
        "leader_median_gap_before_ms": _ms(statistics.median(before) if before else None),
        "leader_largest_gap_while_newcomer_prefilled_ms": _ms(max(during, default=None)),
        "prefill_follows": dict(scheduler.counters.prefill_follows),
        "leader_tokens": leader_tokens,
        "newcomer_tokens": [t for e in events for t in e.token_ids],
    }


async def timed(stream) -> tuple[float, list]:
    """When the stream's first token came, and all its events."""
    first, events = None, []
    async for event in stream:
        if event.token_ids and first is None:
            first = time.perf_counter()
        events.append(event)
    return first, events


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decoding_copy", description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=2500)
    parser.add_argument("--answer", type=int, default=48)
    args = parser.parse_args(argv)
    model = resolve_model(args.model)
    on = asyncio.run(run(model, args.tokens, args.answer, copies=True))
    off = asyncio.run(run(model, args.tokens, args.answer, copies=False))
    for result in (on, off):
        shown = {k: v for k, v in result.items() if not k.endswith("_tokens") or "cached" in k}
        print(json.dumps(shown), flush=True)
    same = on["leader_tokens"] == off["leader_tokens"] and (
        on["newcomer_tokens"] == off["newcomer_tokens"]
    )
    print(
        json.dumps(
            {
                "model": args.model,
                "blas": describe_blas(),
                "dtype": "the model's (float32 on CPU)",
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "prompt_tokens": args.tokens,
                "answer_tokens": args.answer,
                "newcomer_ttft_on_vs_off": round(on["newcomer_ttft_s"] / off["newcomer_ttft_s"], 3),
                "identical_tokens_on_and_off": same,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
