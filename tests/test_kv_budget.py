"""The KV memory budget (`--max-kv-gb`, scheduler/kv_budget.py): admission reserves each
request's KV at its prompt + max_tokens, queues what does not fit and refuses what never
could; the prefix cache gives up room to running requests; a budget lowered under
running rows preempts the newest, which resume without a lost or changed token; and a
flood of long requests keeps the process's memory under the weights + the budget + a
stated margin while every request equals its solo decoding."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import pytest
from mlx_lm import load

from engines.model.demo import TinyModelSpec, build_tiny_model
from engines.request import SamplingParams
from scheduler import SchedulerState
from scheduler.kv_budget import GB, KVProfile
from server.cli import build_parser
from server.serve import build_config
from tests.conftest import MODEL_NAME, Reference, make_client, start_scheduler
from tests.test_batched_speculation import PROMPTS, greedy_request
from tests.test_fairness import until_buffered
from tests.test_metrics import scrape, value

GREEDY = SamplingParams(temperature=0.0)


def tokens_of(events) -> list[int]:
    return [t for event in events for t in event.token_ids]


def budget_for(scheduler, reaches: list[int]) -> int:
    """The smallest budget the rows of these reaches fit in together."""
    return scheduler.kv.projected(reaches)


async def watch(scheduler, done: asyncio.Event, seen: dict) -> None:
    """Record the most requests running at once and the most KV measured."""
    while not done.is_set():
        stats = scheduler.kv_stats
        seen["running"] = max(seen.get("running", 0), scheduler.num_running)
        seen["measured"] = max(seen.get("measured", 0), stats["measured_bytes"])
        seen["reserved"] = max(seen.get("reserved", 0), stats["reserved_bytes"])
        await asyncio.sleep(0.005)


def test_the_profile_counts_each_cache_kind_at_its_reach(tiny_model_dir, tmp_path):
    """Full attention grows with every position (in blocks of 256, as caches allocate),
    a sliding window stops at its window, recurrent state is a fixed size."""
    from tests.tiny_archs import build_tiny_arch

    plain = KVProfile.of([load(str(tiny_model_dir))[0]])
    assert plain.per_position == 2 * 2 * 2 * 16 * 4  # layers x (k, v) x heads x dim x f32
    assert plain.bytes_at(1) == plain.bytes_at(256) == 256 * plain.per_position
    assert plain.bytes_at(257) == 512 * plain.per_position
    windowed = KVProfile.of(
        [load(str(build_tiny_arch("sliding", tmp_path / "w", tiny_model_dir)))[0]]
    )
    assert windowed.windows and windowed.bytes_at(4000) - windowed.bytes_at(2000) == (
        (4096 - 2048) * windowed.per_position
    ), "only the full-attention layer grows past the window"
    hybrid = KVProfile.of([load(str(build_tiny_arch("lfm2", tmp_path / "h", tiny_model_dir)))[0]])
    assert hybrid.fixed > 0 and hybrid.per_position > 0


async def test_admission_queues_what_does_not_fit_and_every_request_finishes_exactly(
    tiny_model_dir, reference
):
    prompts = [reference.tokenizer.encode(PROMPTS[i % 4]) for i in range(6)]
    probe = start_scheduler(tiny_model_dir)
    limit = budget_for(probe, [300, 300])  # two requests of about 300 tokens at once
    probe.stop()
    scheduler = start_scheduler(tiny_model_dir, max_kv_bytes=limit)
    try:
        assert scheduler.kv_stats["budget_bytes"] == limit
        done, seen = asyncio.Event(), {}
        watcher = asyncio.create_task(watch(scheduler, done, seen))
        streams = [
            scheduler.submit(greedy_request(f"q{i}", p, 300 - len(p)))
            for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*(s.collect() for s in streams))
        done.set()
        await watcher
        for prompt, events in zip(prompts, results, strict=True):
            assert tokens_of(events) == reference.greedy_tokens(prompt, 300 - len(prompt))
        assert seen["running"] == 2, seen
        assert seen["reserved"] <= limit and seen["measured"] <= limit, seen
        assert scheduler.kv_stats["reserved_requests"] == 0
        assert scheduler.kv_stats["preemptions"] == 0, "admission alone kept it within"
    finally:
        scheduler.stop()


async def test_a_reply_is_cut_to_the_budget_and_a_prompt_that_never_fits_is_a_400(
    tiny_model_dir,
):
    """Asking for more tokens than the budget holds is served up to it with a length
    finish, as the context's room is (an agent's max_tokens 32000 is no error); only a
    prompt whose KV alone could never fit is refused."""
    scheduler = start_scheduler(tiny_model_dir, max_kv_bytes=256 * 512)  # 256 tokens
    try:
        longest = scheduler.kv.longest_alone()
        assert 256 <= longest < 512, longest
        async with make_client(scheduler) as client:
            fits = await client.post(
                "/v1/completions",
                json={"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 20},
            )
            assert fits.status_code == 200, fits.text
            more = await client.post(
                "/v1/completions",
                json={
                    "model": MODEL_NAME,
                    "prompt": "Once upon a time",
                    "max_tokens": 600,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            assert more.status_code == 200, more.text
            usage = more.json()["usage"]
            assert more.json()["choices"][0]["finish_reason"] == "length"
            assert usage["prompt_tokens"] + usage["completion_tokens"] == longest, usage
            over = await client.post(
                "/v1/completions",
                json={"model": MODEL_NAME, "prompt": "Once upon a time " * 200, "max_tokens": 1},
            )
        assert over.status_code == 400, over.text
        assert "KV budget" in over.json()["error"]["message"]
        assert scheduler.state == SchedulerState.READY
    finally:
        scheduler.stop()


async def test_the_prefix_cache_gives_up_room_to_running_requests(tiny_model_dir, reference):
    scheduler = start_scheduler(tiny_model_dir, max_kv_bytes=512 * 512)  # 512 tokens
    try:
        first = reference.tokenizer.encode(PROMPTS[0])
        await scheduler.submit(greedy_request("first", first, 200)).collect()
        await asyncio.sleep(0.05)
        kept = scheduler.kv_stats["prefix_cache_bytes"]
        assert kept > 0, "the finished request's cache is kept for reuse"
        other = reference.tokenizer.encode(PROMPTS[1])
        stream = scheduler.submit(greedy_request("other", other, 500 - len(other)))
        await until_buffered(stream, 2)
        stats = scheduler.kv_stats
        assert stats["prefix_cache_bytes"] < kept, "the prefix cache made room"
        assert stats["reserved_bytes"] + stats["prefix_cache_bytes"] <= stats["budget_bytes"]
        tokens = tokens_of(await stream.collect())
        assert tokens == reference.greedy_tokens(other, 500 - len(other))
    finally:
        scheduler.stop()


async def test_a_lowered_budget_preempts_the_newest_rows_which_resume_exactly(
    tiny_model_dir, reference
):
    """Three requests batched; the budget then drops to what one needs: the newest two
    leave the batch (caches dropped), the oldest runs on, and the two resume one by one
    by prefilling their tokens so far, each equal to its solo decoding."""
    scheduler = start_scheduler(tiny_model_dir)
    try:
        prompts = [reference.tokenizer.encode(PROMPTS[i]) for i in range(3)]
        streams = [scheduler.submit(greedy_request(f"p{i}", p, 200)) for i, p in enumerate(prompts)]
        for stream in streams:
            await until_buffered(stream, 3)
        reach = max(len(p) for p in prompts) + 200
        scheduler.set_kv_limit(budget_for(scheduler, [reach]))
        results = await asyncio.gather(*(s.collect() for s in streams))
        for prompt, events in zip(prompts, results, strict=True):
            assert tokens_of(events) == reference.greedy_tokens(prompt, 200)
        assert scheduler.kv_stats["preemptions"] >= 2
        async with make_client(scheduler) as client:
            metrics = await scrape(client)
            stats = (await client.get("/v1/stats")).json()
        assert value(metrics, "tandem_kv_preemptions_total") >= 2
        assert value(metrics, "tandem_memory_bytes", kind="kv_budget") == (
            budget_for(scheduler, [reach])
        )
        assert stats["kv_budget"]["preemptions"] >= 2
        assert scheduler.state == SchedulerState.READY
    finally:
        scheduler.stop()


def test_max_kv_gb_reaches_the_scheduler_config():
    argv = ["serve", "/models/m", "--max-kv-gb", "1.5"]
    assert build_config(build_parser().parse_args(argv)).scheduler.max_kv_bytes == int(1.5 * GB)
    default = build_config(build_parser().parse_args(["serve", "/models/m"]))
    assert default.scheduler.max_kv_bytes is None  # a share of the machine's memory


# ---- a flood of long requests -------------------------------------------------------------

FLOOD = 16
PROMPT_TOKENS, NEW_TOKENS = 1000, 48
# Prefill activations (a 512-token chunk's attention scores over 1024 positions, 8 heads:
# 16 MB a layer), a merge's transient copy of the batch's caches, MLX's buffer cache;
# measured 101 MB of growth in all on a 40 MB budget (Linux, CPU).
MARGIN = 96 << 20


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """A tiny Llama with 16 KB of KV per token (8 layers x 8 KV heads x 32 x f32 x 2)."""
    spec = TinyModelSpec(
        hidden_size=256,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=256,
        max_position_embeddings=4096,
    )
    return build_tiny_model(tmp_path_factory.mktemp("models") / "wide", spec)


def rss() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.slow
async def test_a_flood_of_long_requests_stays_within_the_budget(wide_model):
    """16 concurrent requests of ~1050 tokens each (20 MB of KV apiece, 320 MB together)
    on a 40 MB budget: the process's resident memory grows by less than the budget +
    MARGIN, and every request returns 200 with its solo decoding."""
    reference = Reference(*load(str(wide_model)))
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)] for _ in range(FLOOD)]
    expected = [reference.greedy_tokens(p, NEW_TOKENS) for p in prompts]
    limit = 40 << 20  # two requests at once
    scheduler = start_scheduler(wide_model, max_kv_bytes=limit, max_num_seqs=FLOOD)
    try:
        unbounded = scheduler.kv.projected([PROMPT_TOKENS + NEW_TOKENS] * FLOOD)
        assert unbounded > 2 * (limit + MARGIN), "without the budget the flood would not fit"
        async with make_client(scheduler) as client:
            warm = {"model": MODEL_NAME, "prompt": prompts[0][:50], "max_tokens": 4}
            assert (await client.post("/v1/completions", json=warm)).status_code == 200
            baseline, peak = rss(), 0
            done = asyncio.Event()

            async def sample() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, rss())
                    await asyncio.sleep(0.01)

            sampler = asyncio.create_task(sample())
            started = time.monotonic()
            bodies = [
                {
                    "model": MODEL_NAME,
                    "prompt": p,
                    "max_tokens": NEW_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                for p in prompts
            ]
            responses = await asyncio.gather(
                *(client.post("/v1/completions", json=body) for body in bodies)
            )
            done.set()
            await sampler
        for response in responses:
            assert response.status_code == 200, response.text
        detokenizer = reference.tokenizer.detokenizer
        for response, tokens in zip(responses, expected, strict=True):
            detokenizer.reset()
            for token in tokens:
                detokenizer.add_token(token)
            detokenizer.finalize()
            assert response.json()["choices"][0]["text"] == detokenizer.text
        assert peak - baseline < limit + MARGIN, (
            f"RSS grew {(peak - baseline) >> 20} MB over {(limit + MARGIN) >> 20} MB "
            f"in {time.monotonic() - started:.1f}s"
        )
        assert scheduler.kv_stats["measured_bytes"] <= limit
    finally:
        scheduler.stop()
