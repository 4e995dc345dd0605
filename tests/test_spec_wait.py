"""`spec_wait_budget`: when one speculative stream measurably outruns a batch, a
newcomer waits (within the budget) for the running request instead of joining a
batch; when the wait would exceed the budget, it is batched at once as usual.

On a tiny model per-step overhead, not compute, sets the rates (batching wins
there), so these tests fix the rates the rule compares (`ThroughputModel.assumed`,
like `CostModel.assumed` for the gates) and check what the scheduler does with them:
who waits, who is batched, and that every output is still exact.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from engines.request import GenerationRequest, SamplingParams
from scheduler.throughput import RateWindow, ThroughputModel, serial_wait_fits
from tests.conftest import start_scheduler
from tests.forcing import forcing_factory

LOOP = "one two three four five six seven eight " * 300
BUDGET_S = 0.3
SPEC_RATE = 1000.0  # assumed tok/s of one speculative stream; a batch of 2: 300


@pytest.fixture(scope="module")
def waiting(tiny_model_dir, reference):
    scheduler = start_scheduler(
        tiny_model_dir,
        spec_wait_budget=BUDGET_S,
        throughput_model=ThroughputModel.assumed(SPEC_RATE, {2: 300.0}),
        logits_processor_factory=forcing_factory(reference.tokenizer, {"loop": LOOP}),
    )
    yield scheduler
    scheduler.stop()


@pytest.fixture(scope="module")
def prompt(reference) -> tuple[int, ...]:
    return tuple(reference.tokenizer.encode("FORCE:loop Say it again and again"))


@pytest.fixture(scope="module")
def script(reference) -> list[int]:
    return reference.tokenizer.encode(LOOP, add_special_tokens=False)


def greedy(rid: str, prompt: tuple[int, ...], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_tokens, SamplingParams(temperature=0.0))


async def timed_tokens(stream, stamps: dict, name: str) -> list[int]:
    """The stream's tokens; records when its first token and its end arrived."""
    tokens: list[int] = []
    async for event in stream:
        if event.token_ids and f"{name}_first" not in stamps:
            stamps[f"{name}_first"] = time.monotonic()
        tokens.extend(event.token_ids)
    stamps[f"{name}_end"] = time.monotonic()
    return tokens


async def run_pair(scheduler, prompt, first_tokens: int, second_tokens: int):
    """A starts alone; B arrives once A is streaming. Returns tokens, stamps, switches."""
    switches_before = dict(scheduler.counters.mode_switches)
    stamps: dict = {}
    first = scheduler.submit(greedy("A", prompt, first_tokens))
    events = first.__aiter__()
    head = await events.__anext__()
    stamps["A_first"] = time.monotonic()

    async def rest_of_first() -> list[int]:
        tokens = list(head.token_ids)
        async for event in events:
            tokens.extend(event.token_ids)
        stamps["A_end"] = time.monotonic()
        return tokens

    stamps["B_submitted"] = time.monotonic()
    second = scheduler.submit(greedy("B", prompt, second_tokens))
    a_tokens, b_tokens = await asyncio.gather(rest_of_first(), timed_tokens(second, stamps, "B"))
    new_switches = {
        key: count - switches_before.get(key, 0)
        for key, count in scheduler.counters.mode_switches.items()
        if count != switches_before.get(key, 0)
    }
    return a_tokens, b_tokens, stamps, new_switches


async def test_newcomer_waits_for_a_short_speculative_run(waiting, prompt, script):
    first_tokens = int(SPEC_RATE * BUDGET_S / 2)  # expected to end well within the budget
    a, b, stamps, switches = await run_pair(waiting, prompt, first_tokens, 30)
    assert a == script[:first_tokens]
    assert b == script[:30]
    assert stamps["A_end"] > stamps["B_submitted"], "A ended before B came: nothing to test"
    assert stamps["B_first"] >= stamps["A_end"]  # served after A, not beside it
    assert ("speculative", "batched") not in switches


async def test_newcomer_is_batched_when_the_wait_would_exceed_the_budget(waiting, prompt, script):
    first_tokens = int(SPEC_RATE * BUDGET_S * 4)  # expected to take 4x the budget
    a, b, stamps, switches = await run_pair(waiting, prompt, first_tokens, 30)
    assert a == script[:first_tokens]
    assert b == script[:30]
    assert stamps["B_first"] < stamps["A_end"]  # ran beside A
    assert switches.get(("speculative", "batched"), 0) == 1


async def test_decode_rates_are_measured_for_each_mode(tiny_model_dir, reference):
    scheduler = start_scheduler(tiny_model_dir)
    try:
        prompt = tuple(reference.tokenizer.encode("Once upon a time"))
        alone = scheduler.submit(GenerationRequest("alone", prompt, 40, ignore_eos=True))
        await alone.collect()
        pair = [
            scheduler.submit(GenerationRequest(f"pair-{i}", prompt, 40, ignore_eos=True))
            for i in range(2)
        ]
        for stream in pair:
            await stream.collect()
        assert scheduler.throughput.speculative.rate > 0
        assert scheduler.throughput.batched[2].rate > 0
        assert 1 not in scheduler.throughput.batched  # the lone request never ran batched
    finally:
        scheduler.stop()


def window(tokens: int, seconds: float, steps: int = 4) -> RateWindow:
    rates = RateWindow()
    for _ in range(steps):
        rates.add(tokens, seconds)
    return rates


def test_rates_are_trusted_only_after_a_few_steps():
    assert window(5, 0.01, steps=3).rate is None
    assert window(5, 0.01).rate == pytest.approx(500)


def test_serial_is_faster_only_when_both_rates_are_measured():
    model = ThroughputModel()
    assert not model.serial_is_faster(2)  # nothing measured: batch, and so measure
    model.speculative = window(5, 0.01)  # 500 tok/s
    assert not model.serial_is_faster(2)  # batches of 2 not measured yet
    model.batched[2] = window(2, 0.01)  # 200 tok/s
    model.batched[8] = window(8, 0.01)  # 800 tok/s
    assert model.serial_is_faster(2)
    assert not model.serial_is_faster(8)
    assert not model.serial_is_faster(4)


def test_serial_wait_fits_counts_everyone_ahead():
    # 100 tok/s; 50 tokens running -> 0.5 s until the first waiter starts.
    assert serial_wait_fits(
        1.0, now=10.0, running_tokens_left=50, waiters=[(10.0, 80)], tokens_per_s=100
    )
    # It already waited 0.6 s: 0.6 + 0.5 > 1.0.
    assert not serial_wait_fits(1.0, 10.0, 50, [(9.4, 80)], 100)
    # The second waiter also waits for the first one's 80 tokens: 0.5 + 0.8 > 1.0.
    assert not serial_wait_fits(1.0, 10.0, 50, [(10.0, 80), (10.0, 10)], 100)
    assert serial_wait_fits(1.5, 10.0, 50, [(10.0, 80), (10.0, 10)], 100)
