"""Long work never freezes the other streams: a long prompt scored for echo + logprobs
is scored a chunk per engine step, between the running streams' steps, and a grammar's
matcher is built in the request's worker thread, never on the engine thread."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import llguidance
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engines.request import GenerationRequest, SamplingParams
from engines.sample.logprobs import token_logprobs
from server.openai.logprobs import token_text
from tests.conftest import MODEL_NAME, make_client, start_scheduler
from tests.test_logprobs_echo_fim import assert_prompt_logprobs_match, reference_logprobs
from tests.test_structured_outputs import SCHEMA

CHUNK = 256  # prompt tokens scored (and prefilled) per engine step in these tests
LONG_PROMPT = 12 * CHUNK + 1  # scored in 12 full chunks (all but the last token)
TEXT = "def add(a, b):\n    return a + b\nThe quick brown fox jumps over the lazy dog.\n"
GREEDY = SamplingParams(temperature=0.0)
HOLD_S = 5  # a held matcher build gives up after this, so a regression fails, not hangs


@pytest.fixture(scope="module")
def chunked(long_context_dir):
    scheduler = start_scheduler(
        long_context_dir, prefill_step_size=CHUNK, batch_prefill_step_size=CHUNK
    )
    yield scheduler
    scheduler.stop()


def prompt_of(tokenizer, length: int) -> list[int]:
    ids = tokenizer.encode(TEXT)
    return (ids * (length // len(ids) + 1))[:length]


async def warm_up(scheduler, tokenizer) -> None:
    """Two requests at once (so the batched engine exists) and a short scored prompt
    (so MLX has compiled its kernels for a chunk's shapes) before anything is timed."""
    prompt = tuple(prompt_of(tokenizer, 20))
    streams = [scheduler.submit(GenerationRequest(f"warm{i}", prompt, 4, GREEDY)) for i in range(2)]
    scored = tuple(prompt_of(tokenizer, 2 * CHUNK + 1))
    streams.append(scheduler.submit(GenerationRequest("warm", scored, 0, prompt_logprobs=1)))
    await asyncio.gather(*(s.collect() for s in streams))
    assert scheduler.batched_engine is not None


def slowest_chunk_seconds(model, prompt: list[int], chunk: int) -> float:
    """The longest time scoring one `chunk` of the prompt takes here (a forward over
    the chunk with the cache of the tokens before it, then its log-probabilities)."""
    cache = make_prompt_cache(model)
    body = prompt[:-1]
    slowest = 0.0
    for start in range(0, len(body), chunk):
        started = time.perf_counter()
        piece = body[start : start + chunk]
        logits = model(mx.array(piece)[None], cache=cache)[0].astype(mx.float32)
        mx.eval([c.state for c in cache])
        rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token_logprobs(rows, prompt[start + 1 : start + 1 + len(piece)], 1)
        slowest = max(slowest, time.perf_counter() - started)
    return slowest


async def arrivals_until(stream, started: asyncio.Event, until: asyncio.Event) -> list[float]:
    """When each of the stream's tokens arrived, up to the first one after `until` is
    set; `started` is set once two tokens arrived. Then the stream is cancelled."""
    arrivals: list[float] = []
    async for event in stream:
        arrivals += [time.monotonic()] * len(event.token_ids)
        if len(arrivals) >= 2:
            started.set()
        if until.is_set():
            break
    stream.cancel()
    return arrivals


async def stream_beside_scoring(scheduler, tokenizer, long_prompt: list[int], attempt: int):
    """A stream runs; after its second token `long_prompt` is scored (max_tokens 0).
    Returns the stream's inter-token gaps up to its first token after the scoring
    ended, and how many of its tokens arrived while the prompt was being scored."""
    prompt = tuple(prompt_of(tokenizer, 16))
    stream = scheduler.submit(
        GenerationRequest(f"stream{attempt}", prompt, 600, GREEDY, ignore_eos=True)
    )
    started, scored_done = asyncio.Event(), asyncio.Event()
    watcher = asyncio.create_task(arrivals_until(stream, started, scored_done))
    await started.wait()
    request = GenerationRequest(
        f"scored{attempt}", tuple(long_prompt), 0, GREEDY, prompt_logprobs=1
    )
    submitted = time.monotonic()
    events = await scheduler.submit(request).collect()
    scored_at = time.monotonic()
    scored_done.set()
    arrivals = await watcher
    assert len(events[0].prompt_logprobs) == len(long_prompt) - 1
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return gaps, sum(submitted < t < scored_at for t in arrivals)


async def test_a_long_scored_prompt_does_not_stall_a_running_stream(chunked, reference):
    """While a 3k-token prompt is scored beside it, a stream's tokens keep coming: one
    between every two chunks, and its longest gap is under twice its median gap plus
    the time one chunk takes. (A stall is systematic, this machine's noise is not: a
    timing miss gets one more try.)"""
    tokenizer = reference.tokenizer
    await warm_up(chunked, tokenizer)
    long_prompt = prompt_of(tokenizer, LONG_PROMPT)
    chunk_s = slowest_chunk_seconds(reference.model, long_prompt, CHUNK)
    chunks = (LONG_PROMPT - 1) // CHUNK
    for attempt in range(2):
        gaps, during = await stream_beside_scoring(chunked, tokenizer, long_prompt, attempt)
        assert during >= chunks - 2, f"{during} tokens while {chunks} chunks were scored"
        bound = 2 * statistics.median(gaps) + chunk_s
        if max(gaps) < bound:
            return
    raise AssertionError(
        f"the stream stalled {max(gaps) * 1000:.0f} ms (median gap "
        f"{statistics.median(gaps) * 1000:.1f} ms, one {CHUNK}-token chunk "
        f"{chunk_s * 1000:.1f} ms): gaps {[round(g * 1000) for g in gaps]} ms"
    )


async def test_chunked_prompt_scores_equal_one_plain_forward_and_the_completion_continues(
    chunked, reference
):
    """Scored over several engine steps beside another stream (so across a mode switch
    too), the prompt's scores still equal one plain forward, and the completion decodes
    from the scored cache exactly as plain greedy decoding does."""
    tokenizer = reference.tokenizer
    prompt = prompt_of(tokenizer, 4 * CHUNK + 37)
    other = chunked.submit(
        GenerationRequest("beside", tuple(prompt_of(tokenizer, 9)), 40, GREEDY, ignore_eos=True)
    )
    async with make_client(chunked) as client:
        response = await client.post(
            "/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "echo": True,
                "logprobs": 2,
                "ignore_eos": True,
            },
        )
    await other.collect()
    choice = response.json()["choices"][0]
    assert_prompt_logprobs_match(choice, reference, prompt, 2)
    generated = [t for t, _ in reference_logprobs(reference, prompt, 8)]
    tail = choice["logprobs"]["tokens"][len(prompt) :]
    assert tail == [token_text(tokenizer, t) for t in generated]


async def test_a_cancelled_scoring_request_frees_its_slot(chunked, reference):
    tokenizer = reference.tokenizer
    request = GenerationRequest(
        "cancelled", tuple(prompt_of(tokenizer, LONG_PROMPT)), 4, GREEDY, prompt_logprobs=0
    )
    stream = chunked.submit(request)
    for _ in range(5000):  # polled, not slept: a GPU scores the prompt within 50 ms
        if chunked.num_running:
            break
        await asyncio.sleep(0.001)
    assert chunked.num_running == 1  # being scored counts as running
    stream.cancel()
    after = chunked.submit(GenerationRequest("after", tuple(prompt_of(tokenizer, 8)), 4, GREEDY))
    tokens = [t for e in await after.collect() for t in e.token_ids]
    assert tokens == reference.greedy_until_eos(prompt_of(tokenizer, 8), 4)
    for _ in range(100):
        if chunked.num_running == 0:
            break
        await asyncio.sleep(0.01)
    assert chunked.num_running == 0


class HeldMatcherBuilds:
    """Stands in for `llguidance.LLMatcher`: records which thread builds each matcher,
    and holds the first build until released (or HOLD_S passes)."""

    def __init__(self, real) -> None:
        self._real = real
        self.threads: list[str] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        if not self.entered.is_set():
            self.entered.set()
            self.release.wait(HOLD_S)
        return self._real(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._real, name)  # the static grammar_from_* and validate helpers


async def test_a_grammar_matcher_is_built_off_the_engine_thread(chunked, reference, monkeypatch):
    """While a structured request's matcher is being built, a running stream keeps
    getting tokens: the build runs in the request's worker thread."""
    held = HeldMatcherBuilds(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", held)
    prompt = tuple(prompt_of(reference.tokenizer, 12))
    stream = chunked.submit(GenerationRequest("beside", prompt, 4000, GREEDY, ignore_eos=True))
    tokens: list[int] = []

    async def follow() -> None:
        async for event in stream:
            tokens.extend(event.token_ids)

    follower = asyncio.create_task(follow())
    async with make_client(chunked) as client:
        body = {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "A ball, as JSON"}],
            "max_tokens": 16,
            "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
        }
        reply = asyncio.create_task(client.post("/v1/chat/completions", json=body))
        deadline = time.monotonic() + 2 * HOLD_S
        while not held.entered.is_set():
            assert time.monotonic() < deadline, "no matcher was built"
            await asyncio.sleep(0.01)
        before = len(tokens)
        await asyncio.sleep(0.3)
        during = len(tokens) - before
        held.release.set()
        response = await reply
    stream.cancel()
    await follower
    assert response.status_code == 200, response.text
    assert during > 0, "the stream stopped while the matcher was built"
    assert "tandem-engine" not in held.threads
