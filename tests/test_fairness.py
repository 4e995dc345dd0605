"""Fairness between API keys and backpressure on clients that stop reading.

One key must not take every slot and queue place (a per-key cap on running + queued,
round-robin between keys for the next free slot), and a stream whose client stops
reading is paused (its sequence leaves the engine, KV cache kept) and, if still
unread after a timeout, cancelled, so unread streams cannot hold slots forever.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from engines.errors import QueueFull, RequestAborted
from engines.request import GenerationRequest, SamplingParams
from engines.sequence import FinishReason
from server.auth import key_id
from tests.conftest import MODEL_NAME, make_client, start_scheduler

GREEDY = SamplingParams(temperature=0.0)
K1, K2 = "key-one-0123456789", "key-two-0123456789"


def request(rid: str, prompt: list[int], max_tokens: int, key: str) -> GenerationRequest:
    return GenerationRequest(
        rid, tuple(prompt), max_tokens, GREEDY, ignore_eos=True, cache_scope=key_id(key)
    )


@pytest.fixture
def tight(tiny_model_dir):
    scheduler = start_scheduler(
        tiny_model_dir, max_num_seqs=2, max_queue=2, max_unread_events=4, unread_timeout=1.0
    )
    yield scheduler
    scheduler.stop()


async def until_buffered(stream, events: int, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while stream.buffered < events:
        assert time.monotonic() < deadline, f"only {stream.buffered} events in {within}s"
        await asyncio.sleep(0.01)


async def tokens_of(stream) -> list[int]:
    return [t for event in [e async for e in stream] for t in event.token_ids]


async def test_unread_streams_of_one_key_never_refuse_another_key(tight, reference):
    prompt = reference.tokenizer.encode("Once upon")
    k1_streams = []
    with pytest.raises(QueueFull):
        for i in range(8):  # k1 floods: more streams than slots and queue places
            k1_streams.append(tight.submit(request(f"k1-{i}", prompt, 1500, K1)))
    assert len(k1_streams) < 4, "one key took every running and queued place"
    async with make_client(tight, api_keys=(K1, K2)) as client:
        reply = await client.post(
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {K2}"},
            json={
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            },
        )
    assert reply.status_code == 200, reply.text
    for stream in k1_streams:
        stream.cancel()


async def test_the_next_free_slot_goes_to_the_key_that_waited(tight, reference):
    prompt = reference.tokenizer.encode("Once upon")
    short = tight.submit(request("k1-short", prompt, 4, K1))
    long = tight.submit(request("k1-long", prompt, 120, K1))
    k1_later = tight.submit(request("k1-later", prompt, 120, K1))
    k2_first = tight.submit(request("k2-first", prompt, 120, K2))
    first_token_at: dict[str, float] = {}

    async def read(name: str, stream) -> None:
        async for event in stream:
            if event.token_ids:
                first_token_at.setdefault(name, time.monotonic())

    await asyncio.gather(
        read("short", short), read("long", long), read("k1", k1_later), read("k2", k2_first)
    )
    assert first_token_at["k2"] < first_token_at["k1"], "k1's later request went ahead of k2"


async def test_an_unread_stream_stops_generating_then_is_cancelled(tight, reference):
    prompt = reference.tokenizer.encode("Once upon")
    stream = tight.submit(request("unread", prompt, 1500, K1))
    await until_buffered(stream, 5)  # past max_unread_events: it should pause now
    await asyncio.sleep(0.1)
    paused_at = stream.buffered
    await asyncio.sleep(0.3)
    assert stream.buffered == paused_at, "the unread stream kept generating"
    assert 0 < paused_at <= 8
    await asyncio.sleep(1.2)  # past unread_timeout
    tokens = []
    with pytest.raises(RequestAborted, match="stopped reading"):
        async for event in stream:
            tokens += event.token_ids
    assert 0 < len(tokens) < 1500
    await asyncio.sleep(0.05)
    assert tight.num_outstanding == 0


async def test_a_paused_stream_resumes_exactly_when_read_again(tight, reference):
    """Pausing moves the sequence out of the engine and back: no token lost, repeated
    or changed, in either mode (a second stream beside it makes the batch)."""
    prompt = reference.tokenizer.encode("Once upon")
    slow = tight.submit(request("slow", prompt, 60, K1))
    beside = tight.submit(request("beside", prompt, 60, K2))
    await until_buffered(slow, 5)  # both pause: nobody reads
    await until_buffered(beside, 5)
    await asyncio.sleep(0.1)
    assert slow.buffered <= 8
    got_slow, got_beside = await asyncio.gather(tokens_of(slow), tokens_of(beside))
    expected = reference.greedy_tokens(prompt, 60)
    assert got_slow == expected
    assert got_beside == expected


async def test_a_key_at_its_cap_is_refused_while_the_server_has_room(tight, reference):
    prompt = reference.tokenizer.encode("Once upon")
    streams = [tight.submit(request(f"k1-{i}", prompt, 30, K1)) for i in range(3)]
    with pytest.raises(QueueFull, match="this API key"):
        tight.submit(request("k1-over", prompt, 30, K1))
    results = await asyncio.gather(*(s.collect() for s in streams))
    assert all(events[-1].finish_reason == FinishReason.LENGTH for events in results)
    # Its places come back as its requests finish.
    assert (await tight.submit(request("k1-again", prompt, 3, K1)).collect())[-1].final


def test_the_limits_are_flags():
    """Operators set these on the command line; they reach the scheduler and server."""
    from server.cli import build_parser
    from server.serve import build_config

    args = ["--max-per-key", "3", "--max-unread-events", "9", "--unread-timeout", "2.5"]
    argv = ["serve", "/models/m", *args, "--responses-store-mb", "1.5"]
    config = build_config(build_parser().parse_args(argv))
    assert config.scheduler.per_key_limit == 3
    assert (config.scheduler.max_unread_events, config.scheduler.unread_timeout) == (9, 2.5)
    assert config.responses_store_bytes == int(1.5 * (1 << 20))
