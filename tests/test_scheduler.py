"""The scheduler on its own: streams, FIFO service, cancellation, queue bound."""

from __future__ import annotations

import asyncio

import pytest

from engines.errors import ContextTooLong, InvalidRequest, QueueFull
from engines.request import GenerationRequest, SamplingParams
from engines.sequence import FinishReason
from tests.conftest import start_scheduler

GREEDY = SamplingParams(temperature=0.0)


def request(rid: str, prompt: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), max_tokens, GREEDY, ignore_eos=True)


async def test_concurrent_submissions_each_get_their_solo_output(scheduler, reference):
    prompts = [reference.tokenizer.encode(p) for p in ("Once upon", "def add(a", "Hello")]
    streams = [scheduler.submit(request(f"c{i}", p, 30)) for i, p in enumerate(prompts)]
    results = await asyncio.gather(*(s.collect() for s in streams))
    for prompt, events in zip(prompts, results, strict=True):
        tokens = [t for e in events for t in e.token_ids]
        assert tokens == reference.greedy_tokens(prompt, 30)
        assert events[-1].finish_reason == FinishReason.LENGTH
        assert events[-1].completion_tokens == 30


async def test_cancelling_a_waiting_request_removes_it_without_running(scheduler, reference):
    prompt = reference.tokenizer.encode("Once upon")
    first = scheduler.submit(request("long", prompt, 400))
    second = scheduler.submit(request("waiting", prompt, 400))
    second.cancel()
    first_events = await first.collect()
    assert first_events[-1].finish_reason == FinishReason.LENGTH
    await asyncio.sleep(0.05)
    assert scheduler.num_outstanding == 0


async def test_queue_bound_refuses_excess_requests(tiny_model_dir, reference):
    bounded = start_scheduler(tiny_model_dir, max_queue=1, max_num_seqs=1)
    try:
        prompt = reference.tokenizer.encode("Once upon")
        running = bounded.submit(request("a", prompt, 300))
        waiting = bounded.submit(request("b", prompt, 5))
        with pytest.raises(QueueFull):
            bounded.submit(request("c", prompt, 5))
        assert (await waiting.collect())[-1].finish_reason == FinishReason.LENGTH
        running.cancel()
    finally:
        bounded.stop()


def test_context_overflow_is_refused_at_submit(scheduler):
    with pytest.raises(ContextTooLong):
        scheduler.submit(request("x", [5] * 2000, 100))


@pytest.mark.parametrize(
    "prompt, bias",
    [([5, 512], ()), ([5, -1], ()), ([5, 10**9], ()), ([5, 6], ((512, 1.0),))],
    ids=["vocab", "negative", "huge", "bias"],
)
def test_token_ids_the_model_has_no_row_for_are_refused_at_submit(scheduler, prompt, bias):
    """MLX does not bounds-check an index: such an id read and wrote out of bounds (the
    process died with `free(): invalid size`), whichever surface or tokenizer sent it."""
    assert scheduler.model_info.vocab_size == 512
    sampling = SamplingParams(temperature=0.0, logit_bias=bias)
    with pytest.raises(InvalidRequest, match="outside this model's vocabulary"):
        scheduler.submit(GenerationRequest("x", tuple(prompt), 4, sampling))


def broken(message: str):
    def fail(*args, **kwargs):
        raise RuntimeError(message)

    return fail


async def one_running_one_waiting(scheduler, reference):
    prompt = reference.tokenizer.encode("Once upon")
    running = scheduler.submit(request("running", prompt, 1900))
    waiting = scheduler.submit(request("waiting", prompt, 10))
    async for _ in running:
        break  # it is decoding
    return running, waiting


@pytest.mark.parametrize("how", ["engine failure", "abort_all"])
async def test_every_stream_ends_when_cancel_raises_while_aborting(tiny_model_dir, reference, how):
    """Aborting finishes every stream first; cancelling in a broken engine is best effort."""
    from engines.errors import RequestAborted

    scheduler = start_scheduler(tiny_model_dir, batch_threshold=10)
    try:
        running, waiting = await one_running_one_waiting(scheduler, reference)
        scheduler.speculative_engine.cancel = broken("cancel in a broken engine")
        if how == "engine failure":
            scheduler._step = broken("the engine loop broke")
        else:
            scheduler.abort_all("server is shutting down")
        for stream in (running, waiting):
            with pytest.raises(RequestAborted):
                await asyncio.wait_for(stream.collect(), timeout=10)
    finally:
        scheduler.stop()


async def test_a_lost_rank_ends_every_stream_when_the_engine_thread_is_stuck(
    tiny_model_dir, reference
):
    """The rank watch hands a lost rank to the engine thread; when that thread is stuck
    (a collective on a broken ring never returns) every stream still ends, from the
    event loop's side, and the server reports failed."""
    import threading

    from engines.errors import RequestAborted, ServerNotReady
    from scheduler.scheduler import SchedulerState

    scheduler = start_scheduler(tiny_model_dir, batch_threshold=10)
    release = threading.Event()
    try:
        running, waiting = await one_running_one_waiting(scheduler, reference)
        step = scheduler._step
        scheduler._step = lambda: release.wait(60) and step()  # the next step hangs
        await asyncio.sleep(0.2)
        watch = threading.Thread(target=scheduler._rank_lost, args=("rank 1 ended",))
        watch.start()
        for stream in (running, waiting):
            with pytest.raises(RequestAborted, match="rank 1 ended"):
                await asyncio.wait_for(stream.collect(), timeout=10)
        watch.join(10)
        assert scheduler.state == SchedulerState.FAILED
        assert scheduler.num_outstanding == 0
        with pytest.raises(ServerNotReady):
            scheduler.submit(request("late", [5, 6], 4))
    finally:
        release.set()
        scheduler.stop()


async def test_a_lost_rank_is_taken_in_by_an_idle_engine_thread(tiny_model_dir, reference):
    """An idle engine thread takes the lost rank in at once: failed, nothing accepted."""
    import threading

    from engines.errors import ServerNotReady
    from scheduler.scheduler import SchedulerState

    scheduler = start_scheduler(tiny_model_dir)
    try:
        prompt = reference.tokenizer.encode("Once upon")
        await scheduler.submit(request("done", prompt, 4)).collect()
        watch = threading.Thread(target=scheduler._rank_lost, args=("rank 1 ended",))
        watch.start()
        watch.join(10)
        assert scheduler.state == SchedulerState.FAILED
        assert scheduler.error == "engine failed: rank 1 ended"
        assert not scheduler._thread.is_alive(), "the engine loop stopped"
        with pytest.raises(ServerNotReady):
            scheduler.submit(request("late", prompt, 4))
    finally:
        scheduler.stop()
