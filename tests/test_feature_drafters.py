"""Downloaded drafters fed the target's hidden states through the real engines
(`engines/drafting/feature_drafters.py`, `engines/batched/feature_rows.py`): DFlash
(a block per forward) and EAGLE-3 in both published formats (a chain over a reduced
vocabulary), loaded from their published configs and key names, fed the target's
tapped layers from the forwards that verify, alone and for every row of the batch.

The drafters have random weights (a trained one cannot be made here), so most drafts
are rejected: every test checks exactness -- greedy token-identical to mlx-lm's plain
decoding, sampled equal in distribution -- through rejections, migrations, a prefix
hit and a hybrid target, and that the drafter really drafted.
"""

from __future__ import annotations

import asyncio
import zlib

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import can_trim_prompt_cache

from bench.drafter_checkpoints import write_assistant, write_dflash, write_eagle3
from engines.batched.engine import BatchedSpeculativeEngine
from engines.drafting.feature_drafters import DrafterRefused, drafter_kind, load_feature_drafter
from engines.gating.draft_limits import DISTRUSTED_SAMPLE
from engines.model.registry import ModelRegistry
from engines.request import GenerationRequest, SamplingParams, SpeculationOverrides
from engines.sample.sampling import RandomStream
from engines.sequence import make_sequence
from engines.single.engine import SpeculativeEngine
from engines.spec_config import SpecConfig
from engines.state import SequenceState
from scheduler.prefix_cache import PrefixCache
from tests.conftest import Reference, make_client, start_scheduler
from tests.distributions import assert_same_token_distribution
from tests.test_batched_speculation import (
    COST,
    PROMPTS,
    assert_rows_equal,
    round_trip_through_the_batch,
    run_batch,
)
from tests.test_metrics import scrape, value
from tests.tiny_archs import build_tiny_arch

GREEDY = SamplingParams(temperature=0.0)
DFLASH_ONLY = SpeculationOverrides(enable_pld=False)  # the model drafter alone
KINDS = {  # test name: (--draft-kind, its target (None: the tiny Llama), its checkpoint)
    "dflash": ("dflash", None, lambda out, target: write_dflash(out, target)),
    # SpecForge's format scoring every id; `speculators`' a reduced vocabulary (half)
    "eagle3": (
        "eagle3",
        None,
        lambda out, target: write_eagle3(out, target, aux_ids=[0, 1, 2], draft_vocab=0),
    ),
    "eagle3-speculators": (
        "eagle3",
        None,
        lambda out, target: write_eagle3(out, target, aux_ids=[1, 0, 2], specforge=False),
    ),
    # Gemma 4 (sliding-window and KV-shared layers) with its assistant reading its K/V
    "assistant": ("assistant", "gemma4", lambda out, target: write_assistant(out, target)),
}
HYBRID = {  # on a 4-layer Qwen3.5 hybrid; EAGLE-3's ids left null: (2, L//2, L-3)
    "dflash": lambda out, target: write_dflash(out, target, layer_ids=(1, 3), block_size=6),
    "eagle3": lambda out, target: write_eagle3(out, target),
}


@pytest.fixture(scope="module", params=sorted(KINDS))
def case(request, tiny_model_dir, tmp_path_factory):
    """(kind, target folder, drafter folder) of one drafter kind."""
    kind, arch, write = KINDS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    target = build_tiny_arch(arch, root / "target", tiny_model_dir) if arch else tiny_model_dir
    return kind, target, write(root / "drafter", target)


@pytest.fixture(scope="module")
def drafter(case):
    """(kind, drafter folder)."""
    return case[0], case[2]


@pytest.fixture(scope="module")
def target_dir(case):
    return case[1]


@pytest.fixture(scope="module")
def reference(target_dir):
    """mlx-lm's plain decoding of the case's target (this module's, not conftest's)."""
    return Reference(*load(str(target_dir)))


@pytest.fixture(scope="module", params=sorted(HYBRID))
def hybrid(request, tiny_model_dir, tmp_path_factory):
    """A tiny Qwen3.5 hybrid (recurrent layers) and a drafter reading its layers."""
    root = tmp_path_factory.mktemp(f"{request.param}-hybrid")
    target = build_tiny_arch("qwen3_5", root / "target", tiny_model_dir)
    return target, HYBRID[request.param](root / "drafter", target)


def make_engines(target_dir, drafter_dir):
    registry = ModelRegistry.load(str(target_dir))
    kind = drafter_kind(str(drafter_dir))
    registry.feature_drafter = load_feature_drafter(str(drafter_dir), kind, registry.target)
    spec = SpeculativeEngine(registry, SpecConfig(), cost=COST)
    batched = BatchedSpeculativeEngine(registry, spec.speculation, prefill_step_size=64)
    registry.transfer(batched.name)
    return spec, batched


@pytest.fixture(scope="module")
def engines(case):
    _, target, drafter_dir = case
    return make_engines(target, drafter_dir)


def request(rid, prompt_ids, max_tokens, sampling=GREEDY, speculation=DFLASH_ONLY):
    return GenerationRequest(
        rid, tuple(prompt_ids), max_tokens, sampling, ignore_eos=True, speculation=speculation
    )


def solo(spec, req):
    registry = spec.registry
    registry.transfer(spec.name)
    seq = make_sequence(req, registry.tokenizer)
    spec.admit(seq)
    while spec.active is not None:
        spec.step()
    return seq


def feature_drafted(seqs) -> int:
    """Tokens the feature drafter (whichever kind) drafted for `seqs`."""
    return sum(
        stats.draft_tokens
        for s in seqs
        for method, stats in s.spec.by_method.items()
        if method in ("dflash", "eagle3", "assistant")
    )


def test_the_drafter_kind_is_read_from_its_config(drafter, tiny_model_dir):
    """What --draft-model names is recognised from its config.json; a plain model is one."""
    kind, folder = drafter
    assert drafter_kind(str(folder)) == kind
    assert drafter_kind(str(tiny_model_dir)) == "model"
    assert drafter_kind(str(tiny_model_dir), "dflash") == "dflash"


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_alone_greedy_equals_plain_decoding(engines, reference, prompt):
    spec, _ = engines
    prompt_ids = reference.tokenizer.encode(prompt)
    seq = solo(spec, request("a", prompt_ids, 80))
    assert seq.generated == reference.greedy_tokens(prompt_ids, 80)
    assert feature_drafted([seq]) > 0, "the drafter drafted"


@pytest.mark.parametrize("n", [2, 4])
def test_rows_of_a_batch_each_equal_plain_decoding(engines, reference, n):
    _, batched = engines
    batched.registry.transfer(batched.name)
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:n]]
    lengths = [120 if i == 0 else 40 + 11 * i for i in range(n)]
    pairs = list(enumerate(zip(prompts, lengths, strict=True)))
    seqs, outputs, drafted = run_batch(batched, [request(f"r{i}", p, m) for i, (p, m) in pairs])
    expected = {f"r{i}": reference.greedy_tokens(p, m) for i, (p, m) in pairs}
    assert_rows_equal(seqs, outputs, expected)
    assert drafted > 0 and feature_drafted(seqs.values()) > 0, "rows drafted with DFlash batched"


def test_a_request_carries_its_drafter_cache_into_the_batch_and_back(engines, drafter, reference):
    """Its drafter state (DFlash's context cache, EAGLE-3's chain cache, the assistant's
    newest target state) goes into the batch and back out: it never restarts."""
    spec, batched = engines
    seq, back, _ = round_trip_through_the_batch(spec, batched, reference)
    assert back.drafting.mtp is not None
    if drafter[0] == "assistant":  # no cache of its own: it reads the target's K/V
        assert back.drafting.mtp.newest is not None
    else:
        assert back.drafting.mtp.cache is not None
    assert back.drafting.mtp.start == 0, "the drafter saw every position on both sides"
    assert feature_drafted([seq]) > 0


def test_a_hybrid_target_alone_and_batched(hybrid):
    target, drafter = hybrid
    reference = Reference(*load(str(target)))
    spec, batched = make_engines(target, drafter)
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:3]]
    seq = solo(spec, request("h", prompts[0], 60))
    assert seq.generated == reference.greedy_tokens(prompts[0], 60)
    batched.registry.transfer(batched.name)
    seqs, outputs, _ = run_batch(batched, [request(f"r{i}", p, 50) for i, p in enumerate(prompts)])
    assert_rows_equal(
        seqs, outputs, {f"r{i}": reference.greedy_tokens(p, 50) for i, p in enumerate(prompts)}
    )
    assert feature_drafted([seq, *seqs.values()]) > 0


def test_seeded_rows_give_their_solo_plain_seeded_tokens(engines, reference):
    spec, batched = engines
    sampling = SamplingParams(temperature=1.0, seed=5)
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:3]]
    plain = SpeculationOverrides(num_draft_tokens=0)
    expected = {
        f"s{i}": solo(spec, request(f"s{i}", p, 40, sampling, plain)).generated
        for i, p in enumerate(prompts)
    }
    alone = solo(spec, request("s0", prompts[0], 40, sampling))
    assert alone.generated == expected["s0"]
    batched.registry.transfer(batched.name)
    seqs, _, _ = run_batch(
        batched, [request(f"s{i}", p, 40, sampling) for i, p in enumerate(prompts)]
    )
    for rid, tokens in expected.items():
        assert seqs[rid].generated == tokens, rid


def _second_and_third(engine, prompt_ids, seeds, drafting: bool, batch: int = 16):
    """Tokens 2 and 3 of unseeded sampled 3-token requests, each RNG from a fixed key."""
    overrides = DFLASH_ONLY if drafting else SpeculationOverrides(num_draft_tokens=0)
    sampling = SamplingParams(temperature=1.0)
    pairs, accepted = [], 0
    for start in range(0, len(seeds), batch):
        chunk = seeds[start : start + batch]
        requests = [request(f"s{s}", prompt_ids, 3, sampling, overrides) for s in chunk]
        rngs = {f"s{s}": RandomStream(mx.random.key(s)) for s in chunk}
        seqs, _, _ = run_batch(engine, requests, rngs=rngs)
        pairs += [tuple(seqs[r.request_id].generated[1:]) for r in requests]
        accepted += sum(
            stats.accepted_tokens
            for s in seqs.values()
            for method, stats in s.spec.by_method.items()
            if method in ("dflash", "eagle3", "assistant")
        )
    return pairs, accepted


def test_sampled_rows_match_plain_sampling_distribution(engines, reference):
    _, batched = engines
    batched.registry.transfer(batched.name)
    prompt = reference.tokenizer.encode(PROMPTS[0])
    base = zlib.crc32(b"dflash-sampled") % 10_000
    trials = 1000
    drafted, accepted = _second_and_third(batched, prompt, [base + i for i in range(trials)], True)
    plain, _ = _second_and_third(batched, prompt, [base + trials + i for i in range(trials)], False)
    # random drafters: EAGLE-3's half vocabulary is accepted least (13 of ~1000 drafts)
    assert accepted > 10, "drafts were accepted by the sampled rule, not only rejected"
    assert_same_token_distribution(drafted, plain)


def test_a_drafter_that_does_not_fit_is_refused_naming_the_field(tiny_model_dir, tmp_path):
    registry = ModelRegistry.load(str(tiny_model_dir))
    wide = write_dflash(tmp_path / "wide", tiny_model_dir, hidden_size=96, head_dim=24)
    with pytest.raises(DrafterRefused, match="hidden"):
        load_feature_drafter(str(wide), "dflash", registry.target)
    deep = write_dflash(tmp_path / "deep", tiny_model_dir, layer_ids=(0, 7))
    with pytest.raises(DrafterRefused, match="layer"):
        load_feature_drafter(str(deep), "dflash", registry.target)
    wide = write_eagle3(tmp_path / "eagle-wide", tiny_model_dir, [0, 1, 2], target_hidden_size=96)
    with pytest.raises(DrafterRefused, match="target_hidden_size"):
        load_feature_drafter(str(wide), "eagle3", registry.target)
    deep = write_eagle3(tmp_path / "eagle-deep", tiny_model_dir, [0, 1, 9])
    with pytest.raises(DrafterRefused, match="aux"):
        load_feature_drafter(str(deep), "eagle3", registry.target)
    gemma = build_tiny_arch("gemma4", tmp_path / "gemma4", tiny_model_dir)
    assistant = write_assistant(tmp_path / "assistant", gemma)
    with pytest.raises(DrafterRefused, match="does not fit"):  # a Llama has no Gemma-4 layers
        load_feature_drafter(str(assistant), "assistant", registry.target)


async def test_served_requests_draft_in_the_batch_and_hit_the_prefix_cache(
    target_dir, drafter, reference
):
    """Three concurrent requests batched with the drafter drafting in the batch, then
    a chat twice (the second a prefix-cache hit: on Gemma 4's sliding windows, from the
    checkpoint kept at its system prompt): every answer equals mlx-lm's (the chat's
    equal each other), /metrics counts the drafts under the kind's method, and sampled
    answers tag the tokens drafted by the kind as its (the web page's colours)."""
    kind, drafter_dir = drafter
    scheduler = start_scheduler(target_dir, draft_model=str(drafter_dir), suffix_tokens_per_key=0)
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:3]]
    greedy = {"temperature": 0, "ignore_eos": True, "enable_pld": False}
    chat = {
        "messages": [
            {"role": "system", "content": "You are a storyteller. " + PROMPTS[1]},
            {"role": "user", "content": PROMPTS[0]},
        ],
        "max_tokens": 40,
        **greedy,
    }

    def text(prompt, n):
        detokenizer = reference.tokenizer.detokenizer
        detokenizer.reset()
        for token in reference.greedy_tokens(prompt, n):
            detokenizer.add_token(token)
        detokenizer.finalize()
        return detokenizer.text

    try:
        async with make_client(scheduler) as client:
            # first, one at a time, before greedy rejections lower the batch's prior; seeded,
            # so the same tokens are drafted and accepted on every run
            sampled = {**chat, "temperature": 1.0, "max_tokens": 60, "tandem_token_sources": True}
            tagged = [
                await client.post("/v1/chat/completions", json={**sampled, "seed": seed})
                for seed in range(6)
            ]
            responses = await asyncio.gather(
                *(
                    client.post("/v1/completions", json={"prompt": p, "max_tokens": 60, **greedy})
                    for p in prompts
                )
            )
            first = await client.post("/v1/chat/completions", json=chat)
            again = await client.post("/v1/chat/completions", json=chat)
            metrics = await scrape(client)
        for prompt, response in zip(prompts, responses, strict=True):
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == text(prompt, 60)
        assert first.status_code == again.status_code == 200, again.text
        answer = first.json()["choices"][0]["message"]["content"]
        assert again.json()["choices"][0]["message"]["content"] == answer
        cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0, "the repeated chat started from the prefix cache"
        assert value(metrics, "tandem_spec_draft_tokens_total", method=kind) > 0
        # the web page colours a token by the drafter whose draft it was
        sources = {e["source"] for answer in tagged for e in answer.json()["token_sources"]}
        assert kind in sources, [answer.json().get("speculation") for answer in tagged]
    finally:
        scheduler.stop()


def test_a_block_drafter_is_costed_per_proposal(engines, drafter):
    """DFlash drafts k tokens in one forward: its draft cost does not grow with k (the
    gates, the stop rule and the batch's K would otherwise cut its blocks short); the
    chained kinds pay per token."""
    spec, batched = engines
    cost = spec.costs.model()
    assert cost.draft_step > 0
    if drafter[0] == "dflash":
        assert cost.block_draft and cost.draft_cost(7) == cost.draft_cost(1)
        assert batched.costs.step_cost(2, 7, True) - batched.costs.step_cost(2, 7, False) == (
            batched.costs.step_cost(2, 1, True) - batched.costs.step_cost(2, 1, False)
        )
    else:
        assert not cost.block_draft and cost.draft_cost(7) == 7 * cost.draft_cost(1)


def test_a_prefix_entry_keeps_the_drafters_context(engines, drafter, reference):
    """A finished request's prefix-cache entry keeps DFlash's context K/V, or an EAGLE-3
    chain's pairs (each with the token after it), of the tokens it holds; through the
    real prefix cache -- a prompt extending the entry, and one that shares only part of
    it (the entry cut back) -- a request starting from it drafts with the prompt's
    context (its state starts at 0, never restarted), alone and in the batch, exactly.
    Gemma-4's assistant keeps nothing there: it reads the target's cache, and drafts
    from the hit's first step."""
    kind = drafter[0]
    spec, batched = engines
    prompt = reference.tokenizer.encode(PROMPTS[1])
    registry = spec.registry
    registry.transfer(spec.name)
    seq = make_sequence(request("e", prompt, 30), registry.tokenizer)
    spec.admit(seq)
    released = []
    while spec.active is not None:
        released += spec.step().released
    (entry,) = released
    held = seq.all_tokens[: entry.cached]
    if kind == "assistant":
        assert entry.drafting.draft is None or not entry.drafting.draft.cache
    else:
        ahead = 1 if kind == "eagle3" else 0
        kept = entry.drafting.draft
        assert kept.fed == seq.all_tokens[: len(kept.fed)]
        assert kept.cache[0].offset == len(kept.fed) - ahead >= entry.cached - 1
    other = reference.tokenizer.encode(PROMPTS[2])[:4]
    follows = {"extends": [*held, *prompt[:3]]}
    if can_trim_prompt_cache(entry.cache):  # not Gemma 4's windows: mlx-lm cuts no entry
        follows["cut"] = [*held[:-6], *other]
    prefixes = PrefixCache()
    prefixes.store(held, entry.cache, draft=entry.drafting.draft)
    for name, follow in follows.items():
        expected = reference.greedy_tokens(follow, 40)
        for engine in (spec, batched):
            registry.transfer(engine.name)
            hit = prefixes.lookup(follow)
            assert hit is not None and hit.cached >= len(held) - 6, name
            seq = make_sequence(request("f", follow, 40), registry.tokenizer)
            state = SequenceState.entry(seq, hit.cache, hit.cached, hit.draft)
            engine.admit(state)
            starts = []
            if engine is spec:
                if kind != "assistant":  # the drafter holds the prompt's context already
                    assert engine.active.drafting.mtp.length >= hit.cached - 1, (name, engine.name)
                while engine.active is not None:
                    starts.append(engine.active.drafting.mtp.start)
                    engine.step()
            else:
                while engine.batch_size:
                    starts += [row.drafting.mtp.start for row in engine.rows if row.drafting.mtp]
                    engine.step()
            assert state.seq.generated == expected, (name, engine.name)
            assert feature_drafted([state.seq]) > 0, (name, engine.name)
            if kind != "assistant":
                assert starts and set(starts) == {0}, f"{name}, {engine.name}: restarted"


def test_a_drafter_rejected_over_the_servers_life_starts_each_request_closed(
    tiny_model_dir, tmp_path
):
    """Once a drafter's first token was accepted in under a tenth of its drafts (over
    the server's life, both engines counting), a new request starts its gate closed and
    probes only after DISTRUSTED_COOLDOWN plain tokens, alone and in the batch; a server
    without that history drafts from the first tokens. Output is plain decoding's."""
    folder = write_dflash(tmp_path / "dflash", tiny_model_dir)
    reference = Reference(*load(str(tiny_model_dir)))
    prompt_ids = reference.tokenizer.encode(PROMPTS[0])
    expected = reference.greedy_tokens(prompt_ids, 60)
    fresh_spec, _ = make_engines(tiny_model_dir, folder)
    assert feature_drafted([solo(fresh_spec, request("fresh", prompt_ids, 60))]) > 0

    spec, batched = make_engines(tiny_model_dir, folder)
    spec.limits.learns_trust = True  # as a server's, whose costs are learned (not fixed)
    totals = spec.speculation.totals
    for _ in range(DISTRUSTED_SAMPLE - 1):  # the history: drafts of 4, none accepted
        totals.record("dflash", 4, 0)
    gates = spec.limits.initial_gates(
        make_sequence(request("g", prompt_ids, 60), reference.tokenizer)
    )
    assert gates["draft"].open, "31 drafts are too few to judge"
    totals.record("dflash", 4, 0)
    seq = solo(spec, request("alone", prompt_ids, 60))
    assert seq.generated == expected and feature_drafted([seq]) == 0
    batched.registry.transfer(batched.name)
    prompts = [reference.tokenizer.encode(p) for p in PROMPTS[:2]]
    seqs, outputs, drafted = run_batch(
        batched, [request(f"r{i}", p, 40) for i, p in enumerate(prompts)]
    )
    assert drafted == 0 and feature_drafted(seqs.values()) == 0
    assert_rows_equal(
        seqs, outputs, {f"r{i}": reference.greedy_tokens(p, 40) for i, p in enumerate(prompts)}
    )
    for _ in range(2 * DISTRUSTED_SAMPLE):  # then it is accepted: trusted again
        totals.record("dflash", 4, 2)
    assert spec.limits.initial_gates(
        make_sequence(request("h", prompt_ids, 60), reference.tokenizer)
    )["draft"].open
