"""A randomized soak over server settings and cache kinds: `tandem bench soak matrix`.

    tandem bench soak matrix --model plain=/models/a --model sliding=/models/b:/models/b-draft \\
        --rounds 20 --seed 1 --output matrix.json

Each round draws one configuration -- a model (a target, and its draft if given: plain
KV, sliding-window target and draft, hybrid, MTP), `--num-draft-tokens` 1-16, the batch
threshold, backpressure on or off, the prefix cache on or off, the batch size -- starts
a scheduler with it in this process and throws a random mix of requests at it: greedy,
seeded and sampled, their own draft lengths, arriving over time (so requests migrate
into and out of the batch), some cancelled mid-stream, some left unread long enough to
pause, some reading slowly. Then every greedy request that completed is served again
alone and must give the same tokens.

A round passes when the scheduler never left READY, no request failed, nothing was
logged at ERROR (an exception anywhere in the engines), nothing was left running or
waiting, and the greedy outputs matched. Over the run, MLX's active memory between
rounds (nothing loaded) must stay flat: at most the first such reading + a slack.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from engines.errors import RequestAborted, RequestFailed, TandemError
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from scheduler import Scheduler, SchedulerConfig, SchedulerState

TEXTS = (
    "Once upon a time there was a robot",
    "def add(a, b):\n    return a + b\n" * 3,
    "Hello, world! How are you today?",
    "The weather in the mountains changes quickly",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5",
)
BEHAVIOURS = ("read", "read", "read", "cancel", "unread", "slow")
READY = SchedulerState.READY
ROUND_TIMEOUT_S = 120.0  # a round's requests all end well within this on a CPU
MEMORY_SLACK = 64 << 20  # MLX's active memory between rounds may grow this much


@dataclass(frozen=True)
class Config:
    """One round's server settings."""

    kind: str
    target: str
    draft: str | None
    num_draft_tokens: int
    batch_threshold: int
    max_unread_events: int  # 0: backpressure off
    prefix_cache_entries: int  # 0: off
    max_num_seqs: int

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            model=self.target,
            draft_model=self.draft,
            num_draft_tokens=self.num_draft_tokens,
            batch_threshold=self.batch_threshold,
            max_unread_events=self.max_unread_events,
            unread_timeout=30.0,
            prefix_cache_entries=self.prefix_cache_entries,
            max_num_seqs=self.max_num_seqs,
            batch_prefill_step_size=64,
        )


@dataclass
class Round:
    config: Config
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: list[str] = field(default_factory=list)
    errors_logged: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    left_running: int = 0
    state: str = ""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return (
            self.state == SchedulerState.READY.value
            and not (self.failed or self.errors_logged or self.mismatched)
            and self.left_running == 0
        )


class ErrorLog(logging.Handler):
    """Every record at ERROR or above, anywhere, while a round runs."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


def draw_config(rng: random.Random, models: dict[str, tuple[str, str | None]]) -> Config:
    kind = rng.choice(sorted(models))
    target, draft = models[kind]
    return Config(
        kind=kind,
        target=target,
        draft=draft,
        num_draft_tokens=rng.randint(1, 16),
        batch_threshold=rng.choice((2, 2, 3)),
        max_unread_events=rng.choice((0, 4, 16)),
        prefix_cache_entries=rng.choice((0, 16)),
        max_num_seqs=rng.choice((3, 4, 8)),
    )


@dataclass(frozen=True)
class Client:
    """How a request's client reads its stream."""

    behaviour: str  # "read", "cancel" (after `cancel_after` tokens), "unread", "slow"
    cancel_after: int
    unread_s: float  # how long an "unread" client lets events pile up first


def draw_request(rng: random.Random, index: int, tokenizer) -> tuple[GenerationRequest, Client]:
    prompt = tokenizer.encode(rng.choice(TEXTS) + f" #{rng.randint(0, 3)}")
    style = rng.choice(("greedy", "greedy", "seeded", "sampled"))
    if style == "greedy":
        sampling = SamplingParams(temperature=0.0)
    else:
        seed = rng.randint(0, 1000) if style == "seeded" else None
        sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
    k = rng.choice((None, None, 0, rng.randint(1, 16)))
    request = GenerationRequest(
        f"r{index}",
        tuple(prompt),
        rng.randint(8, 80),
        sampling,
        ignore_eos=True,
        speculation=SpeculationOverrides(num_draft_tokens=k),
    )
    client = Client(rng.choice(BEHAVIOURS), rng.randint(1, 6), rng.uniform(0.3, 1.0))
    return request, client


async def drive(scheduler: Scheduler, request: GenerationRequest, client: Client, result):
    """Submit, then read the stream as the client does; record the outcome."""
    try:
        stream = scheduler.submit(request)
    except TandemError as exc:  # not ready (failed), queue full: a soak failure too
        result.failed.append(f"{request.request_id} refused: {exc}")
        return None
    tokens: list[int] = []
    try:
        if client.behaviour == "unread":
            await asyncio.sleep(client.unread_s)  # events pile up: it may pause
        async for event in stream:
            tokens += event.token_ids
            if client.behaviour == "cancel" and len(tokens) >= client.cancel_after:
                stream.cancel()
                result.cancelled += 1
                return None
            if client.behaviour == "slow":
                await asyncio.sleep(0.01)
    except RequestAborted:
        result.cancelled += 1  # a cancel that raced the end, or a paused stream cut off
        return None
    except RequestFailed as exc:
        result.failed.append(f"{request.request_id}: {exc}")
        return None
    result.completed += 1
    return tokens


async def run_round(config: Config, rng: random.Random, requests: int) -> Round:
    result = Round(config)
    started = time.monotonic()
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)
    scheduler = Scheduler(config.scheduler_config())
    scheduler.start()
    try:
        if not scheduler.wait_loaded(120):
            result.errors_logged.append(f"load failed: {scheduler.error}")
            return result
        tokenizer = scheduler.registry.tokenizer
        drawn = [draw_request(rng, i, tokenizer) for i in range(requests)]
        result.requests = len(drawn)

        async def arrive(request, client, delay):
            await asyncio.sleep(delay)
            return await drive(scheduler, request, client, result)

        delays = sorted(rng.uniform(0, 1.5) for _ in drawn)
        pairs = zip(drawn, delays, strict=True)
        clients = [asyncio.ensure_future(arrive(r, c, d)) for (r, c), d in pairs]
        finished, hung = await asyncio.wait(clients, timeout=ROUND_TIMEOUT_S)
        for task in hung:  # a stream that never ends is a failure of its own
            task.cancel()
        if hung:
            result.failed.append(f"{len(hung)} requests unfinished after {ROUND_TIMEOUT_S:g}s")
        outputs = [task.result() if task in finished else None for task in clients]
        await asyncio.sleep(0.1)
        result.left_running = scheduler.num_running + scheduler.num_waiting
        result.state = scheduler.state.value
        for (request, _), tokens in zip(drawn, outputs, strict=True):
            if tokens is not None and request.sampling.greedy and scheduler.state == READY:
                again = await scheduler.submit(request).collect()
                if [t for e in again for t in e.token_ids] != tokens:
                    result.mismatched.append(request.request_id)
    finally:
        scheduler.stop()
        logging.getLogger().removeHandler(errors)
        result.errors_logged += errors.records
        result.seconds = round(time.monotonic() - started, 2)
    return result


def settled_memory() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


async def run_matrix(
    models: dict[str, tuple[str, str | None]], rounds: int, seed: int, requests: int = 10
) -> dict[str, Any]:
    """`rounds` random configurations over `models` (kind -> (target, draft or None))."""
    rng = random.Random(seed)
    results, memory = [], [settled_memory()]
    for _ in range(rounds):
        results.append(await run_round(draw_config(rng, models), rng, requests))
        memory.append(settled_memory())
    flat = max(memory[1:], default=memory[0]) <= memory[1 if rounds else 0] + MEMORY_SLACK
    passed = all(r.passed for r in results) and flat
    return {
        "seed": seed,
        "rounds": [{**asdict(r), "passed": r.passed} for r in results],
        "memory_between_rounds": memory,
        "memory_flat": flat,
        "failed_states": sum(r.state != SchedulerState.READY.value for r in results),
        "exceptions": sum(len(r.errors_logged) for r in results),
        "passed": passed,
    }


def parse_models(specs: list[str]) -> dict[str, tuple[str, str | None]]:
    """`kind=TARGET[:DRAFT]` each."""
    models = {}
    for spec in specs:
        kind, _, paths = spec.partition("=")
        if not kind or not paths:
            raise SystemExit(f"--model wants kind=TARGET[:DRAFT], not {spec!r}")
        target, _, draft = paths.partition(":")
        models[kind] = (target, draft or None)
    return models


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        prog="tandem bench soak matrix",
        description="Random server settings x cache kinds, with cancels, unread streams "
        "and migrations: no FAILED state, no exception, flat memory.",
    )
    parser.add_argument("--model", action="append", required=True, help="kind=TARGET[:DRAFT]")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--requests", type=int, default=10, help="per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    report = asyncio.run(
        run_matrix(parse_models(args.model), args.rounds, args.seed, args.requests)
    )
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    for index, result in enumerate(report["rounds"]):
        config = result["config"]
        print(
            f"round {index}: {config['kind']} k={config['num_draft_tokens']} "
            f"threshold={config['batch_threshold']} unread={config['max_unread_events']} "
            f"prefix={config['prefix_cache_entries']} seqs={config['max_num_seqs']}: "
            f"{result['completed']} done, {result['cancelled']} cancelled, "
            f"{'ok' if result['passed'] else 'FAILED'}"
        )
    print(f"memory flat: {report['memory_flat']}; passed: {report['passed']}")
    if not report["passed"]:
        raise SystemExit(1)
    return report
