"""Models whose mlx-lm caches cannot trim are served exactly, with speculation: a
sliding-window Llama (`RotatingKVCache(16)` in mlx-lm), gpt-oss (sliding and full
attention layers alternating, sinks, experts), LFM2 and a Qwen3-Next hybrid
(`ArraysCache`). The scheduler finds out at load. Sliding windows get caches that
trim (`ragged_cache.trimmable_windows`: the window kept in order, a few positions
past it), so their drafts roll back by a trim, alone and in the batch, with a
windowed draft model too. Recurrent state rolls back by restoring the caches' state
from before the verify and replaying the accepted tokens (target and draft model
alike); with a recurrent draft model, concurrent requests go into mlx-lm's
BatchGenerator and never migrate back out of it (`test_batched_hybrid.py` has hybrids
drafting inside the batch, with a plain-KV draft). Greedy output equals
`mlx_lm.generate_step` on the same checkpoint; every trim is checked."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from engines.batched.engine import BatchedSpeculativeEngine
from engines.batched.fallback import BatchedEngine
from engines.cache.ragged_cache import RaggedKVCache
from engines.cache.rollback import (
    RollbackError,
    capturing_inputs,
    roll_back,
    supports_rollback,
    supports_snapshot,
    take_snapshot,
    trim_exact,
)
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from engines.sequence import make_sequence
from scheduler import SchedulerState
from tests.conftest import Reference, make_client, start_scheduler
from tests.test_metrics import scrape
from tests.tiny_archs import SLIDING_WINDOW, build_tiny_arch

ARCHS = ("sliding", "gpt_oss", "lfm2", "qwen3_next")
WINDOWED = ("sliding", "gpt_oss")  # their caches trim once loaded by Tandem
CODE_PROMPT = "def add(a, b):\n    return a + b\n" * 4
PROMPTS = [
    "Once upon a time there was a robot",
    "Hello, world! How are you today?",
    "The weather in the mountains changes quickly",
]
MAX_TOKENS = 120
# Every way a request can ask for drafting: PLD alone, the draft model alone, both
# with a longer k than the server's.
SERVER_DEFAULT = SpeculationOverrides()
DRAFTING = {
    "pld": SpeculationOverrides(enable_pld=True, enable_draft=False),
    "draft": SpeculationOverrides(enable_pld=False, enable_draft=True),
    "both-k6": SpeculationOverrides(enable_pld=True, enable_draft=True, num_draft_tokens=6),
}


@pytest.fixture(scope="module")
def arch_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("archs")


@pytest.fixture(scope="module", params=ARCHS)
def arch(request, arch_root, tiny_model_dir):
    """(kind, checkpoint, a perturbed copy of it as its draft, mlx-lm on the checkpoint)."""
    kind = request.param
    target = build_tiny_arch(kind, arch_root / kind, tiny_model_dir)
    draft = build_tiny_arch(kind, arch_root / f"{kind}-draft", tiny_model_dir, noise=0.05)
    model, tokenizer = load(str(target))
    return kind, target, draft, Reference(model, tokenizer)


@pytest.fixture(scope="module")
def served(arch):
    """A scheduler on the arch with PLD on and a draft model; drafting would reject
    some proposals (the draft is perturbed, PLD guesses), so a rollback would be due."""
    kind, target, draft, reference = arch
    # The fixed cost model makes drafting pay wherever it is allowed at all.
    scheduler = start_scheduler(target, draft_model=str(draft))
    yield scheduler, reference
    scheduler.stop()


def repetitive_bias(tokenizer) -> tuple[tuple[int, float], ...]:
    """Push a few prompt tokens up, so the output repeats and PLD finds matches."""
    ids = sorted(set(tokenizer.encode(CODE_PROMPT)))[:3]
    return tuple((token, 6.0) for token in ids)


def greedy_request(rid, prompt_ids, max_tokens, bias=(), speculation=SERVER_DEFAULT):
    sampling = SamplingParams(temperature=0.0, logit_bias=bias)
    return GenerationRequest(
        rid, tuple(prompt_ids), max_tokens, sampling, ignore_eos=True, speculation=speculation
    )


def expected_tokens(reference: Reference, prompt_ids, max_tokens, bias=()) -> list[int]:
    processors = make_logits_processors(logit_bias=dict(bias)) if bias else None
    return reference.greedy_tokens(prompt_ids, max_tokens, logits_processors=processors)


async def collect(stream) -> tuple[list[int], dict | None]:
    events = await stream.collect()
    return [t for event in events for t in event.token_ids], events[-1].speculation


@pytest.mark.parametrize("asked", list(DRAFTING))
async def test_greedy_output_equals_mlx_lm_when_drafting_is_asked_for(served, asked):
    scheduler, reference = served
    windowed = scheduler.config.model.endswith(WINDOWED)
    prompt = reference.tokenizer.encode(CODE_PROMPT)
    bias = repetitive_bias(reference.tokenizer)
    stream = scheduler.submit(greedy_request(asked, prompt, MAX_TOKENS, bias, DRAFTING[asked]))
    tokens, speculation = await collect(stream)
    assert tokens == expected_tokens(reference, prompt, MAX_TOKENS, bias)
    assert scheduler.speculation_supported is True and scheduler.rows_roll_back is windowed
    assert speculation["draft_tokens"] > 0, "nothing was drafted: no rollback to test"
    assert scheduler.state == SchedulerState.READY


async def test_rejected_drafts_were_rolled_back(served):
    """Across the requests above: drafts were accepted and rejected, so the caches were
    restored and replayed (their outputs matched mlx-lm throughout)."""
    scheduler, reference = served
    prompt = reference.tokenizer.encode(CODE_PROMPT)
    bias = repetitive_bias(reference.tokenizer)
    request = greedy_request("rolled", prompt, MAX_TOKENS, bias, DRAFTING["both-k6"])
    tokens, speculation = await collect(scheduler.submit(request))
    assert tokens == expected_tokens(reference, prompt, MAX_TOKENS, bias)
    totals = scheduler.speculative_engine.totals
    assert 0 < totals.accepted_tokens < totals.draft_tokens


async def test_seeded_sampling_with_drafts_equals_seeded_sampling_without(served):
    """A seeded request samples each position with its own key, and drafts are coupled
    to those draws: with drafting on (restores and replays included) the tokens are
    those the same seed gives without drafting."""
    scheduler, reference = served
    prompt = reference.tokenizer.encode(CODE_PROMPT)
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    outputs = []
    for name, ask in (
        ("off", SpeculationOverrides(enable_pld=False, enable_draft=False)),
        ("on", DRAFTING["both-k6"]),
    ):
        request = GenerationRequest(
            f"seeded-{name}", tuple(prompt), 80, sampling, ignore_eos=True, speculation=ask
        )
        outputs.append(await collect(scheduler.submit(request)))
    (plain, _), (drafted, speculation) = outputs
    assert drafted == plain
    assert speculation["draft_tokens"] > 0


async def test_concurrent_requests_are_exact_and_migrate_as_their_caches_allow(served):
    """The first request starts alone (drafting) and moves into the batch when the
    others arrive. Recurrent rows in BatchGenerator cannot be cut back, so nothing
    leaves that batch; sliding windows are batched speculatively, rows leaving at will."""
    scheduler, reference = served
    windowed = scheduler.config.model.endswith(WINDOWED)
    migrated_before = scheduler.counters.migrated_requests
    bias = repetitive_bias(reference.tokenizer)
    jobs = [
        (reference.tokenizer.encode(CODE_PROMPT), MAX_TOKENS, bias),
        (reference.tokenizer.encode(PROMPTS[0]), MAX_TOKENS - 17, ()),
        (reference.tokenizer.encode(PROMPTS[1] * 3), MAX_TOKENS + 11, bias),
    ]
    streams = [
        scheduler.submit(greedy_request(f"c{i}", p, n, b, DRAFTING["both-k6"]))
        for i, (p, n, b) in enumerate(jobs)
    ]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for (prompt, max_tokens, bias), (tokens, _) in zip(jobs, results, strict=True):
        assert tokens == expected_tokens(reference, prompt, max_tokens, bias)
    batched = BatchedSpeculativeEngine if windowed else BatchedEngine
    assert type(scheduler.batched_engine) is batched
    if not windowed:
        assert scheduler.counters.migrated_requests - migrated_before <= 1  # in, never out
    assert scheduler.speculative_engine.active is None
    assert scheduler.state == SchedulerState.READY


async def test_a_follow_up_turn_reuses_the_cache_exactly(served):
    """The prefix cache hands a finished request's BatchGenerator cache to the next
    turn; a cache that cannot be trimmed must hold exactly the tokens it is keyed by."""
    scheduler, reference = served
    first_prompt = reference.tokenizer.encode(PROMPTS[2])
    first, _ = await collect(scheduler.submit(greedy_request("turn-1", first_prompt, 40)))
    follow_up = first_prompt + first + reference.tokenizer.encode(PROMPTS[0])
    events = await scheduler.submit(greedy_request("turn-2", follow_up, 60)).collect()
    assert [t for e in events for t in e.token_ids] == expected_tokens(reference, follow_up, 60)
    assert events[-1].cached_tokens > 0


async def test_scoring_the_prompt_then_decoding_is_exact(served):
    """`echo` + logprobs builds the prompt's cache while scoring it; decoding goes on
    from that cache in the batched engine."""
    scheduler, reference = served
    prompt = reference.tokenizer.encode(PROMPTS[1] * 3)
    request = greedy_request("scored", prompt, 48)
    stream = scheduler.submit(dataclasses.replace(request, prompt_logprobs=1))
    events = await stream.collect()
    assert len(events[0].prompt_logprobs) == len(prompt) - 1
    tokens = [t for event in events for t in event.token_ids]
    assert tokens == expected_tokens(reference, prompt, 48)


async def test_metrics_report_speculation_supported(served, scheduler):
    own, _ = served
    for served_scheduler, supported in ((own, 1.0), (scheduler, 1.0)):  # tiny Llama: 1
        async with make_client(served_scheduler) as client:
            snapshot = await scrape(client)
        assert snapshot[("tandem_speculation_supported", ())] == supported


def test_supports_rollback_only_for_caches_that_trim(arch, reference):
    kind, target, _, arch_reference = arch
    kinds = {type(layer) for layer in make_prompt_cache(arch_reference.model)}
    windowed = kind in WINDOWED
    assert kinds == {KVCache, RotatingKVCache if windowed else ArraysCache}
    assert supports_rollback(arch_reference.model) is False
    assert supports_snapshot(arch_reference.model) is True
    assert supports_rollback(reference.model) is True
    # loaded by Tandem, a sliding window keeps its window in order and trims
    served = ModelRegistry.load(str(target)).target.model
    served_kinds = {type(layer) for layer in make_prompt_cache(served)}
    if windowed:
        assert served_kinds == {KVCache, RaggedKVCache} and supports_rollback(served)
    else:
        assert served_kinds == kinds and not supports_rollback(served)


async def test_a_draft_that_cannot_trim_drafts_for_a_plain_target(tiny_model_dir, arch):
    """The arch as the draft model of the tiny Llama: its cache rolls back between
    proposals (by snapshot, or a trim for a window); the Llama's trims. Output is the
    Llama's own."""
    kind, target, _, _ = arch
    scheduler = start_scheduler(tiny_model_dir, draft_model=str(target))
    try:
        windowed = kind in WINDOWED
        assert scheduler.speculation_supported is True and scheduler.rows_roll_back is windowed
        reference = Reference(*load(str(tiny_model_dir)))
        prompt = reference.tokenizer.encode(CODE_PROMPT)
        ask = DRAFTING["draft"]
        tokens, speculation = await collect(
            scheduler.submit(greedy_request("d", prompt, 60, (), ask))
        )
        assert tokens == expected_tokens(reference, prompt, 60)
        assert speculation["draft_tokens"] > 0
    finally:
        scheduler.stop()


def test_leaving_the_batch_raises_rather_than_keep_a_token_too_many(arch):
    """BatchGenerator has fed the newest token when a sequence leaves; handing the
    cache on needs that token removed. A cache that cannot says so, never silently.
    (Recurrent models only: a sliding window's caches trim, and its batch is Tandem's.)"""
    kind, target, _, reference = arch
    if kind in WINDOWED:
        assert supports_rollback(ModelRegistry.load(str(target)).target.model)
        return
    registry = ModelRegistry.load(str(target))
    engine = BatchedEngine(registry)
    registry.transfer(engine.name)
    prompt = reference.tokenizer.encode(CODE_PROMPT)  # past the sliding window
    engine.admit(make_sequence(greedy_request("leave", prompt, 40), registry.tokenizer))
    for _ in range(3):
        engine.step()
    with pytest.raises(RollbackError):
        engine.hand_over("leave")
    engine.close()


# ---- trim_exact -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lfm2", "qwen3_next"])
def test_a_rollback_reruns_only_the_recurrent_layers(arch_root, tiny_model_dir, kind):
    """With the verify's inputs to the recurrent layers captured, a rollback restores
    their state, reruns just those layers on the kept positions and trims the KV
    layers (no whole-model forward: `model=None`), and the caches are those of a
    forward over the kept tokens alone."""
    model, _ = load(str(build_tiny_arch(kind, arch_root / f"{kind}-unit", tiny_model_dir)))
    context, drafted = list(range(5, 25)), [7, 8, 9, 10, 11]
    cache, reference = make_prompt_cache(model), make_prompt_cache(model)
    mx.eval(model(mx.array(context)[None], cache=cache))
    mx.eval(model(mx.array(context + drafted[:2])[None], cache=reference))
    layer_types = [type(layer) for layer in model.layers]
    snapshot = take_snapshot(cache)
    with capturing_inputs(model, cache, snapshot):
        mx.eval(model(mx.array(drafted)[None], cache=cache))
    assert [type(layer) for layer in model.layers] == layer_types, "layers put back"
    recurrent = {i for i, layer in enumerate(cache) if isinstance(layer, ArraysCache)}
    assert recurrent and set(snapshot.inputs) == recurrent
    roll_back(cache, 3, snapshot, model=None, replay=drafted[:2])
    for mine, theirs in zip(cache, reference, strict=True):
        if isinstance(mine, KVCache):
            assert mine.offset == theirs.offset == len(context) + 2
            pairs = [
                (m[..., : mine.offset, :], t[..., : mine.offset, :])
                for m, t in ((mine.keys, theirs.keys), (mine.values, theirs.values))
            ]
        else:
            pairs = list(zip(mine.cache, theirs.cache, strict=True))
        # Rerunning two positions rounds differently from a forward over all of them, and
        # the recurrent state carries it on: on this CI's CPU (OpenBLAS) Qwen3-Next's
        # state is up to 4.1e-4 away (at a value of 0.17; 1e-4 held on an earlier box).
        # A wrong state or a wrong position is off by far more.
        for a, b in pairs:
            assert a.shape == b.shape and mx.allclose(a, b, atol=1e-3).item()


def filled(cache: list, tokens: int) -> list:
    keys = mx.zeros((1, 2, tokens, 8))
    for layer in cache:
        if isinstance(layer, ArraysCache):
            layer[0] = mx.ones((1, 2, 8))
        else:
            layer.update_and_fetch(keys, keys)
    return cache


def test_trim_exact_removes_exactly_n_from_kv_caches():
    cache = filled([KVCache(), KVCache()], 30)
    trim_exact(cache, 7)
    assert [layer.offset for layer in cache] == [23, 23]
    trim_exact(cache, 0)
    assert [layer.offset for layer in cache] == [23, 23]


def test_trim_exact_within_a_sliding_window_is_exact():
    cache = filled([KVCache(), RotatingKVCache(SLIDING_WINDOW)], SLIDING_WINDOW - 4)
    trim_exact(cache, 3)
    assert [layer.offset for layer in cache] == [SLIDING_WINDOW - 7] * 2


def test_trim_exact_raises_past_a_sliding_window():
    cache = filled([KVCache(), RotatingKVCache(SLIDING_WINDOW)], SLIDING_WINDOW + 5)
    with pytest.raises(RollbackError, match="RotatingKVCache"):
        trim_exact(cache, 2)


def test_trim_exact_raises_on_recurrent_state():
    cache = filled([ArraysCache(size=1), KVCache()], 10)
    with pytest.raises(RollbackError, match="ArraysCache"):
        trim_exact(cache, 1)


def test_trim_exact_raises_when_layers_disagree():
    """A cache list whose layers hold different lengths cannot trim every one by n."""
    cache = [filled([KVCache()], 10)[0], filled([KVCache()], 3)[0]]
    with pytest.raises(RollbackError):
        trim_exact(cache, 5)
