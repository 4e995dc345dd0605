"""A prompt served from the prefix cache's disk tier waits for its file while others
decode: the file is read and checked by a reader thread (scheduler/prefix_reads.py),
not on the engine thread, so a slow disk never stalls another request's stream, and the
request still gets exactly the tokens a cold prefill would."""

from __future__ import annotations

import asyncio
import time

from engines.request import GenerationRequest, SamplingParams
from scheduler import prefix_disk
from scheduler.prefix_reads import DiskReads
from tests.test_prefix_disk import MORE, disk_scheduler, long_prompt, run, served_once

SLOW_READ_S = 2.0  # every file read takes this long: a slow disk


async def test_a_slow_disk_read_never_stalls_another_stream(
    tiny_model_dir, reference, tmp_path, monkeypatch
):
    directory = tmp_path / "prefix"
    ids = long_prompt(reference.tokenizer)
    assert await served_once(tiny_model_dir, directory, ids) == 0
    read_entry = prefix_disk.read_entry

    def slow_read(path):
        time.sleep(SLOW_READ_S)
        return read_entry(path)

    monkeypatch.setattr(prefix_disk, "read_entry", slow_read)
    extended = ids + reference.tokenizer.encode(MORE, add_special_tokens=False)
    stream_prompt = reference.tokenizer.encode("The sea was calm and")
    scheduler = disk_scheduler(tiny_model_dir, directory)
    try:
        request = GenerationRequest(
            "stream", tuple(stream_prompt), 1500, SamplingParams(temperature=0.0),
            ignore_eos=True, cache_scope="key-b",
        )  # fmt: skip
        stream = scheduler.submit(request)
        arrivals, streamed = [], []

        async def read_stream(until: asyncio.Event) -> None:
            async for event in stream:
                arrivals.append(time.perf_counter())
                streamed.extend(event.token_ids)
                if until.is_set() and len(arrivals) > 1:
                    break
            stream.cancel()

        done = asyncio.Event()
        reader = asyncio.create_task(read_stream(done))
        while len(arrivals) < 5:
            await asyncio.sleep(0.01)
        sent = time.perf_counter()
        tokens, cached = await run(scheduler, extended)
        answered = time.perf_counter()
        done.set()
        await reader
        disk = scheduler.prefix_stats["disk"]
    finally:
        scheduler.stop()

    assert cached >= len(ids), "the prompt was not served from disk"
    assert tokens == reference.greedy_tokens(extended, 8)
    assert streamed == reference.greedy_tokens(stream_prompt, len(streamed))
    assert answered - sent >= SLOW_READ_S, "the file was not read (slowly) at all"
    gaps = zip(arrivals, arrivals[1:], strict=False)
    during = [b - a for a, b in gaps if sent <= b <= answered]
    assert during and max(during) < SLOW_READ_S / 2, during
    assert disk["read_ahead_seconds"] >= SLOW_READ_S
    assert disk["load_seconds"] < SLOW_READ_S / 2  # the engine thread's part


def test_reads_not_taken_are_bounded_and_errors_come_back(tmp_path):
    """Reads nobody takes (a cancelled request's) are dropped oldest first; an error
    reading a file is handed back for the engine thread to handle."""
    paths = [tmp_path / f"entry-{i}" for i in range(4)]
    for i, path in enumerate(paths[:3]):
        path.write_bytes(bytes([i]))
    reads = DiskReads(lambda path: path.read_bytes())
    for path in paths:
        reads.request(path)
    deadline = time.monotonic() + 10
    while reads.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not reads.busy
    assert reads.take(paths[0]) is None and reads.take(paths[1]) is None  # dropped
    assert reads.take(paths[2]).read == bytes([2])
    failed = reads.take(paths[3])
    assert isinstance(failed.error, FileNotFoundError) and failed.read is None
    assert reads.take(paths[3]) is None  # taken once
    reads.close()
