"""One concurrency level of `tandem bench serve`: requests issued under the run's bounds.

Why apart: the scheduling of requests (closed loop or Poisson arrivals, at most
`concurrency` in flight, a hard deadline and request allowance) is independent of what
a request sends and of how results are reported.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.serve_dataset import Prompt
from bench.serve_request import request_body, send_request
from bench.serve_settings import Settings
from bench.stats import RequestRecord

CANCELLED = "Cancelled (max-duration)"


@dataclass
class Budget:
    """The run's hard bounds: a wall-clock deadline and a request allowance."""

    deadline: float
    requests_left: int
    stopped: str | None = None

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def exhausted(self) -> bool:
        """True (recording why) once either bound is reached."""
        if self.remaining() <= 0:
            self.stopped = self.stopped or "max-duration reached"
        elif self.requests_left <= 0:
            self.stopped = self.stopped or "max-requests reached"
        return self.stopped is not None

    def take(self) -> bool:
        """Claim one request, unless the run is over."""
        if self.exhausted():
            return False
        self.requests_left -= 1
        return True


@dataclass
class Run:
    """What every request of one benchmark run shares."""

    client: httpx.AsyncClient
    settings: Settings
    model: str
    prompts: list[Prompt]
    budget: Budget


@dataclass
class LevelRun:
    concurrency: int
    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0


async def run_level(run: Run, order: list[int], concurrency: int, label: str = "") -> LevelRun:
    """Issue `order` with at most `concurrency` in flight (closed loop, or Poisson
    arrivals when a request rate is set). In-flight requests still running at the
    deadline are cancelled and counted as failed."""
    settings, budget = run.settings, run.budget
    rng = random.Random(settings.seed)
    slots = asyncio.Semaphore(concurrency)
    progress = make_progress(len(order), label or f"concurrency {concurrency}")
    tasks: list[tuple[int, asyncio.Task]] = []
    start = time.perf_counter()
    for number, index in enumerate(order):
        if not await wait_for_slot(slots, budget, arrival_gap(settings, rng)):
            break
        if not budget.take():
            slots.release()
            break
        seed = None if settings.temperature == 0 else settings.seed + number
        body = request_body(settings, run.model, run.prompts[index], seed)
        request = send_request(run.client, settings, body, index)
        tasks.append((index, asyncio.create_task(in_slot(request, slots, progress.update))))
    records = await collect(tasks, budget)
    progress.close()
    return LevelRun(concurrency, records, time.perf_counter() - start)


def arrival_gap(settings: Settings, rng: random.Random) -> float:
    """Exponential gaps make Poisson arrivals; no gap in a closed loop."""
    return 0.0 if math.isinf(settings.request_rate) else rng.expovariate(settings.request_rate)


async def wait_for_slot(slots: asyncio.Semaphore, budget: Budget, gap: float) -> bool:
    """Sleep until the next arrival, then until a slot frees; False at the deadline."""
    if gap > 0:
        await asyncio.sleep(min(gap, budget.remaining()))
    try:
        await asyncio.wait_for(slots.acquire(), timeout=budget.remaining())
    except asyncio.TimeoutError:
        budget.stopped = budget.stopped or "max-duration reached"
        return False
    return True


async def in_slot(
    request: Awaitable[RequestRecord], slots: asyncio.Semaphore, done: Callable[[int], Any]
) -> RequestRecord:
    try:
        return await request
    finally:
        slots.release()
        done(1)


async def collect(tasks: list[tuple[int, asyncio.Task]], budget: Budget) -> list[RequestRecord]:
    if not tasks:
        return []
    _, pending = await asyncio.wait([task for _, task in tasks], timeout=budget.remaining())
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    if pending:
        budget.stopped = budget.stopped or "max-duration reached"
    return [
        RequestRecord(prompt_index=index, error=CANCELLED) if task in pending else task.result()
        for index, task in tasks
    ]


def make_progress(total: int, description: str):
    """tqdm when installed (silent when stderr is not a terminal), else a counter."""
    try:
        from tqdm import tqdm
    except ImportError:
        return LineCounter(total, description)
    return tqdm(total=total, desc=description, unit="req", file=sys.stderr, disable=None)


@dataclass
class LineCounter:
    """A one-line `done/total` counter on stderr, for when tqdm is missing."""

    total: int
    description: str
    done: int = 0

    def update(self, amount: int) -> None:
        self.done += amount
        if sys.stderr.isatty():
            print(f"\r{self.description}: {self.done}/{self.total}", end="", file=sys.stderr)

    def close(self) -> None:
        if sys.stderr.isatty():
            print(file=sys.stderr)
