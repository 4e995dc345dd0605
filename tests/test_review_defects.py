"""Regression tests for five engine defects a review reproduced (issue 43): each drove
the engines or the scheduler into an exception, and most took the server to FAILED.

1. Two unread streams paused in one scheduler iteration: the first pause's settle
   finished the second request, which the loop then looked up (KeyError).
2. Seeded sampling in the fallback batched engine (mlx-lm's BatchGenerator, for
   models whose drafting cannot roll back per row) drew from a split key chain, so a
   seeded request's tokens depended on what else ran.
3. A sliding-window draft model's cache lost its window on entering the batch (from a
   migration, or from a prefix-cache hit while batched).
4. Prompt logprobs started while an MTP model was batched built their cache from the
   batched engine's hidden-state tap.
5. A sliding-window draft drafting 11 or more tokens could not roll its draft rows
   back after a slide.
"""

from __future__ import annotations

import asyncio

import pytest
from mlx_lm import load

from engines.batched.drafting import BatchRow, DraftModelRows
from engines.cache.ragged_cache import ragged_from_rows
from engines.drafting.draft import DRAFT
from engines.drafting.prompt_lookup import PromptLookupDrafter
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from engines.sequence import make_sequence
from engines.state import Drafting
from scheduler import SchedulerState
from tests.conftest import Reference, start_scheduler
from tests.test_batched_speculation import (
    PROMPTS,
    greedy_request,
    make_engines,
    round_trip_through_the_batch,
)
from tests.test_fairness import tokens_of, until_buffered
from tests.tiny_archs import SLIDING_WINDOW, build_tiny_arch

DRAFT_ONLY = SpeculationOverrides(enable_pld=False)


@pytest.fixture(scope="module")
def archs(tmp_path_factory, tiny_model_dir) -> dict:
    """Tiny checkpoints sharing the tiny model's tokenizer: a sliding-window Llama and
    a perturbed copy of it (a windowed draft that is sometimes rejected), LFM2 and a
    perturbed LFM2, a Qwen3.5 hybrid with a copying MTP head."""
    root = tmp_path_factory.mktemp("review")
    return {
        "sliding": build_tiny_arch("sliding", root / "sliding", tiny_model_dir),
        "sliding-draft": build_tiny_arch(
            "sliding", root / "sliding-draft", tiny_model_dir, noise=0.05
        ),
        "lfm2": build_tiny_arch("lfm2", root / "lfm2", tiny_model_dir),
        "lfm2-draft": build_tiny_arch("lfm2", root / "lfm2-draft", tiny_model_dir, noise=0.05),
        "mtp": build_tiny_arch("qwen3_5", root / "mtp", tiny_model_dir, mtp="copy"),
    }


def tokens(events) -> list[int]:
    return [t for event in events for t in event.token_ids]


# ---- 1. two pauses in one iteration -----------------------------------------------------


async def test_two_unread_streams_pausing_in_one_iteration_keep_the_server_ready(
    tiny_model_dir, reference
):
    """Two greedy rows batched with drafting off (pipelined plain steps), neither read:
    both pass max_unread_events in the same iteration. Pausing the first settles the
    step in flight, which commits the second's last token and finishes it; the second
    is then not paused but finished, and the first resumes exactly once read."""
    scheduler = start_scheduler(
        tiny_model_dir, enable_pld=False, max_num_seqs=2, max_unread_events=4, unread_timeout=30
    )
    try:
        prompt = reference.tokenizer.encode(PROMPTS[0])
        long = scheduler.submit(greedy_request("a", prompt, 40))
        short = scheduler.submit(greedy_request("b", prompt, 6))
        await until_buffered(long, 5)
        await asyncio.sleep(0.3)  # the iteration that pauses both has run
        assert scheduler.state == SchedulerState.READY, scheduler.error
        got_long, got_short = await asyncio.gather(tokens_of(long), tokens_of(short))
        assert got_short == reference.greedy_tokens(prompt, 6)
        assert got_long == reference.greedy_tokens(prompt, 40)
        assert scheduler.state == SchedulerState.READY, scheduler.error
    finally:
        scheduler.stop()


# ---- 2. seeded sampling in the fallback batched engine --------------------------------


async def test_a_seeded_request_gives_its_solo_tokens_beside_another_in_the_fallback_batch(
    archs,
):
    """LFM2 drafting with an LFM2 draft cannot roll back per row, so two requests batch
    in mlx-lm's BatchGenerator: a seeded request's tokens there equal its tokens alone
    (a seeded token is a function of seed and output position only)."""
    scheduler = start_scheduler(archs["lfm2"], draft_model=str(archs["lfm2-draft"]))
    try:
        assert scheduler.rows_roll_back is False
        tokenizer = scheduler.registry.tokenizer
        prompt = tokenizer.encode(PROMPTS[0])
        sampling = SamplingParams(temperature=1.0, seed=11)

        def seeded(rid):
            return GenerationRequest(rid, tuple(prompt), 24, sampling, ignore_eos=True)

        alone = tokens(await scheduler.submit(seeded("alone")).collect())
        other = greedy_request("other", tokenizer.encode(PROMPTS[1]), 40)
        beside, _ = await asyncio.gather(
            scheduler.submit(seeded("beside")).collect(), scheduler.submit(other).collect()
        )
        assert scheduler.batched_engine is not None, "the two requests were batched"
        assert tokens(beside) == alone
    finally:
        scheduler.stop()


# ---- 3. a sliding-window draft's cache entering the batch -----------------------------


def test_a_windowed_draft_cache_keeps_its_window_when_its_request_joins_the_batch(
    tiny_model_dir, archs, reference
):
    """A request drafting alone with a sliding-window draft moves into the batch beside
    another (its draft cache carried), back out and finishes alone: exact throughout."""
    spec, engine = make_engines(tiny_model_dir, archs["sliding"])
    round_trip_through_the_batch(spec, engine, reference)


async def test_served_windowed_draft_migrates_and_reuses_its_prefix_while_batched(
    tiny_model_dir, archs, reference
):
    """Served: a request drafting alone with the windowed draft is joined by a second
    (migration into the batch), and while the batch runs a follow-up turn hits the
    prefix cache the first left (its draft's windowed layers included). The server
    stays ready and every request equals plain decoding."""
    scheduler = start_scheduler(tiny_model_dir, draft_model=str(archs["sliding"]))
    try:
        first_prompt = reference.tokenizer.encode(PROMPTS[0])
        first = scheduler.submit(greedy_request("first", first_prompt, 40, speculation=DRAFT_ONLY))
        await until_buffered(first, 3)
        long_prompt = reference.tokenizer.encode(PROMPTS[1])
        long = scheduler.submit(greedy_request("long", long_prompt, 200, speculation=DRAFT_ONLY))
        first_tokens = tokens(await first.collect())
        assert first_tokens == reference.greedy_tokens(first_prompt, 40)
        follow_prompt = first_prompt + first_tokens + reference.tokenizer.encode(" and then")
        follow = scheduler.submit(
            greedy_request("follow", follow_prompt, 30, speculation=DRAFT_ONLY)
        )
        follow_events = await follow.collect()
        assert follow_events[-1].cached_tokens > len(first_prompt), "a prefix-cache hit"
        assert tokens(follow_events) == reference.greedy_tokens(follow_prompt, 30)
        assert tokens(await long.collect()) == reference.greedy_tokens(long_prompt, 200)
        assert scheduler.state == SchedulerState.READY, scheduler.error
    finally:
        scheduler.stop()


# ---- 4. prompt logprobs while an MTP model is batched ---------------------------------


async def test_prompt_logprobs_start_while_an_mtp_model_is_batched(archs):
    scheduler = start_scheduler(archs["mtp"])
    try:
        reference = Reference(*load(str(archs["mtp"])))
        prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:3]]
        running = [
            scheduler.submit(greedy_request(f"r{i}", p, 80)) for i, p in enumerate(prompts[:2])
        ]
        await until_buffered(running[0], 3)
        await until_buffered(running[1], 3)
        scored = GenerationRequest(
            "scored",
            tuple(prompts[2]),
            10,
            SamplingParams(temperature=0.0),
            ignore_eos=True,
            prompt_logprobs=1,
        )
        events = await scheduler.submit(scored).collect()
        assert events[-1].error is None, events[-1].error
        assert len(events[0].prompt_logprobs) == len(prompts[2]) - 1
        assert tokens(events) == reference.greedy_tokens(prompts[2], 10)
        for prompt, stream in zip(prompts, running, strict=False):
            assert tokens(await stream.collect()) == reference.greedy_tokens(prompt, 80)
        assert scheduler.state == SchedulerState.READY, scheduler.error
    finally:
        scheduler.stop()


# ---- 5. a windowed draft drafting more than the slide's slack ---------------------------


@pytest.mark.parametrize("k", [8, 11, 16])
def test_windowed_draft_rows_roll_back_whole_drafts_rejected_across_slides(
    tiny_model_dir, archs, reference, k
):
    """The batch's draft-model rows with a sliding-window draft: every step each row
    drafts k tokens and the target rejects the first (its committed token differs),
    so each row rolls back all k - 1 drafts it fed, while its window slides many times
    (one slide lands inside each chain position in turn). After every step each row's
    draft rows hold exactly its committed tokens, and its next drafts equal those of a
    fresh draft cache fed the same tokens."""
    registry = ModelRegistry.load(str(tiny_model_dir), str(archs["sliding"]))
    model = registry.draft.model
    vocab = reference.tokenizer.vocab_size
    drafter = DraftModelRows(model, vocab, chunk=64)
    rows = []
    for i in range(2):
        request = greedy_request(f"d{i}", reference.tokenizer.encode(PROMPTS[i]), 200)
        seq = make_sequence(request, registry.tokenizer)
        rows.append(BatchRow(seq, Drafting({}, PromptLookupDrafter())))
    cache = ragged_from_rows([drafter.join(row, None) for row in rows])
    for _ in range(2 * SLIDING_WINDOW + k):
        for row in rows:
            row.method, row.draft_length = DRAFT, k
        drafter.draft(cache, rows)
        for row in rows:
            row.seq.commit((row.drafts[0] + 1) % vocab)  # the first draft is rejected
    assert any(max(layer.starts) > 0 for layer in cache if layer.window), "windows slid"
    drafter.draft(cache, rows)
    for i, row in enumerate(rows):
        fresh = BatchRow(row.seq, Drafting({}, PromptLookupDrafter()), method=DRAFT, draft_length=k)
        fresh_cache = ragged_from_rows([drafter.join(fresh, None)])
        drafter.draft(fresh_cache, [fresh])
        assert row.drafts == fresh.drafts, i
