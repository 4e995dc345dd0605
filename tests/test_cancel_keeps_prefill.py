"""A client's cancel keeps what the request prefilled (for its API key), so a retry of
the same prompt resumes where it stopped instead of prefilling from zero; a failure's
cancel keeps nothing."""

from __future__ import annotations

import asyncio

import pytest

from engines.request import GenerationRequest, SamplingParams
from engines.sequence import make_sequence
from scheduler.prefix_cache import PrefixCache
from scheduler.prefix_reuse import PrefixReuse
from tests.conftest import start_scheduler
from tests.test_batched_speculation import CODE_PROMPT, greedy_request, make_engines

CHUNK = 64


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    return make_engines(tiny_model_dir, prefill_step_size=CHUNK)


def long_prompt(reference) -> list[int]:
    prompt = reference.tokenizer.encode(CODE_PROMPT * 8)[:300]
    assert len(prompt) == 300
    return prompt


def finish(engine, tokens: list[int], request_id: str) -> list[int]:
    while engine.active_ids:
        for output in engine.step().outputs:
            assert output.request_id == request_id
            tokens += output.token_ids
    return tokens


@pytest.mark.parametrize("which", ["single", "batched"])
def test_a_cancelled_prefill_is_kept_and_a_retry_resumes_from_it(engines, reference, which):
    spec, batched = engines
    engine = spec if which == "single" else batched
    engine.registry.transfer(engine.name)
    tokenizer, prompt = reference.tokenizer, long_prompt(reference)
    engine.admit(make_sequence(greedy_request("first", prompt, 8), tokenizer))
    engine.step()
    engine.step()  # two chunks prefilled, the prompt not yet in
    assert engine.cancel("first", keep=True)
    kept = engine.settle()
    states = kept.released + kept.checkpoints
    assert [s.cached for s in states] == [2 * CHUNK]
    assert not kept.outputs and not engine.active_ids

    reuse = PrefixReuse(PrefixCache())
    reuse.keep(kept.released, kept.checkpoints)
    retry = make_sequence(greedy_request("retry", prompt, 8), tokenizer)
    start = reuse.start(retry, engine.registry.target.model)
    assert start.cached == 2 * CHUNK
    engine.admit(start)
    assert finish(engine, [], "retry") == reference.greedy_tokens(prompt, 8)


def test_a_cancel_that_is_not_a_clients_keeps_nothing(engines, reference):
    spec, batched = engines
    for engine in (spec, batched):
        engine.registry.transfer(engine.name)
        seq = make_sequence(
            greedy_request("failing", long_prompt(reference), 8), reference.tokenizer
        )
        engine.admit(seq)
        engine.step()
        assert engine.cancel("failing")  # as a failed step's requests are cancelled
        kept = engine.settle()
        assert not kept.released and not kept.checkpoints


async def test_a_retry_after_a_cancel_in_prefill_is_served_from_the_kept_cache(
    tiny_model_dir, reference
):
    """Through the scheduler: the request is cancelled while its prompt prefills (in
    64-token chunks), and the same prompt sent again starts from what was prefilled."""
    scheduler = start_scheduler(tiny_model_dir, prefill_step_size=CHUNK)
    try:
        prompt = long_prompt(reference)
        greedy = SamplingParams(temperature=0.0)
        stream = scheduler.submit(GenerationRequest("first", tuple(prompt), 8, greedy))
        engine = scheduler.speculative_engine
        for _ in range(2000):  # until a chunk is in, then cancel mid-prefill
            active = engine.active
            if active is not None and 0 < active.cached < len(prompt) - 1:
                break
            await asyncio.sleep(0.001)
        else:
            raise AssertionError("never saw the prompt part-prefilled")
        stream.cancel()  # as a client that disconnects does; the retry follows it
        retry = await scheduler.submit(
            GenerationRequest("retry", tuple(prompt), 8, greedy)
        ).collect()
        assert retry[-1].cached_tokens >= CHUNK
        assert [t for e in retry for t in e.token_ids] == reference.greedy_tokens(prompt, 8)
    finally:
        scheduler.stop()
