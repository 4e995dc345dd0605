"""Time to first token of a long prompt, cold vs served from the prefix cache on disk
after a restart (scheduler/prefix_disk.py).

    python -m bench.prefix_disk MODEL [--tokens 2500 12000] [--dir DIR]

For each length: a scheduler over an empty cache directory serves the prompt (cold:
the whole prefill) and stops (its write finished); a new scheduler over the same
directory -- a restart -- serves the same prompt again, read back from disk. Each
scheduler first serves a short warm-up prompt (under the tier's 256 tokens, so never
written), so neither measurement pays first-use costs. Prints one JSON line per length:
both times to first token, their ratio, the cached tokens, the file's size, and the
engine thread's time copying the entry out and reading it back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from engines.gating.measured_costs import CostModel
from engines.request import GenerationRequest, SamplingParams
from scheduler import Scheduler, SchedulerConfig

TEXT = (
    "def handle_request(self, request):\n    # Parse the body, check the key, then route.\n"
    "    body = json.loads(request.body)\n    if body.get('model') not in self.models:\n"
    "        raise NotFound(body.get('model'))\n    return self.router.dispatch(body)\n"
)

WARM_UP = "Tell me a short story about the sea. "


def start(model: str, directory: Path) -> Scheduler:
    config = SchedulerConfig(
        model=model,
        prefix_cache_dir=str(directory),
        prefix_cache_disk_bytes=8 << 30,
        cost_model=CostModel.assumed(9),
        enable_pld=False,
    )
    scheduler = Scheduler(config)
    scheduler.start()
    assert scheduler.wait_loaded(600), scheduler.error
    assert scheduler._prefix.disk.wait_ready(600)
    return scheduler


async def first_token(scheduler: Scheduler, rid: str, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first token, and the prompt tokens served from cache."""
    request = GenerationRequest(rid, tuple(ids), 1, SamplingParams(temperature=0.0))
    started = time.perf_counter()
    events = await scheduler.submit(request).collect()
    return time.perf_counter() - started, events[-1].cached_tokens


def prompt_of(tokenizer, length: int, salt: int) -> list[int]:
    ids: list[int] = []
    part = 0
    while len(ids) < length:
        ids += tokenizer.encode(f"# part {salt}.{part}\n{TEXT}", add_special_tokens=False)
        part += 1
    return ids[:length]


async def measure(model: str, length: int, root: Path) -> dict:
    directory = root / f"prefix-{length}"
    cold_server = start(model, directory)
    tokenizer = cold_server.registry.tokenizer
    ids = prompt_of(tokenizer, length, length)
    try:
        await first_token(cold_server, "warm-a", tokenizer.encode(WARM_UP * 4))
        cold, _ = await first_token(cold_server, "cold", ids)
        copied = cold_server._prefix.disk.copy_seconds
    finally:
        cold_server.stop(timeout=120)
    files = list(cold_server.prefix_disk.directory.glob("*.safetensors"))
    warm_server = start(model, directory)
    try:
        await first_token(warm_server, "warm-b", tokenizer.encode(WARM_UP * 5))
        restarted, cached = await first_token(warm_server, "restart", ids)
        loaded = warm_server._prefix.disk.load_seconds
    finally:
        warm_server.stop(timeout=120)
    return {
        "model": model,
        "prompt_tokens": length,
        "ttft_cold_s": round(cold, 4),
        "ttft_after_restart_s": round(restarted, 4),
        "ratio": round(restarted / cold, 4),
        "cached_tokens": cached,
        "file_bytes": sum(f.stat().st_size for f in files),
        "engine_copy_s": round(copied, 4),
        "engine_load_s": round(loaded, 4),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2500, 12000])
    parser.add_argument("--dir", help="cache directories go here (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.dir) if args.dir else Path(scratch)
        for length in args.tokens:
            print(json.dumps(asyncio.run(measure(args.model, length, root))), flush=True)


if __name__ == "__main__":
    main()
